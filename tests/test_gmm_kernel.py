"""Pallas grouped matmul (pallas_kernels/moe/gmm.py) vs its pure-JAX reference, in interpret mode on
fresh random inputs; the SwiGLU helper and the MoE layer's "pallas" impl vs the dense path.

Tolerances: fp32 in / fp32 out, and bf16 in / fp32 out: max |err| <= 1e-5 * max |ref| (fp32
accumulation in both; bf16 x bf16 products are exact in fp32). bf16 in / bf16 out: max |err| <=
2^-7 * max |ref| (one bf16 ulp at the largest magnitude: kernel and reference both round an fp32
sum, and the sums differ in the last fp32 bits, so a rounding can flip by one ulp).
Every kernel run starts from a NaN-poisoned output buffer, so an output tile the kernel fails to
write shows up as NaN; rows past sum(group_sizes) must be exactly 0.

Quantized rhs (int8 / fp8 QuantizedWeight stacks) vs the float64 product with the DEQUANTIZED
weight, per element: |err| <= (K + 2) u (|x| @ |w_deq|), u = 2^-24, as tests/test_quantize.py
argues: q and the scales are exact in fp32, int8 adds one rounding (the output scale), fp8 one
(q * scale), plus an fp32 dot over K terms. With bf16 lhs, int8 is under the same bound (q is
exact in bf16, bf16 x bf16 products are exact in fp32); fp8 then rounds each dequantized weight
to bf16 (relative 2^-8) on top.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.models import quant
from pallas_kernels.moe import (GmmBlockSizes, gmm, gmm_reference, make_group_metadata, swiglu_experts_gmm,
                                swiglu_experts_tiled)

SMALL = GmmBlockSizes(block_m=8, block_k=128, block_n=128)


def _inputs(seed, sizes, M, K, N, dtype):
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((M, K)).astype(np.float32) + 0.1  # never all zeros
    rhs = rng.standard_normal((len(sizes), K, N)).astype(np.float32) / np.sqrt(K) + 0.01
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(sizes, jnp.int32)


def _check(got, want, sizes, M, rel):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    assert not np.isnan(got).any(), "unwritten output tile (NaN poison survived)"
    total = min(sum(sizes), M)
    assert (got[total:] == 0).all(), "rows past sum(group_sizes) must be exactly 0"
    scale = np.abs(want[:total]).max() if total else 1.0
    assert np.abs(got - want).max() <= rel * scale, np.abs(got - want).max() / scale


# (group sizes, M, K, N): empty groups, groups straddling row tiles, M not a multiple of the tile,
# one group holding all rows, rows past sum(group_sizes), sizes summing past M, all groups empty.
CASES = [
    ([0, 5, 0, 17, 1, 0, 9, 0], 32, 256, 256),  # 2 K blocks x 2 N blocks
    ([0, 29, 0], 29, 128, 128),                  # one group takes every row; M % 8 != 0
    ([3, 3, 3, 3], 21, 128, 256),                # four groups inside tiles; rows 12..20 in no group
    ([0, 0, 0, 7], 20, 256, 128),                # only the last group; trailing empty tiles
    ([10, 30], 24, 128, 128),                    # sizes sum past M: cut at M
    ([0, 0], 16, 128, 128),                      # no rows in any group: all zeros
]


@pytest.mark.smoke
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gmm_fp32_matches_reference(case):
    sizes, M, K, N = CASES[case]
    lhs, rhs, gs = _inputs(case, sizes, M, K, N, jnp.float32)
    got = gmm(lhs, rhs, gs, block_sizes=SMALL, interpret=True, poison_output=True)
    assert got.dtype == jnp.float32
    _check(got, gmm_reference(lhs, rhs, gs), sizes, M, rel=1e-5)


@pytest.mark.smoke
@pytest.mark.parametrize("case", [0, 2])
@pytest.mark.parametrize("out_dtype,rel", [(jnp.bfloat16, 2.0 ** -7), (jnp.float32, 1e-5)])
def test_gmm_bf16_matches_reference(case, out_dtype, rel):
    sizes, M, K, N = CASES[case]
    lhs, rhs, gs = _inputs(100 + case, sizes, M, K, N, jnp.bfloat16)
    bs = GmmBlockSizes(block_m=16, block_k=128, block_n=128)  # 16-bit dtypes: row tile multiple of 16
    got = gmm(lhs, rhs, gs, block_sizes=bs, interpret=True, preferred_element_type=out_dtype, poison_output=True)
    assert got.dtype == out_dtype
    _check(got, gmm_reference(lhs, rhs, gs, preferred_element_type=out_dtype), sizes, M, rel=rel)


@pytest.mark.smoke
def test_gmm_whole_dim_blocks_and_default_block_sizes():
    """K, N smaller than the blocks (tiny-model dims 64 / 32): the blocks shrink to the whole dim;
    with the default 128-row tile every group shares one row tile."""
    sizes, M, K, N = [4, 0, 9, 2], 19, 64, 32
    lhs, rhs, gs = _inputs(7, sizes, M, K, N, jnp.float32)
    got = gmm(lhs, rhs, gs, interpret=True, poison_output=True)
    _check(got, gmm_reference(lhs, rhs, gs), sizes, M, rel=1e-5)


@pytest.mark.parametrize("K,N", [(192, 384), (256, 192)])
def test_gmm_default_blocks_fit_dims_128_does_not_divide(K, N):
    """An expert FFN of 768 split over 4 devices (SDAR-30B-A3B, model=4) is 192 wide: the default
    blocks take the whole 192 (128 does not divide it) and 128 elsewhere; given blocks that do not
    divide still raise (test_gmm_validation_errors)."""
    from pallas_kernels.moe.gmm import default_block_sizes
    assert default_block_sizes(K, N) == GmmBlockSizes(128, 128 if K % 128 == 0 else K, 128 if N % 128 == 0 else N)
    sizes, M = [5, 0, 11], 16
    lhs, rhs, gs = _inputs(3, sizes, M, K, N, jnp.float32)
    got = gmm(lhs, rhs, gs, interpret=True, poison_output=True)
    _check(got, gmm_reference(lhs, rhs, gs), sizes, M, rel=1e-5)


@pytest.mark.smoke
def test_group_metadata_visits_every_tile_once_per_group():
    """Schedule invariants, on many random group sizes: each row tile is visited (consecutively)
    once for every group with rows in it, or once if it has none; the visit count fits the grid."""
    rng = np.random.default_rng(0)
    schedule = jax.jit(make_group_metadata, static_argnums=(1, 2))
    tm = 8
    for i in range(24):
        G, M = (1, 8, 5)[i % 3], (7, 61)[i % 2]  # few shapes: one compile each
        sizes = rng.integers(0, 20, G) * (rng.random(G) < 0.7)
        offs, gids, tids, nv = (np.asarray(a) for a in schedule(jnp.asarray(sizes, jnp.int32), M, tm))
        tiles_m = -(-M // tm)
        nv = int(nv[0])
        assert len(gids) == tiles_m + G - 1 and 1 <= nv <= len(gids)
        ends = np.minimum(np.cumsum(sizes), M)
        starts = np.concatenate([[0], ends[:-1]])
        want = []
        for t in range(tiles_m):
            touching = [g for g in range(G) if max(starts[g], t * tm) < min(ends[g], (t + 1) * tm)]
            want += [(t, g) for g in touching] or [(t, None)]
        got = [(int(t), int(g)) for t, g in zip(tids[:nv], gids[:nv])]
        assert [t for t, _ in got] == [t for t, _ in want]
        assert all(w is None or g == w for (_, g), (_, w) in zip(got, want))
        assert (tids[nv:] == tids[nv - 1]).all() and (gids[nv:] == gids[nv - 1]).all()
        np.testing.assert_array_equal(offs, np.concatenate([[0], ends]))


@pytest.mark.smoke
def test_gmm_validation_errors():
    f32 = jnp.float32
    lhs, rhs, gs = jnp.ones((16, 128), f32), jnp.ones((2, 128, 256), f32), jnp.array([8, 8], jnp.int32)
    bad = [
        (dict(lhs=jnp.ones((2, 16, 128), f32)), "lhs must be 2-D"),
        (dict(rhs=jnp.ones((128, 256), f32)), "rhs must be 3-D"),
        (dict(rhs=jnp.ones((2, 64, 256), f32)), "contraction dims differ"),
        (dict(gs=jnp.array([16], jnp.int32)), "group_sizes has 1 entries"),
        (dict(gs=jnp.array([8.0, 8.0])), "group_sizes must be an integer"),
        (dict(rhs=jnp.ones((2, 128, 256), jnp.bfloat16)), "dtypes differ"),
        (dict(lhs=jnp.ones((16, 128), jnp.int32), rhs=jnp.ones((2, 128, 256), jnp.int32)), "not supported"),
        (dict(bs=GmmBlockSizes(12, 128, 128)), "multiple of 8"),
        (dict(bs=GmmBlockSizes(8, 128, 96)), "does not divide N=256"),
        (dict(bs=GmmBlockSizes(8, 128, 64), rhs=jnp.ones((2, 128, 128), f32)), "multiple of 128"),
        (dict(bs=GmmBlockSizes(8, 0, 128)), "positive int"),
        (dict(lhs=jnp.ones((16, 128), jnp.bfloat16), rhs=jnp.ones((2, 128, 256), jnp.bfloat16)), "multiple of 16"),
    ]
    for kw, msg in bad:
        a = dict(lhs=lhs, rhs=rhs, gs=gs, bs=SMALL)
        a.update(kw)
        with pytest.raises(ValueError, match=msg):
            gmm(a["lhs"], a["rhs"], a["gs"], block_sizes=a["bs"], interpret=True)


@pytest.mark.smoke
def test_gmm_lowers_for_tpu():
    """The kernel lowers to a Mosaic TPU custom call (block shapes, scalar prefetch, compiler
    params accepted) at LLaDA-MoE-7B-A1B sizes. Mosaic's own compile needs a TPU: not run here."""
    from jax import export
    f = jax.jit(lambda x, g, a, b, c: swiglu_experts_gmm(x, g, a, b, c))
    bf16 = jnp.bfloat16
    exp = export.export(f, platforms=["tpu"])(
        jax.ShapeDtypeStruct((4096, 2048), bf16), jax.ShapeDtypeStruct((64,), jnp.int32),
        jax.ShapeDtypeStruct((64, 2048, 1024), bf16), jax.ShapeDtypeStruct((64, 2048, 1024), bf16),
        jax.ShapeDtypeStruct((64, 1024, 2048), bf16))
    assert "tpu_custom_call" in exp.mlir_module()


