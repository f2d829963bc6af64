"""Mixture of experts: an fp32 router ("softmax" or "sigmoid_group"), SwiGLU experts, optional shared
experts; expert paths "dense" / "ragged" / "tiled" / "pallas" / "auto" that must agree.
Router rules and path trade-offs: docs/internals/model_code.md.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from dinfer_jax import kernels
from dinfer_jax.config import ModelConfig
from dinfer_jax.kernels import KernelConfig
from dinfer_jax.models import stacked
from dinfer_jax.models.expert_parallel import moe_expert_parallel
from dinfer_jax.models.layers import MLP, param
from dinfer_jax.models.quant import QuantizedWeight, expert_matmul, matmul, ragged_matmul
from dinfer_jax.sharding import batch_axes

def router_logits(x_TD, w_router_DE):
    """fp32 logits_TE = x_TD @ w_router_DE."""
    return jnp.einsum("td,de->te", x_TD.astype(jnp.float32), w_router_DE.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def route_softmax(logits_TE, top_k: int, norm_topk_prob: bool):
    """Softmax over all E experts, then top-k (no renormalisation unless asked).
    Returns (weights_TX fp32, experts_TX int32)."""
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    weights_TX, experts_TX = jax.lax.top_k(probs_TE, top_k)
    if norm_topk_prob:
        weights_TX = weights_TX / jnp.sum(weights_TX, axis=-1, keepdims=True)
    return weights_TX, experts_TX.astype(jnp.int32)


def route_sigmoid_group(logits_TE, bias_E, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                        scaling: float):
    """Sigmoid group-limited top-k (docs/internals/model_code.md). Returns (weights_TX fp32,
    experts_TX int32); excluded groups' experts are never chosen."""
    T, E = logits_TE.shape
    s_TE = jax.nn.sigmoid(logits_TE)
    r_TE = s_TE + bias_E.astype(jnp.float32)[None, :]
    r_TGe = r_TE.reshape(T, n_group, E // n_group)
    group_score_TG = jnp.sum(jax.lax.top_k(r_TGe, 2)[0], axis=-1)
    _, groups_TY = jax.lax.top_k(group_score_TG, topk_group)
    keep_TG = jnp.any(jax.nn.one_hot(groups_TY, n_group, dtype=jnp.bool_), axis=1)
    keep_TE = jnp.repeat(keep_TG, E // n_group, axis=1)
    _, experts_TX = jax.lax.top_k(jnp.where(keep_TE, r_TE, -jnp.inf), top_k)
    weights_TX = jnp.take_along_axis(s_TE, experts_TX, axis=1)
    if norm_topk_prob:
        weights_TX = weights_TX / (jnp.sum(weights_TX, axis=-1, keepdims=True) + 1e-20)
    return weights_TX * scaling, experts_TX.astype(jnp.int32)


def route(x_TD, w_router_DE, top_k: int, norm_topk_prob: bool):
    """The softmax router on x_TD: (weights_TX fp32, experts_TX int32)."""
    return route_softmax(router_logits(x_TD, w_router_DE), top_k, norm_topk_prob)


def route_model(x_TD, router_params: dict, cfg: ModelConfig):
    """cfg's router on x_TD. router_params: {"router": W_DE[, "router_bias": b_E]}.
    Returns (weights_TX fp32, experts_TX int32)."""
    logits_TE = router_logits(x_TD, router_params["router"])
    if cfg.router == "sigmoid_group":
        return route_sigmoid_group(logits_TE, router_params["router_bias"], cfg.num_experts_per_tok, cfg.n_group,
                                   cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    weights_TX, experts_TX = route_softmax(logits_TE, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return weights_TX * cfg.routed_scaling_factor if cfg.routed_scaling_factor != 1.0 else weights_TX, experts_TX


def experts_dense(x_TD, weights_TX, experts_TX, w_gate_EDF, w_up_EDF, w_down_EFD):
    """All-experts reference. Returns y_TD = sum_x w_x * down_e(silu(gate_e x) * up_e x)."""
    E = w_gate_EDF.shape[0]
    combine_TE = jnp.sum(jax.nn.one_hot(experts_TX, E, dtype=jnp.float32) * weights_TX[..., None], axis=1)
    h_TEF = nn.silu(expert_matmul(x_TD, w_gate_EDF)) * expert_matmul(x_TD, w_up_EDF)
    if isinstance(w_down_EFD, QuantizedWeight):
        y_TED = jax.vmap(lambda h_TF, w: matmul(h_TF, w), in_axes=(1, 0), out_axes=1)(h_TEF, w_down_EFD)
    else:
        y_TED = jnp.einsum("tef,efd->ted", h_TEF, w_down_EFD)
    return jnp.einsum("ted,te->td", y_TED, combine_TE.astype(y_TED.dtype))


def _sorted_experts(x_TD, weights_TX, experts_TX, grouped_swiglu):
    """Sort the T*X (token, slot) pairs by expert, run `grouped_swiglu(x_sorted, group_sizes)`,
    unsort, and combine the X slots with the router weights."""
    T, X = experts_TX.shape
    flat_experts = experts_TX.reshape(T * X)
    order = jnp.argsort(flat_experts, stable=True)  # (T*X,) slots grouped by expert
    x_sorted = jnp.take(x_TD, order // X, axis=0)  # (T*X, D)
    y_sorted = grouped_swiglu(x_sorted, flat_experts)
    y_slots = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(T, X, -1)
    return jnp.einsum("txd,tx->td", y_slots, weights_TX.astype(y_slots.dtype))


def experts_ragged(x_TD, weights_TX, experts_TX, w_gate_EDF, w_up_EDF, w_down_EFD):
    """Dropless sorted grouped-matmul path with lax.ragged_dot (same result as `experts_dense`)."""
    E = w_gate_EDF.shape[0]

    def swiglu(x_sorted, flat_experts):
        group_sizes = jnp.bincount(flat_experts, length=E).astype(jnp.int32)
        g = ragged_matmul(x_sorted, w_gate_EDF, group_sizes)
        u = ragged_matmul(x_sorted, w_up_EDF, group_sizes)
        return ragged_matmul(nn.silu(g) * u, w_down_EFD, group_sizes)
    return _sorted_experts(x_TD, weights_TX, experts_TX, swiglu)


def experts_tiled(x_TD, weights_TX, experts_TX, w_gate_EDF, w_up_EDF, w_down_EFD):
    """Dropless sorted path with the tile-padded scan grouped matmul (same result as `experts_dense`).
    The weights may be stacked.LayerSlices: each tile then reads w[layer, expert] from the stack."""
    E = w_gate_EDF.shape[-3]

    def swiglu(x_sorted, flat_experts):
        group_sizes = jnp.bincount(flat_experts, length=E).astype(jnp.int32)
        return kernels.experts_tiled(x_sorted, group_sizes, w_gate_EDF, w_up_EDF, w_down_EFD,
                                    weight_matmul=stacked.expert_matmul)
    return _sorted_experts(x_TD, weights_TX, experts_TX, swiglu)


def experts_pallas(x_TD, weights_TX, experts_TX, w_gate_EDF, w_up_EDF, w_down_EFD, platform=None):
    """Dropless sorted path with the Pallas grouped-matmul kernel (same result as `experts_dense`);
    interpreted unless the target platform (None = jax.default_backend()) is TPU."""
    E = w_gate_EDF.shape[0]

    def swiglu(x_sorted, flat_experts):
        group_sizes = jnp.bincount(flat_experts, length=E).astype(jnp.int32)
        return kernels.experts_gmm(x_sorted, group_sizes, w_gate_EDF, w_up_EDF, w_down_EFD, platform)
    return _sorted_experts(x_TD, weights_TX, experts_TX, swiglu)


class MoE(nn.Module):
    """Routed SwiGLU experts (+ shared experts). x_BSD -> y_BSD. Params: router (D, E), router_bias (E)
    (sigmoid_group), experts (E, D, F) / (E, F, D), shared/{gate,up,down}_proj (D, Fs) / (Fs, D),
    Fs = F * num_shared_experts. Expert weights may be stacked.LayerSlices."""
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    kernels: KernelConfig = KernelConfig()  # .mesh: expert parallelism (models/expert_parallel.py)

    @nn.compact
    def __call__(self, x_BSD):
        c = self.cfg
        D, F, E = c.hidden_size, c.intermediate_size, c.num_experts
        rp = {"router": param(self, "router", (D, E), ("embed", "expert_logits"), self.dtype)}
        if c.router == "sigmoid_group":  # loaded from the checkpoint; the init value only matters in tests
            rp["router_bias"] = param(self, "router_bias", (E,), ("expert_logits",), self.dtype,
                                      nn.initializers.normal(0.02))
        wg = param(self, "gate_proj", (E, D, F), ("expert", "embed", "mlp"), self.dtype)
        wu = param(self, "up_proj", (E, D, F), ("expert", "embed", "mlp"), self.dtype)
        wd = param(self, "down_proj", (E, F, D), ("expert", "mlp", "embed"), self.dtype)
        B, S, _ = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        ks = self.kernels
        impl = kernels.expert_impl(ks.experts, ks.platform)
        fn = {"ragged": experts_ragged, "tiled": experts_tiled,
              "pallas": functools.partial(experts_pallas, platform=ks.platform), "dense": experts_dense}[impl]
        multi_device = ks.mesh is not None and ks.mesh.size > 1
        if impl != "tiled" or multi_device:  # only the one-device tiled scan reads the layer stack itself
            wg, wu, wd = (stacked.resolve(w) for w in (wg, wu, wd))
        if multi_device:
            y = moe_expert_parallel(x_TD, rp, wg, wu, wd, mesh=ks.mesh, token_axes=batch_axes(B, ks.mesh),
                                    route_fn=lambda x, p: route_model(x, p, c), local_experts_fn=fn)
        else:
            weights_TX, experts_TX = route_model(x_TD, rp, c)
            y = fn(x_TD, weights_TX, experts_TX, wg, wu, wd)
        y = y.reshape(B, S, D).astype(x_BSD.dtype)
        if c.num_shared_experts:
            y = y + MLP(c, self.dtype, F * c.num_shared_experts, name="shared")(x_BSD)
        return y
