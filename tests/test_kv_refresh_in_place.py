"""A refresh writes its K/V into the carried cache inside the layer scan (Transformer kv_in_place,
stacked.scan_layers' update): no second stacked cache. Checked against the plain forward (fresh K/V,
validated against transformers in test_parity_transformers.py) plus a per-row select, on a model
with a leading dense layer (both stacks update the one cache), for all rows and for gathered rows."""
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.cache import cache_shape
from dinfer_jax.families import preset
from dinfer_jax.kernels import KernelConfig
from dinfer_jax.models import Transformer, init_params

CFG = preset("tiny-llada2")  # first_k_dense = 1, MoE, block-causal


@pytest.fixture(scope="module")
def setup():
    assert CFG.first_k_dense == 1
    module = Transformer(CFG, kernels=KernelConfig(experts="dense"))
    params = init_params(CFG, seed=0)
    B, L = 3, 16
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 120, (B, L)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    shape = cache_shape(CFG.num_layers, B, L, CFG.num_kv_heads, CFG.head_dim)
    old = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    apply = lambda **kw: module.apply({"params": params}, **kw)  # noqa: E731
    fresh_logits, fresh_kv = apply(tokens_BS=tokens, positions_BS=pos)
    return apply, tokens, pos, old, fresh_logits, fresh_kv


def _refresh(apply, tokens, pos, old, write_R, rows=None):
    R, L = tokens.shape
    return apply(tokens_BS=tokens, positions_BS=pos, kv=old, window_start=0, key_positions_BL=pos,
                 kv_write_BS=jnp.broadcast_to(jnp.asarray(write_R)[:, None], (R, L)), kv_in_place=True, kv_rows=rows)


def test_refresh_in_place_all_rows(setup):
    apply, tokens, pos, old, fresh_logits, fresh_kv = setup
    need = np.array([True, False, True])
    logits, kv = _refresh(apply, tokens, pos, old, need)
    for new, a, f in zip(kv, old, fresh_kv):
        want = np.where(need[None, :, None, None], np.asarray(f), np.asarray(a))
        np.testing.assert_allclose(np.asarray(new), want, rtol=0, atol=1e-6)
    # the refreshed rows attend over their fresh K/V: their logits are the plain forward's
    np.testing.assert_allclose(np.asarray(logits)[need], np.asarray(fresh_logits)[need], rtol=0, atol=1e-5)


def test_refresh_in_place_gathered_rows(setup):
    """kv_rows = (2, 0): row 2 refreshes, row 0 rides along without writing, row 1 is not touched."""
    apply, tokens, pos, old, fresh_logits, fresh_kv = setup
    rows = jnp.asarray([2, 0], jnp.int32)
    logits, kv = _refresh(apply, tokens[rows], pos[rows], old, np.array([True, False]), rows=rows)
    refreshed = np.array([False, False, True])
    for new, a, f in zip(kv, old, fresh_kv):
        want = np.where(refreshed[None, :, None, None], np.asarray(f), np.asarray(a))
        np.testing.assert_allclose(np.asarray(new), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logits)[0], np.asarray(fresh_logits)[2], rtol=0, atol=1e-5)


def test_in_place_needs_a_cache(setup):
    apply, tokens, pos, *_ = setup
    with pytest.raises(ValueError, match="kv_in_place / kv_rows update a given kv cache"):
        apply(tokens_BS=tokens, positions_BS=pos, kv_in_place=True)


@pytest.mark.parametrize("name,kw", [("tiny-sdar", {}), ("tiny-llada2", {}),
                                     ("tiny-sdar", dict(sub_block_length=2, sub_block_cache=True))])
def test_block_windows_persist_into_the_carried_cache(name, kw):
    """The block loop's persisting windows (the commit window; with the sub-block DualCache, the block
    window) write their rows' K/V into the carried cache layer by layer: the lowered program has no
    select between two stacked (layers, B, L, K*H) caches. It had one per persisting window (a where of
    the forward's new stacked cache against the old): on TPU a second cache-sized temporary, SDAR-1.7B
    at batch 16 on one v5e 3.33 -> 1.63 GiB of temps (docs/accelerators.md). The tokens are checked
    against host references in test_block_diffusion.py, test_sdar.py, test_fast_dllm_v2_block_cache.py."""
    import re

    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.model import Model
    cfg = preset(name)
    model = Model(cfg, init_params(cfg, seed=0))
    p = SamplingParams.for_model(cfg, gen_length=16, cache="block", **kw)
    text = model.generator.lower([np.arange(1, 9, dtype=np.int32)] * 2, p).as_text()
    stacked = r"tensor<%dx\d+x\d+x%dx(?:f|bf)\d+>" % (cfg.num_layers, cfg.num_kv_heads * cfg.head_dim)
    assert re.search(stacked, text), "the pattern must see the stacked cache"
    assert not re.findall(r"stablehlo\.select [^:]*: tensor<[^>]*>, " + stacked, text)