@pytest.mark.smoke
def test_swiglu_experts_gmm_matches_tiled_and_loop():
    """Uneven groups (empty, straddling tiles, rows past the sum) at tiny-model dims."""
    sizes, R, D, F = [0, 5, 0, 11, 1, 0, 6, 0], 26, 64, 32
    rng = np.random.default_rng(3)
    x = rng.standard_normal((R, D)).astype(np.float32)
    wg, wu, wd = (rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((8, D, F), (8, D, F), (8, F, D)))
    want = np.zeros((R, D))
    row = 0
    for e, n in enumerate(sizes):
        for r in range(row, row + n):
            g, u = x[r].astype(np.float64) @ wg[e], x[r].astype(np.float64) @ wu[e]
            want[r] = (g / (1 + np.exp(-g)) * u) @ wd[e]
        row += n
    args = (jnp.asarray(x), jnp.asarray(sizes, jnp.int32), jnp.asarray(wg), jnp.asarray(wu), jnp.asarray(wd))
    got = np.asarray(swiglu_experts_gmm(*args, block_sizes=SMALL, interpret=True))
    tiled = np.asarray(swiglu_experts_tiled(*args, tile=8))
    scale = np.abs(want).max()
    assert (got[sum(sizes):] == 0).all()
    assert np.abs(got - want).max() <= 1e-5 * scale
    assert np.abs(got - tiled).max() <= 1e-5 * scale


