"""Mixture of experts: fp32 softmax router, top-k, SwiGLU experts.

Expert paths that must agree (tests/test_moe.py checks each against a per-expert loop):
- "dense":  every token through every expert (einsum over E), weights zero outside the top-k.
            Simple and obviously correct; costs E/X times the useful FLOPs.
- "ragged": dropless: sort the T*X (token, expert) pairs by expert and run grouped matmuls with
            `jax.lax.ragged_dot` over contiguous per-expert groups (the default on GPU).
- "tiled":  the same sort, then pallas_kernels.moe's tile-padded scan over groups (the default on
            CPU, where XLA lowers ragged_dot to a dense matmul per group: E times the work).
- "pallas": the same sort, then pallas_kernels.moe's megablox-style grouped-matmul Pallas kernel
            (`gmm`, Mosaic; the default on TPU). Off TPU it runs in the Pallas interpreter
            (slow; for tests).
"auto" picks by the target platform (MoE.platform; None = jax.default_backend()): "pallas" on TPU,
"ragged" on GPU, "tiled" on CPU.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dinfer_jax.config import ModelConfig
from dinfer_jax.models.layers import param
from pallas_kernels.attention import target_platform
from pallas_kernels.moe import swiglu_experts_gmm, swiglu_experts_tiled

MOE_IMPLS = ("auto", "ragged", "tiled", "pallas", "dense")


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """The concrete expert path for `impl` on the target platform (None = jax.default_backend())."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"unknown moe impl {impl!r}; choose one of {MOE_IMPLS}")
    if impl == "auto":
        return {"tpu": "pallas", "cpu": "tiled"}.get(target_platform(platform), "ragged")
    return impl


def route(x_TD, w_router_DE, top_k: int, norm_topk_prob: bool):
    """Router: softmax over all E experts in fp32, then top-k (no renormalisation unless asked).

    Returns (weights_TX fp32, experts_TX int32).
    """
    logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), w_router_DE.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    weights_TX, experts_TX = jax.lax.top_k(probs_TE, top_k)
    if norm_topk_prob:
        weights_TX = weights_TX / jnp.sum(weights_TX, axis=-1, keepdims=True)
    return weights_TX, experts_TX.astype(jnp.int32)


def experts_dense(x_TD, weights_TX, experts_TX, w_gate_EDF, w_up_EDF, w_down_EFD):
    """All-experts reference. Returns y_TD = sum_x w_x * down_e(silu(gate_e x) * up_e x)."""
    E = w_gate_EDF.shape[0]
    combine_TE = jnp.sum(jax.nn.one_hot(experts_TX, E, dtype=jnp.float32) * weights_TX[..., None], axis=1)
    h_TEF = nn.silu(jnp.einsum("td,edf->tef", x_TD, w_gate_EDF)) * jnp.einsum("td,edf->tef", x_TD, w_up_EDF)
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
        g = jax.lax.ragged_dot(x_sorted, w_gate_EDF, group_sizes)
        u = jax.lax.ragged_dot(x_sorted, w_up_EDF, group_sizes)
        return jax.lax.ragged_dot(nn.silu(g) * u, w_down_EFD, group_sizes)
    return _sorted_experts(x_TD, weights_TX, experts_TX, swiglu)


def experts_tiled(x_TD, weights_TX, experts_TX, w_gate_EDF, w_up_EDF, w_down_EFD, layer=None):
    """Dropless sorted path with the tile-padded scan grouped matmul (same result as `experts_dense`).
    layer: index into layer-stacked weights (see swiglu_experts_tiled)."""
    E = w_gate_EDF.shape[-3]

    def swiglu(x_sorted, flat_experts):
        group_sizes = jnp.bincount(flat_experts, length=E).astype(jnp.int32)
        return swiglu_experts_tiled(x_sorted, group_sizes, w_gate_EDF, w_up_EDF, w_down_EFD, layer=layer)
    return _sorted_experts(x_TD, weights_TX, experts_TX, swiglu)


def experts_pallas(x_TD, weights_TX, experts_TX, w_gate_EDF, w_up_EDF, w_down_EFD, platform=None):
    """Dropless sorted path with the Pallas grouped-matmul kernel (same result as `experts_dense`);
    interpreted unless the target platform (None = jax.default_backend()) is TPU."""
    E = w_gate_EDF.shape[0]
    interpret = target_platform(platform) != "tpu"

    def swiglu(x_sorted, flat_experts):
        group_sizes = jnp.bincount(flat_experts, length=E).astype(jnp.int32)
        return swiglu_experts_gmm(x_sorted, group_sizes, w_gate_EDF, w_up_EDF, w_down_EFD, interpret=interpret)
    return _sorted_experts(x_TD, weights_TX, experts_TX, swiglu)


def reads_stacked_experts(impl: str, mesh, platform: str | None = None) -> bool:
    """Whether this expert path reads its weights from the layer-stacked params in place (see
    MoE.__call__'s stacked_experts): the tiled path on one device."""
    return resolve_impl(impl, platform) == "tiled" and (mesh is None or mesh.size == 1)


class MoE(nn.Module):
    """Routed SwiGLU experts. x_BSD -> y_BSD. Params: router (D, E), experts (E, D, F) / (E, F, D).

    __call__(x_BSD, stacked_experts=None): stacked_experts = (layer index, {gate_proj, up_proj,
    down_proj} stacked over layers) makes the tiled expert matmuls read those in place instead of
    this layer's params (the same values); callers pass it only where reads_stacked_experts(impl, mesh)."""
    cfg: ModelConfig
    impl: str = "auto"
    dtype: jnp.dtype = jnp.float32
    mesh: Any = None  # a ("data", "expert", "model") Mesh: expert parallelism (models/expert_parallel.py)
    platform: str | None = None  # compile target for kernel choice (None = jax.default_backend())

    @nn.compact
    def __call__(self, x_BSD, stacked_experts=None):
        c = self.cfg
        D, F, E = c.hidden_size, c.intermediate_size, c.num_experts
        w_router = param(self, "router", (D, E), ("embed", "expert_logits"), self.dtype)
        wg = param(self, "gate_proj", (E, D, F), ("expert", "embed", "mlp"), self.dtype)
        wu = param(self, "up_proj", (E, D, F), ("expert", "embed", "mlp"), self.dtype)
        wd = param(self, "down_proj", (E, F, D), ("expert", "mlp", "embed"), self.dtype)
        B, S, _ = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        impl = resolve_impl(self.impl, self.platform)
        fn = {"ragged": experts_ragged, "tiled": experts_tiled,
              "pallas": functools.partial(experts_pallas, platform=self.platform), "dense": experts_dense}[impl]
        if self.mesh is not None and self.mesh.size > 1:
            from dinfer_jax.models.expert_parallel import moe_expert_parallel
            from dinfer_jax.sharding import batch_axes
            y = moe_expert_parallel(x_TD, w_router, wg, wu, wd, mesh=self.mesh, token_axes=batch_axes(B, self.mesh),
                                    top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
                                    local_experts_fn=fn)
        else:
            weights_TX, experts_TX = route(x_TD, w_router, c.num_experts_per_tok, c.norm_topk_prob)
            if stacked_experts is not None:  # the Transformer passes it only where reads_stacked_experts
                layer, w = stacked_experts
                y = experts_tiled(x_TD, weights_TX, experts_TX, w["gate_proj"], w["up_proj"], w["down_proj"], layer)
            else:
                y = fn(x_TD, weights_TX, experts_TX, wg, wu, wd)
        return y.reshape(B, S, D).astype(x_BSD.dtype)
