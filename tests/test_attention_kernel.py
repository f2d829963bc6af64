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

from dinfer_jax.kernels import attention
from pallas_kernels.attention import BlockSizes, flash_attention
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


def _positions(seed, B, S, L):
    """Window queries at random per-row offsets into an L-long canvas; keys at 0..L-1."""
    starts = np.random.RandomState(seed).randint(0, L - S + 1, B)
    q_pos = jnp.asarray(starts[:, None] + np.arange(S)[None, :], jnp.int32)
    return q_pos, jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))


def _rel(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# Each case runs on both kernel bodies (Mosaic-TPU grid with a kv reduction axis and VMEM scratch;
# Triton fori_loop over kv tiles), block-causal (block_size) or not; the tile sizes force several
# q and kv tiles, and S / L that are not tile multiples.
CASES = [
    # B, S, L, N, K, H, pad, block_size, BlockSizes
    (2, 16, 300, 4, 4, 64, None, 0, BlockSizes(8, 128)),       # MHA, H 64: 2 kv heads per 128-lane block
    (2, 13, 270, 4, 2, 64, [0, 9], 8, BlockSizes(8, 128)),     # odd S and L, padded keys, GQA 2, block-causal
    (1, 24, 200, 8, 2, 128, [5], 32, BlockSizes(16, 128)),     # GQA 4:1 (LLaDA2 ratio), H 128, block-causal
    (3, 8, 140, 4, 1, 32, [0, 3, 140], 0, BlockSizes(8, 128)), # MQA; one row with one valid key, one fully masked
]


@pytest.mark.parametrize("B,S,L,N,K,H,pad,block_size,bs,dtype,backend", [
    c + (jnp.float32, backend) for c in CASES for backend in ("tpu", "gpu")] + [
    c + (jnp.bfloat16, backend) for c in CASES[1:3] for backend in ("tpu", "gpu")])  # bf16: each body's casts
def test_kernel_matches_reference(B, S, L, N, K, H, pad, block_size, bs, dtype, backend):
    q, k, v, mask = _inputs(B * 100 + S, B, S, L, N, K, H, dtype, pad)
    q_pos, k_pos = _positions(S, B, S, L)
    kw = dict(q_pos_BS=q_pos, k_pos_BL=k_pos, block_size=block_size)
    out = flash_attention(q, k, v, mask, **kw, block_sizes=bs, backend=backend, interpret=True, poison_output=True)
    ref = attention_reference(q, k, v, mask, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel(out, ref) <= TOL[dtype]


def test_gpu_body_pads_a_query_group_that_is_not_a_power_of_two():
    """Triton needs a power-of-2 query group: G = 3 (6/2) and 7 (7/1, as Qwen2.5-7B's 28/4) are padded
    with zero queries to 4 / 8 and sliced back; outputs equal the reference, block-causal included."""
    for seed, (N, K) in enumerate(((6, 2), (7, 1))):
        q, k, v, mask = _inputs(40 + seed, 2, 13, 150, N, K, 32, jnp.float32, [0, 7])
        q_pos, k_pos = _positions(seed, 2, 13, 150)
        kw = dict(q_pos_BS=q_pos, k_pos_BL=k_pos, block_size=8)
        out = flash_attention(q, k, v, mask, **kw, block_sizes=BlockSizes(8, 128), backend="gpu", interpret=True,
                              poison_output=True)
        assert out.shape == q.shape
        assert _rel(out, attention_reference(q, k, v, mask, **kw)) <= TOL[jnp.float32], (N, K)


# The GPU body's kv split (flash-decoding), forced at small shapes (BlockSizes.kv_splits): grid
# (B, K, nq, n_split), fp32 partials merged in JAX. 270 keys: a partial last tile (fp32 H 64: 5
# 64-key tiles in chunks of 2, 2, 1; bf16: 3 128-key tiles in 3 chunks); 600 keys: 5 128-key tiles in
# 2 chunks of 3 and 2 (a shorter last chunk); the MQA case: row 1 has one valid key (139), so its first chunk (keys 0-127) is all masked, and row
# 2 has none (the reference's uniform average); block-causal rows see no key at all in later chunks.
SPLIT_CASES = [
    # B, S, L, N, K, H, pad, block_size, BlockSizes
    (2, 13, 270, 4, 2, 64, [0, 9], 8, BlockSizes(8, 128, kv_splits=3)),      # GQA 2, block-causal, odd S, L
    (1, 24, 600, 8, 2, 32, [5], 32, BlockSizes(16, 128, kv_splits=2)),      # GQA 4:1, unequal chunks
    (3, 8, 140, 4, 1, 32, [0, 139, 140], 0, BlockSizes(8, 128, kv_splits=2)),  # MQA; masked chunk / row
]


@pytest.mark.parametrize("B,S,L,N,K,H,pad,block_size,bs,dtype", [
    c + (jnp.float32,) for c in SPLIT_CASES] + [c + (jnp.bfloat16,) for c in SPLIT_CASES[:2]])
def test_gpu_kv_split_matches_reference(B, S, L, N, K, H, pad, block_size, bs, dtype):
    from pallas_kernels.attention import gpu as kmod
    t = kmod.gpu_tiles(S, L, N // K, H, jnp.dtype(dtype).itemsize, bs, B=B, K=K)
    assert t["n_split"] == min(bs.kv_splits, t["L_pad"] // t["bkv"]) > 1, t
    q, k, v, mask = _inputs(B * 100 + S + 1, B, S, L, N, K, H, dtype, pad)
    q_pos, k_pos = _positions(S + 1, B, S, L)
    kw = dict(q_pos_BS=q_pos, k_pos_BL=k_pos, block_size=block_size)
    out = flash_attention(q, k, v, mask, **kw, block_sizes=bs, backend="gpu", interpret=True, poison_output=True)
    ref = attention_reference(q, k, v, mask, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel(out, ref) <= TOL[dtype]


def test_gpu_kv_split_pads_a_query_group_that_is_not_a_power_of_two():
    """The split path behind the G = 7 (7/1) and 3 (6/2) group padding, block-causal, 2 chunks."""
    for seed, (N, K) in enumerate(((6, 2), (7, 1))):
        q, k, v, mask = _inputs(50 + seed, 2, 13, 150, N, K, 32, jnp.float32, [0, 7])
        q_pos, k_pos = _positions(seed, 2, 13, 150)
        kw = dict(q_pos_BS=q_pos, k_pos_BL=k_pos, block_size=8)
        out = flash_attention(q, k, v, mask, **kw, block_sizes=BlockSizes(8, 128, kv_splits=2), backend="gpu",
                              interpret=True, poison_output=True)
        assert out.shape == q.shape
        assert _rel(out, attention_reference(q, k, v, mask, **kw)) <= TOL[jnp.float32], (N, K)


def test_gpu_kv_split_poison_catches_an_unwritten_output(monkeypatch):
    """Positive control for poison_output on the split path: a kernel that never writes its running
    sums l (it is handed the m output twice) leaves them NaN, and the merged output shows it."""
    from pallas_kernels.attention import gpu as kmod
    B, S, L, N, K, H = 1, 8, 384, 2, 1, 16  # a shape no other test uses (jit cache)
    q, k, v, mask = _inputs(11, B, S, L, N, K, H, jnp.float32, [3])
    bs = BlockSizes(8, 128, kv_splits=3)
    good = flash_attention(q, k, v, mask, block_sizes=bs, backend="gpu", interpret=True, poison_output=True)
    assert _rel(good, attention_reference(q, k, v, mask)) <= TOL[jnp.float32]
    orig = kmod._gpu_kernel

    def skip_l(*refs, **kw):
        orig(*refs[:-1], refs[-2], **kw)  # (..., acc, m, l) -> (..., acc, m, m): l never written
    monkeypatch.setattr(kmod, "_gpu_kernel", skip_l)
    bad = flash_attention(q, k, v, mask, block_sizes=bs, scale=0.5, backend="gpu", interpret=True,
                          poison_output=True)  # scale: a new trace (not the cached `good` one)
    assert np.isnan(np.asarray(bad)).any()


def test_gpu_split_rule():
    """The split is picked only when B*K*nq programs leave SMs idle: LLaDA-MoE's window (S=64 over
    L=4096, 16/16 heads, H=128, bf16) gets 8 chunks of 8 tiles at B=1 (16 -> 128 programs of the
    H200's 132) and none at B=8 (128 programs, where the unsplit kernel beat XLA 2.65x)."""
    from pallas_kernels.attention import gpu as kmod, gpu_split as ksplit
    one = kmod.gpu_tiles(64, 4096, 1, 128, 2, BlockSizes(64, 512), B=1, K=16)
    assert (one["n_split"], one["chunk_blocks"], one["bkv"]) == (8, 8, 64)
    assert kmod.gpu_tiles(64, 4096, 1, 128, 2, BlockSizes(64, 512), B=8, K=16)["n_split"] == 1
    # LLaDA2's B 16 window at 16/4 heads (64 programs; measured 2.66x XLA unsplit) is left unsplit
    assert kmod.gpu_tiles(32, 4096, 4, 128, 2, BlockSizes(64, 512), B=16, K=4)["n_split"] == 1
    assert kmod.gpu_tiles(64, 4096, 1, 128, 2, BlockSizes(64, 512, kv_splits=1), B=1, K=16)["n_split"] == 1
    assert kmod.gpu_tiles(64, 4096, 1, 128, 2, BlockSizes(64, 512), B=1, K=16, target_programs=16)["n_split"] == 1
    for programs in (1, 2, 3, 16, 33, 65, 66, 131, 132, 1000):
        for tiles in (1, 2, 3, 5, 17, 64, 512):
            n, chunk = ksplit.gpu_split(programs, tiles)
            assert 1 <= n <= tiles and (n - 1) * chunk < tiles <= n * chunk, (programs, tiles)  # no empty chunk
            assert n == 1 or (programs * n <= ksplit.GPU_TARGET_PROGRAMS and chunk >= ksplit.GPU_MIN_SPLIT_TILES)
            small = programs <= ksplit.GPU_TARGET_PROGRAMS // ksplit.GPU_SPLIT_MAX_FRACTION
            assert (n > 1) == (small and tiles >= 2 * ksplit.GPU_MIN_SPLIT_TILES)
    assert ksplit.gpu_split(16, 17, kv_splits=5) == (5, 4) and ksplit.gpu_split(16, 3, kv_splits=8) == (3, 1)


def test_gpu_tiles_fit_shared_memory_and_triton_rules():
    """The Triton body's tiles at every shape of the lowering matrix (tests/test_attention_lowering.py)
    and the real models' window / refresh shapes: powers of two, R = G*bq in [16, 128], and the K/V
    tiles in flight within GPU_SMEM_BUDGET (an H200 refused the earlier bkv = 512 tiles: 'Shared memory
    size limit exceeded: requested 561152, available: 232448'; jax.export cannot see this, only the
    Triton compile on a GPU does)."""
    from pallas_kernels.attention import gpu as kmod
    from tests.test_attention_lowering import HEADS, WINDOWS
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    shapes = [(S, L) for _, S, L in WINDOWS] + [(64, 512), (512, 512), (32, 4096), (2048, 2048)]
    for N, K, H in HEADS:
        G = 1 << (N // K - 1).bit_length()  # the padded group
        for S, L in shapes:
            for itemsize in (2, 4):
                t = kmod.gpu_tiles(S, L, G, H, itemsize, kmod.BlockSizes())
                assert all(pow2(t[k]) for k in ("bq", "bkv", "R")), t
                assert 16 <= t["R"] <= kmod.GPU_MAX_ROWS and t["R"] == G * t["bq"], t
                assert t["bkv"] >= 16 and t["L_pad"] % t["bkv"] == 0 and t["S_pad"] % t["bq"] == 0, t
                assert t["smem_kv_bytes"] <= kmod.GPU_SMEM_BUDGET < 232448, t
    # the shape the H200 refused now gets 64-key tiles (bf16, H 128): 2 stages x (K + V) x 64 x 128 x 2 B
    t = kmod.gpu_tiles(64, 4096, 1, 128, 2, kmod.BlockSizes(64, 512))
    assert (t["bq"], t["bkv"], t["smem_kv_bytes"]) == (64, 64, 65536)


def test_fully_masked_rows_give_the_reference_uniform_average():
    """A row whose every key is masked (padding, or block-causal with no earlier key) averages V
    over the L real keys like the reference; tile-padding keys never count."""
    B, S, L, N, K, H = 2, 8, 150, 2, 1, 16
    q, k, v, _ = _inputs(3, B, S, L, N, K, H, jnp.float32)
    mask = jnp.stack([jnp.zeros(L, bool), jnp.arange(L) >= 100])  # row 0: nothing; row 1: keys >= 100
    q_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))  # row 1 queries: block 0, keys >= 100 later
    k_pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    kw = dict(q_pos_BS=q_pos, k_pos_BL=k_pos, block_size=16)
    ref = attention_reference(q, k, v, mask, **kw)
    np.testing.assert_allclose(ref, jnp.broadcast_to(v.mean(1)[:, None], ref.shape), rtol=1e-5, atol=1e-6)
    for backend, bs in (("tpu", BlockSizes(8, 128)), ("gpu", BlockSizes(8, 128)),
                        ("gpu", BlockSizes(8, 128, kv_splits=2))):  # the kv split: 2 chunks, each all masked
        out = flash_attention(q, k, v, mask, **kw, block_sizes=bs, backend=backend,
                              interpret=True, poison_output=True)
        assert _rel(out, ref) <= 1e-5, (backend, bs)


def test_dispatcher_impls_agree():
    q, k, v, mask = _inputs(7, 2, 8, 32, 4, 2, 16, jnp.float32, [0, 4])
    ref = attention(q, k, v, mask, impl="reference")
    for impl in ("xla", "pallas"):
        assert _rel(attention(q, k, v, mask, impl=impl, interpret=True), ref) <= 1e-5, impl
    q_pos, k_pos = _positions(1, 2, 8, 32)
    kw = dict(q_pos_BS=q_pos, k_pos_BL=k_pos, block_size=4)
    ref = attention(q, k, v, mask, impl="reference", **kw)
    assert _rel(attention(q, k, v, mask, impl="pallas", interpret=True, **kw), ref) <= 1e-5


def test_auto_and_interpret_follow_the_target_platform(monkeypatch):
    """"auto" -> "pallas" on TPU/GPU targets and "xla" on CPU; the kernel is interpreted only for a CPU
    target: a TPU target on this CPU host calls flash_attention with interpret=False."""
    import dinfer_jax.kernels as attn
    assert [attn.attention_impl("auto", p) for p in ("cpu", "tpu", "cuda", "gpu")] == ["xla", "pallas", "pallas", "pallas"]
    seen = []
    monkeypatch.setattr(attn, "flash_attention", lambda *a, **kw: seen.append((kw["backend"], kw["interpret"])) or a[0])
    q, k, v, _ = _inputs(0, 1, 8, 16, 4, 2, 16, jnp.float32)
    for platform in ("tpu", "cuda", "cpu"):
        attn.attention(q, k, v, impl="auto", platform=platform)
    assert seen == [("tpu", False), ("gpu", False)]
    attn.attention(q, k, v, impl="pallas", platform="cpu")
    attn.attention(q, k, v, impl="pallas", platform="tpu", interpret=True)
    assert seen[2:] == [("tpu", True), ("tpu", True)]
    with pytest.raises(ValueError, match="unknown platform 'metal'"):
        attn.attention(q, k, v, platform="metal")


@pytest.mark.parametrize("kw,msg", [
    (dict(H=12), r"head_dim=12 is not supported"),
    (dict(K=3), "4 query heads is not a multiple of 3 kv heads"),
    (dict(bs=BlockSizes(12, 128)), r"BlockSizes.block_q=12 must be a positive multiple of 8"),
    (dict(bs=BlockSizes(8, 64)), r"BlockSizes.block_kv=64 must be a positive multiple of 128"),
    (dict(bs=BlockSizes(8, 128, kv_splits=-1)), r"BlockSizes.kv_splits=-1 must be an int >= 0"),
    (dict(block_size=4), r"block-causal attention \(block_size > 0\) needs q_pos_BS and k_pos_BL"),
    (dict(backend="cuda"), r"backend 'cuda' is not one of \('tpu', 'gpu'\)"),
])
def test_clear_errors(kw, msg):
    H, K, N, bs = kw.get("H", 16), kw.get("K", 2), kw.get("N", 4), kw.get("bs", BlockSizes(8, 128))
    q, k, v, _ = _inputs(0, 1, 8, 16, N, K, H, jnp.float32)
    with pytest.raises(ValueError, match=msg):
        flash_attention(q, k, v, block_sizes=bs, block_size=kw.get("block_size", 0),
                        backend=kw.get("backend", "tpu"), interpret=True)


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