@pytest.mark.smoke
def test_moe_experts_pallas_equals_dense():
    from dinfer_jax.models.moe import experts_dense, experts_pallas, route
    rng = np.random.default_rng(5)
    T, D, F, E = 13, 16, 8, 8
    x = np.abs(rng.standard_normal((T, D))).astype(np.float32)
    w_router = rng.standard_normal((D, E)).astype(np.float32) * 0.3
    w_router[:, 0] = 2.0  # every token routes to expert 0; experts 5..7 get none
    w_router[:, 5:] = -2.0
    wg, wu = (rng.standard_normal((E, D, F)).astype(np.float32) * 0.3 for _ in range(2))
    wd = rng.standard_normal((E, F, D)).astype(np.float32) * 0.3
    weights, experts = route(jnp.asarray(x), jnp.asarray(w_router), 2, False)
    args = (jnp.asarray(x), weights, experts, jnp.asarray(wg), jnp.asarray(wu), jnp.asarray(wd))
    want = np.asarray(jax.jit(experts_dense)(*args))
    got = np.asarray(jax.jit(experts_pallas)(*args))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.smoke
def test_moe_impl_table_and_auto(monkeypatch):
    from dinfer_jax import kernels
    assert "pallas" in kernels.EXPERT_IMPLS and kernels.expert_impl("pallas") == "pallas"
    for backend, want in (("cpu", "tiled"), ("tpu", "pallas"), ("gpu", "ragged")):
        monkeypatch.setattr(kernels.jax, "default_backend", lambda b=backend: b)
        assert kernels.expert_impl("auto") == want, backend


