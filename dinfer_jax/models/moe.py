"""Mixture of experts: fp32 softmax router, top-k, SwiGLU experts.

Two expert paths that must agree (tests/test_moe.py checks both against a per-expert loop):
- "dense":  every token through every expert (einsum over E), weights zero outside the top-k.
            Simple and obviously correct; costs E/X times the useful FLOPs.
- "ragged": dropless: sort the T*X (token, expert) pairs by expert and run grouped matmuls with
            `jax.lax.ragged_dot` over contiguous per-expert groups (the default).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dinfer_jax.config import ModelConfig
from dinfer_jax.models.layers import param

MOE_IMPLS = ("ragged", "dense")


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


def experts_ragged(x_TD, weights_TX, experts_TX, w_gate_EDF, w_up_EDF, w_down_EFD):
    """Dropless sorted grouped-matmul path (same result as `experts_dense`)."""
    T, X = experts_TX.shape
    E = w_gate_EDF.shape[0]
    flat_experts = experts_TX.reshape(T * X)
    order = jnp.argsort(flat_experts, stable=True)  # (T*X,) slots grouped by expert
    token_of_slot = order // X
    x_sorted = jnp.take(x_TD, token_of_slot, axis=0)  # (T*X, D)
    group_sizes = jnp.bincount(flat_experts, length=E).astype(jnp.int32)
    g = jax.lax.ragged_dot(x_sorted, w_gate_EDF, group_sizes)
    u = jax.lax.ragged_dot(x_sorted, w_up_EDF, group_sizes)
    y_sorted = jax.lax.ragged_dot(nn.silu(g) * u, w_down_EFD, group_sizes)  # (T*X, D)
    y_slots = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(T, X, -1)
    return jnp.einsum("txd,tx->td", y_slots, weights_TX.astype(y_slots.dtype))


class MoE(nn.Module):
    """Routed SwiGLU experts. x_BSD -> y_BSD. Params: router (D, E), experts (E, D, F) / (E, F, D)."""
    cfg: ModelConfig
    impl: str = "ragged"
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BSD):
        c = self.cfg
        D, F, E = c.hidden_size, c.intermediate_size, c.num_experts
        w_router = param(self, "router", (D, E), ("embed", "expert_logits"), self.dtype)
        wg = param(self, "gate_proj", (E, D, F), ("expert", "embed", "mlp"), self.dtype)
        wu = param(self, "up_proj", (E, D, F), ("expert", "embed", "mlp"), self.dtype)
        wd = param(self, "down_proj", (E, F, D), ("expert", "mlp", "embed"), self.dtype)
        B, S, _ = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        weights_TX, experts_TX = route(x_TD, w_router, c.num_experts_per_tok, c.norm_topk_prob)
        if self.impl == "ragged":
            y = experts_ragged(x_TD, weights_TX, experts_TX, wg, wu, wd)
        elif self.impl == "dense":
            y = experts_dense(x_TD, weights_TX, experts_TX, wg, wu, wd)
        else:
            raise ValueError(f"unknown moe impl {self.impl!r}; choose one of {MOE_IMPLS}")
        return y.reshape(B, S, D).astype(x_BSD.dtype)
