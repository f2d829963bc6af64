"""MoE: sorted ragged_dot path == tile-padded scan path == dense all-experts einsum == a per-expert
float64 Python loop."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.models.moe import experts_dense, experts_ragged, experts_tiled, route
from dinfer_jax.kernels import KernelConfig
from pallas_kernels.moe import swiglu_experts_tiled

pytestmark = pytest.mark.smoke


def moe_loop_np(x, w_router, wg, wu, wd, top_k, renorm):
    """Token-by-token, expert-by-expert reference in float64 (HF OLMoE/LLaDA-MoE semantics)."""
    x = x.astype(np.float64)
    logits = x @ w_router
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    counts = np.zeros(wg.shape[0], int)
    for t in range(x.shape[0]):
        top = np.argsort(-p[t], kind="stable")[:top_k]
        w = p[t, top] / (p[t, top].sum() if renorm else 1.0)
        for e, we in zip(top, w):
            g, u = x[t] @ wg[e], x[t] @ wu[e]
            y[t] += we * ((g / (1 + np.exp(-g))) * u) @ wd[e]
            counts[e] += 1
    return y, counts


def make(rng, T=13, D=16, F=8, E=8, skew=True):
    x = np.abs(rng.randn(T, D)).astype(np.float32)
    w_router = rng.randn(D, E).astype(np.float32) * 0.3
    if skew:
        w_router[:, 0] = 2.0  # every token routes to expert 0 (uneven load)
        w_router[:, 5:] = -2.0  # experts 5..7 never receive a token
    wg, wu, wd = (rng.randn(E, D, F).astype(np.float32) * 0.3, rng.randn(E, D, F).astype(np.float32) * 0.3,
                  rng.randn(E, F, D).astype(np.float32) * 0.3)
    return x, w_router, wg, wu, wd


@pytest.mark.parametrize("top_k,renorm,skew", [(2, False, True), (3, True, True), (2, False, False), (1, False, False)])
def test_ragged_equals_dense_equals_loop(rng, top_k, renorm, skew):
    x, w_router, wg, wu, wd = make(rng, skew=skew)
    want, counts = moe_loop_np(x, w_router, wg, wu, wd, top_k, renorm)
    if skew:
        assert counts[0] == x.shape[0] and (counts[5:] == 0).all()  # the case under test really happens
    weights, experts = route(jnp.asarray(x), jnp.asarray(w_router), top_k, renorm)
    args = (jnp.asarray(x), weights, experts, jnp.asarray(wg), jnp.asarray(wu), jnp.asarray(wd))
    dense = np.asarray(jax.jit(experts_dense)(*args))
    ragged = np.asarray(jax.jit(experts_ragged)(*args))
    tiled = np.asarray(jax.jit(experts_tiled)(*args))
    scale = np.abs(want).max()
    for got in (dense, ragged, tiled):  # fp32 vs float64: ~1e-7 relative observed
        assert np.abs(got - want).max() <= 1e-5 * scale


@pytest.mark.parametrize("sizes,tile,extra", [([0, 5, 0, 17, 1, 0, 9, 0], 8, 0), ([32, 0, 0, 0], 8, 0),
                                              ([3, 3, 3, 3], 16, 0), ([0, 0, 0, 7], 8, 0),
                                              ([2, 0, 6, 1], 8, 13), ([0, 0, 0, 0], 8, 5)])
def test_tiled_grouped_matmul_uneven_groups(rng, sizes, tile, extra):
    """Rows already sorted by group; empty groups, one group taking all rows, tiles larger than groups;
    `extra` trailing rows in no group (the expert-parallel path's other-shard pairs) must give 0."""
    E, D, F = len(sizes), 16, 8
    R = sum(sizes) + extra
    x = rng.randn(R, D).astype(np.float32)
    wg, wu, wd = rng.randn(E, D, F), rng.randn(E, D, F), rng.randn(E, F, D)
    want = np.zeros((R, D))
    row = 0
    for e, n in enumerate(sizes):
        for r in range(row, row + n):
            g, u = x[r] @ wg[e], x[r] @ wu[e]
            want[r] = (g / (1 + np.exp(-g)) * u) @ wd[e]
        row += n
    got = np.asarray(swiglu_experts_tiled(jnp.asarray(x), jnp.asarray(sizes, jnp.int32),
                                          *(jnp.asarray(w, jnp.float32) for w in (wg, wu, wd)), tile=tile))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_router_fp32_softmax_no_renorm(rng):
    x, w_router, *_ = make(rng, skew=False)
    weights, experts = route(jnp.asarray(x), jnp.asarray(w_router), 2, False)
    assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32
    assert (np.asarray(weights).sum(-1) < 1).all()  # raw top-k probabilities, not renormalised
    w2, _ = route(jnp.asarray(x), jnp.asarray(w_router), 2, True)
    np.testing.assert_allclose(np.asarray(w2).sum(-1), 1.0, rtol=1e-6)


def test_moe_module_paths_agree_in_model(rng):
    """The whole tiny LLaDA-MoE forward with each expert impl vs 'dense'."""
    from dinfer_jax.families import preset
    from dinfer_jax.model import Model
    from dinfer_jax.models import init_params
    cfg = preset("tiny")
    params = init_params(cfg, seed=3)
    ids = rng.randint(0, cfg.vocab_size, (2, 11))
    b = Model(cfg, params, "dense").logits(ids)
    for impl in ("ragged", "tiled", "auto"):
        a = Model(cfg, params, impl).logits(ids)
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), impl


def test_layers_read_stacked_experts_in_place(rng, monkeypatch):
    """Layer weights read from the layer stack in place (models/stacked.py, the CPU default) give
    the logits and K/V of the sliced reads, full and cached-window forwards, and XLA never copies
    a layer's experts out of the stack: compiled temp memory stays below one layer's expert bytes
    (nn.scan's slicing needed more than that for the copy)."""
    from dinfer_jax.models import stacked
    from dinfer_jax.families import preset
    from dinfer_jax.models import Transformer, init_params
    cfg = preset("tiny").replace(num_layers=3, hidden_size=64, intermediate_size=128, num_experts=8)
    params = init_params(cfg, seed=5)
    module = Transformer(cfg, kernels=KernelConfig(experts="tiled"))
    B, L, S, ws = 2, 12, 4, 6
    ids = jnp.asarray(rng.randint(0, cfg.vocab_size - 3, (B, L)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    km = jnp.ones((B, L), bool)

    def run():  # fresh functions: traced again after the monkeypatch
        def full(p, t):
            return module.apply({"params": p}, tokens_BS=t, positions_BS=pos, key_mask_BL=km)

        def window(p, t, kv):
            return module.apply({"params": p}, tokens_BS=t[:, ws:ws + S], positions_BS=pos[:, ws:ws + S],
                                key_mask_BL=km, kv=kv, window_start=ws)
        logits, kv = jax.jit(full)(params, ids)
        wl, wkv = jax.jit(window)(params, jnp.flip(ids, 1), kv)
        temp = jax.jit(full).lower(params, ids).compile().memory_analysis().temp_size_in_bytes
        return [np.asarray(a) for a in (logits, *kv, wl, *wkv)], temp

    in_place, temp_in_place = run()
    monkeypatch.setattr(stacked, "reads_in_place", lambda platform, mesh: False)
    scanned, temp_scanned = run()
    for a, b in zip(in_place, scanned):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max())
    expert_bytes = sum(params["layers"]["mlp"][k][0].nbytes for k in ("gate_proj", "up_proj", "down_proj"))
    assert temp_in_place < expert_bytes, (temp_in_place, expert_bytes, temp_scanned)