@pytest.mark.smoke
def test_model_with_pallas_moe_equals_dense():
    """The whole tiny LLaDA-MoE forward (2 layers, 8 experts top-2) with moe_impl='pallas'."""
    from dinfer_jax.families import preset
    from dinfer_jax.model import Model
    from dinfer_jax.models import init_params
    cfg = preset("tiny")
    # Random params of init_params' shapes, without running its (slow on CPU) init.
    rng = np.random.default_rng(4)
    shapes = jax.eval_shape(lambda: init_params(cfg, seed=4))
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.asarray((1.0 + 0.1 * rng.standard_normal(a.shape)) if "norm" in jax.tree_util.keystr(path)
                                    else 0.05 * rng.standard_normal(a.shape), a.dtype), shapes)
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 11))
    want = Model(cfg, params, "dense").logits(ids)
    got = Model(cfg, params, "pallas").logits(ids)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def _quantized_stack(seed, shape, kind):
    """A QuantizedWeight (jnp leaves) of a random (G, K, N) stack with per-column magnitudes
    spread over e^+-2 (so the per-channel / per-block scales differ), and its float64 dequantized
    weight computed independently of quant.dequantize."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[:1] + (1,) + shape[2:]))
    qw = quant.quantize(w.astype(np.float32), kind)
    q, sc = np.asarray(qw.q).astype(np.float64), np.asarray(qw.scale, np.float64)
    if kind == "fp8":
        K, N = shape[1:]
        sc = np.repeat(np.repeat(sc, 128, axis=1), 128, axis=2)[:, :K, :N]
    return jax.tree_util.tree_map(jnp.asarray, qw), q * sc


def _grouped64(x, w_GKN, sizes):
    """Float64 per-group product (rows past sum(sizes) stay 0)."""
    out, row = np.zeros((x.shape[0], w_GKN.shape[2])), 0
    for g, n in enumerate(sizes):
        n = max(0, min(n, x.shape[0] - row))
        out[row:row + n] = x[row:row + n] @ w_GKN[g]
        row += n
    return out


QCASES = CASES[:4] + [([4, 0, 9, 2], 19, 200, 96)]  # + whole-dim blocks, K, N not multiples of 128


@pytest.mark.smoke
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("case", range(len(QCASES)))
def test_gmm_quantized_matches_float64_of_dequantized(kind, case):
    """Uneven groups with empty ones, rows past the groups' sum, several K and N blocks (SMALL),
    and whole-dim tiles over partial fp8 scale blocks (K=200, N=96)."""
    sizes, M, K, N = QCASES[case]
    qw, w64 = _quantized_stack(200 + case, (len(sizes), K, N), kind)
    x = np.random.default_rng(300 + case).standard_normal((M, K)).astype(np.float32)
    bs = SMALL if case < 4 else GmmBlockSizes(block_m=8, block_k=256, block_n=128)  # shrink to K, N
    got = gmm(jnp.asarray(x), qw.q, jnp.asarray(sizes, jnp.int32), rhs_scale=qw.scale, block_sizes=bs,
              interpret=True, poison_output=True)
    assert got.dtype == jnp.float32
    got = np.asarray(got, np.float64)
    x64 = x.astype(np.float64)
    ref, mag = _grouped64(x64, w64, sizes), _grouped64(np.abs(x64), np.abs(w64), sizes)
    _check(got, ref, sizes, M, rel=1e-5)  # NaN poison, exact zeros past the groups
    assert np.all(np.abs(got - ref) <= (K + 2) * 2.0 ** -24 * mag + 1e-30)


@pytest.mark.smoke
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_gmm_quantized_bf16_lhs(kind):
    sizes, M, K, N = CASES[0]
    qw, w64 = _quantized_stack(7, (len(sizes), K, N), kind)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((M, K)), jnp.bfloat16)
    bs = GmmBlockSizes(block_m=16, block_k=128, block_n=128)
    got = np.asarray(gmm(x, qw.q, jnp.asarray(sizes, jnp.int32), rhs_scale=qw.scale, block_sizes=bs, interpret=True,
                         preferred_element_type=jnp.float32, poison_output=True), np.float64)
    x64 = np.asarray(x, np.float64)
    ref, mag = _grouped64(x64, w64, sizes), _grouped64(np.abs(x64), np.abs(w64), sizes)
    _check(got, ref, sizes, M, rel=1e-2)
    rel = (K + 2) * 2.0 ** -24 + (2.0 ** -8 if kind == "fp8" else 0.0)
    assert np.all(np.abs(got - ref) <= rel * mag + 1e-30)


@pytest.mark.smoke
def test_gmm_quantized_validation_errors():
    x, gs = jnp.ones((16, 256), jnp.float32), jnp.array([8, 8], jnp.int32)
    qi, _ = _quantized_stack(0, (2, 256, 256), "int8")
    qf, _ = _quantized_stack(0, (2, 256, 256), "fp8")
    bad = [
        (qi.q, None, "needs its rhs_scale"),
        (qi.q, qf.scale, r"needs an fp32 rhs_scale of shape \(2, 1, 256\)"),
        (qf.q, qi.scale, r"needs an fp32 rhs_scale of shape \(2, 2, 2\)"),
        (qi.q, qi.scale.astype(jnp.bfloat16), "needs an fp32 rhs_scale"),
        (jnp.ones((2, 256, 256), jnp.float32), qi.scale, "must be int8 or float8_e4m3fn"),
    ]
    for rhs, scale, msg in bad:
        with pytest.raises(ValueError, match=msg):
            gmm(x, rhs, gs, rhs_scale=scale, block_sizes=SMALL, interpret=True)
    with pytest.raises(ValueError, match="in-first"):
        swiglu_experts_gmm(x, gs, quant.QuantizedWeight(qi.q, qi.scale, "int8", 1, 1, True), qi, qi, interpret=True)


@pytest.mark.smoke
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_swiglu_experts_gmm_quantized_matches_tiled(kind):
    """Quantized gate / up / down stacks: the Pallas path vs the tiled scan (quant.matmul per
    tile) and vs a float64 per-row loop over the dequantized experts. Three fp32 matmuls (K <= 256)
    and a SwiGLU: 1e-4 of the output scale, as in tests/test_quantize.py's grouped expert test."""
    sizes, R, D, F = [0, 5, 0, 11, 1, 0, 6, 0], 26, 256, 128  # rows 23..25 in no group
    E = len(sizes)
    (qg, g64), (qu, u64), (qd, d64) = (_quantized_stack(10 + i, s, kind) for i, s in
                                       enumerate(((E, D, F), (E, D, F), (E, F, D))))
    x = np.random.default_rng(4).standard_normal((R, D)).astype(np.float32) * 0.5
    want, row = np.zeros((R, D)), 0
    for e, n in enumerate(sizes):
        for r in range(row, row + n):
            g, u = x[r].astype(np.float64) @ g64[e], x[r].astype(np.float64) @ u64[e]
            want[r] = (g / (1 + np.exp(-g)) * u) @ d64[e]
        row += n
    args = (jnp.asarray(x), jnp.asarray(sizes, jnp.int32), qg, qu, qd)
    got = np.asarray(swiglu_experts_gmm(*args, block_sizes=SMALL, interpret=True))
    tiled = np.asarray(jax.jit(lambda *a: swiglu_experts_tiled(*a, tile=8))(*args))
    scale = np.abs(want).max()
    assert got.dtype == np.float32 and (got[sum(sizes):] == 0).all()
    assert np.abs(got - want).max() <= 1e-4 * scale
    assert np.abs(got - tiled).max() <= 1e-4 * scale


