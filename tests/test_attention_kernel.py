"""Pallas flash attention (interpret mode on CPU) vs the pure-JAX reference, on fresh random
inputs; the output buffer is poisoned with NaN first, so an unwritten tile fails the test.

Tolerances: ||out - ref|| / ||ref|| <= 1e-5 for fp32 (online softmax vs one-pass softmax
reassociate sums: ~1e-7 observed) and <= 2e-2 for bf16 inputs (the output is rounded to bf16,
relative step 2^-8 = 3.9e-3, and the reference also rounds).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import BlockSizes, attention, flash_attention
from pallas_kernels.attention.reference import attention_reference

pytestmark = pytest.mark.smoke  # no torch; also checks the Pallas API on the newest jax

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _inputs(seed, B, S, L, N, K, H, dtype, pad=None):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, S, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, L, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, L, K, H), jnp.float32).astype(dtype)
    mask = None
    if pad is not None:
        mask = jnp.arange(L)[None, :] >= jnp.asarray(pad)[:, None]
    return q, k, v, mask


def _rel(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("B,S,L,N,K,H,pad,bs", [
    (2, 16, 64, 4, 4, 64, None, BlockSizes(8, 16)),       # block window over a cache, MHA
    (2, 13, 70, 4, 2, 64, [0, 9], BlockSizes(8, 32)),     # non-multiple S and L, padded keys, GQA 2
    (1, 24, 24, 8, 2, 128, [5], BlockSizes(16, 8)),       # full-sequence case (S == L), GQA 4, H 128
    (3, 8, 40, 4, 1, 32, [0, 3, 39], BlockSizes(8, 16)),  # MQA; one row with a single valid key
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_reference(B, S, L, N, K, H, pad, bs, dtype):
    q, k, v, mask = _inputs(B * 100 + S, B, S, L, N, K, H, dtype, pad)
    out = flash_attention(q, k, v, mask, block_sizes=bs, interpret=True, poison_output=True)
    ref = attention_reference(q, k, v, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel(out, ref) <= TOL[dtype]


def test_dispatcher_impls_agree():
    q, k, v, mask = _inputs(7, 2, 8, 32, 4, 2, 16, jnp.float32, [0, 4])
    ref = attention(q, k, v, mask, impl="reference")
    for impl in ("xla", "pallas"):
        assert _rel(attention(q, k, v, mask, impl=impl, interpret=True), ref) <= 1e-5, impl


@pytest.mark.parametrize("kw,msg", [
    (dict(H=12), r"head_dim=12 is not supported"),
    (dict(K=3), "4 query heads is not a multiple of 3 kv heads"),
    (dict(bs=BlockSizes(12, 16)), r"BlockSizes.block_q=12 must be a positive multiple of 8"),
])
def test_clear_errors(kw, msg):
    H, K, bs = kw.get("H", 16), kw.get("K", 2), kw.get("bs", BlockSizes(8, 8))
    q, k, v, _ = _inputs(0, 1, 8, 16, 4, K, H, jnp.float32)
    with pytest.raises(ValueError, match=msg):
        flash_attention(q, k, v, block_sizes=bs, interpret=True)


def test_unknown_impl():
    q, k, v, _ = _inputs(0, 1, 8, 16, 4, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="attention impl 'cuda' is not one of"):
        attention(q, k, v, impl="cuda")


def test_model_logits_pallas_equal_xla():
    from dinfer_jax import preset
    from dinfer_jax.model import Model
    from dinfer_jax.models import init_params
    cfg = preset("tiny")
    params = init_params(cfg, seed=4)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 20))
    mask = np.ones_like(ids, bool)
    mask[1, :6] = False
    a = Model(cfg, params, attention_impl="xla").logits(ids, key_mask=mask)
    b = Model(cfg, params, attention_impl="pallas").logits(ids, key_mask=mask)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