@pytest.mark.smoke
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_gmm_quantized_lowers_for_tpu(kind):
    """Quantized experts at LLaDA-MoE-7B-A1B shapes (E=64, D=2048, F=1024; gate / up (E, D, F),
    down (E, F, D); a few hundred rows) lower to Mosaic custom calls that take the 1-byte weights:
    no dequantized (E, K, N) stack appears in the program. Mosaic's own compile needs a TPU."""
    from jax import export
    E, D, F, R = 64, 2048, 1024, 384
    bf16 = jnp.bfloat16
    ws = quant.quantize_abstract({f"mlp/{n}": jax.ShapeDtypeStruct(s, bf16) for n, s in
                                  (("gate_proj", (E, D, F)), ("up_proj", (E, D, F)), ("down_proj", (E, F, D)))}, kind)
    f = jax.jit(lambda x, g, a, b, c: swiglu_experts_gmm(x, g, a, b, c))
    exp = export.export(f, platforms=["tpu"])(jax.ShapeDtypeStruct((R, D), bf16), jax.ShapeDtypeStruct((E,), jnp.int32),
                                              ws["mlp/gate_proj"], ws["mlp/up_proj"], ws["mlp/down_proj"])
    text = exp.mlir_module()
    assert "tpu_custom_call" in text
    qt = "i8" if kind == "int8" else "f8E4M3FN"
    assert f"tensor<64x2048x1024x{qt}>" in text and f"tensor<64x1024x2048x{qt}>" in text
    for dt in ("bf16", "f32"):
        for shape in ("64x2048x1024", "64x1024x2048"):
            assert f"tensor<{shape}x{dt}>" not in text, (shape, dt)


@pytest.mark.smoke
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_moe_picks_pallas_for_quantized_experts_on_tpu(kind, monkeypatch):
    """On a TPU target (faked: jax.default_backend), "auto" sends quantized experts to the Pallas
    kernel (no more rerouting to "tiled"): the exported TPU program holds the dlm_gmm kernel."""
    from jax import export
    from dinfer_jax.families import preset
    from dinfer_jax.models import moe
    cfg = preset("tiny")
    monkeypatch.setattr(moe.jax, "default_backend", lambda: "tpu")
    calls = []
    real_pallas = moe.experts_pallas
    monkeypatch.setattr(moe, "experts_pallas", lambda *a, **k: calls.append(1) or real_pallas(*a, **k))
    monkeypatch.setattr(moe, "experts_tiled", lambda *a, **k: pytest.fail("quantized experts took the tiled path"))
    layer = moe.MoE(cfg, dtype=jnp.bfloat16)
    x = jax.ShapeDtypeStruct((1, 8, cfg.hidden_size), jnp.bfloat16)
    params = jax.eval_shape(lambda: layer.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype)))["params"]
    params = jax.tree_util.tree_map(lambda p: getattr(p, "value", p), params,
                                    is_leaf=lambda p: hasattr(p, "value"))
    flat = {f"mlp/{k}": v for k, v in params.items()}
    qp = {k[4:]: v for k, v in quant.quantize_abstract(flat, kind).items()}
    assert isinstance(qp["gate_proj"], quant.QuantizedWeight)
    exp = export.export(jax.jit(lambda p, x: layer.apply({"params": p}, x)), platforms=["tpu"])(qp, x)
    assert calls and "dlm_gmm" in exp.mlir_module()
