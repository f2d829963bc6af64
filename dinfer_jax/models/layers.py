"""Shared building blocks: RMSNorm, NeoX rotary embedding, bidirectional attention, SwiGLU MLP.
Every parameter is declared with logical axis names (sharding.py rules); the layers read only
`ModelConfig` fields, never a model family.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dinfer_jax.cache import as_starts, merge_heads, row_major, split_heads, window_write
from dinfer_jax import kernels
from dinfer_jax.config import ModelConfig
from dinfer_jax.kernels import KernelConfig
from dinfer_jax.models import quant, stacked
from dinfer_jax.models.forward_inputs import ForwardInputs
from dinfer_jax.sharding import batch_axes

_init = nn.initializers.normal(stddev=0.02)


def param(module: nn.Module, name: str, shape, axes, dtype, init=_init):
    """A parameter with logical axis names `axes` (one per dim). A QuantizedWeight or stacked.LayerSlice
    stored under `name` is returned as is (quant / stacked matmuls read it)."""
    if module.has_variable("params", name):
        v = module.get_variable("params", name)
        if isinstance(v, (quant.QuantizedWeight, stacked.LayerSlice)):
            if tuple(v.shape) != tuple(shape):
                raise ValueError(f"{module.name}/{name}: weight of shape {v.shape}, expected {shape}")
            return v
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def rms_normalize(x, weight, eps: float):
    """x * rsqrt(mean(x^2) + eps) with statistics in fp32, cast back to x.dtype, times weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * weight.astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis; `axis_name` is the logical name of that axis."""
    eps: float
    axis_name: str = "embed"
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = param(self, "scale", (x.shape[-1],), (self.axis_name,), self.param_dtype, nn.initializers.ones)
        return rms_normalize(x, w, self.eps)


def rotary_embedding(x_BSnH, positions_BS, theta: float, rotary_dim: int):
    """NeoX (rotate-half) RoPE on the first `rotary_dim` of H; angles and rotation in fp32.

    x_BSnH: (B, S, heads, H); positions_BS: int positions. inv_freq_i = theta^(-2i/rotary_dim).
    """
    H = x_BSnH.shape[-1]
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    ang_BSh = positions_BS.astype(jnp.float32)[..., None] * inv_freq  # (B, S, half)
    cos = jnp.cos(ang_BSh)[:, :, None, :]
    sin = jnp.sin(ang_BSh)[:, :, None, :]
    x32 = x_BSnH.astype(jnp.float32)
    x1, x2, rest = x32[..., :half], x32[..., half:rotary_dim], x32[..., rotary_dim:]
    rot = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if rotary_dim < H:
        rot = jnp.concatenate([rot, rest], axis=-1)
    return rot.astype(x_BSnH.dtype)


def whole_kv_heads(mesh, kv_heads: int) -> bool:
    """Whether the model axis splits K/V over whole heads (it divides K); else K/V stay replicated."""
    return mesh is None or kv_heads % mesh.shape["model"] == 0


def _shard_kw(mesh, batch: int, kv_heads: int):
    """attention()'s shard_map arguments for the K/V of `batch` rows and `kv_heads` heads on `mesh`."""
    if mesh is None or mesh.size == 1:
        return {}
    heads = ("model",) if mesh.shape["model"] > 1 and whole_kv_heads(mesh, kv_heads) else ()
    return dict(mesh=mesh, batch_axes=batch_axes(batch, mesh), head_axes=heads)


def _layout_pin(platform, mesh, batch: int, kv_heads: int):
    """cache.row_major for an XLA:TPU target (identity elsewhere) over (B, L, K, H) or (B, L, K*H) K/V;
    inside a shard_map on a multi-device mesh (docs/internals/model_code.md)."""
    if not kernels.pins_kv_layout(platform):
        return lambda a: a
    if mesh is None or mesh.size == 1:
        return row_major
    kw = _shard_kw(mesh, batch, kv_heads)
    rows, heads = tuple(kw["batch_axes"]) or None, tuple(kw["head_axes"]) or None

    def pin(a):
        spec = P(rows, None, heads, None) if a.ndim == 4 else P(rows, None, heads)
        return jax.shard_map(row_major, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(a)
    return pin


class Attention(nn.Module):
    """GQA attention with optional q/k/v biases, per-head q/k RMSNorm, and RoPE.

    __call__(x_BSD, inputs: ForwardInputs, kv=None, block_size=0) -> (out_BSD, (k_BLF, v_BLF)),
    F = K*H. With `kv` (full-length k_BLF, v_BLF), row b's S fresh K/V go into a copy at
    [inputs.window_start_b, +S) (where inputs.kv_write_BS) and the queries attend to all L.
    block_size > 0: block-causal over the query / key positions. On a multi-device mesh
    (kernels.mesh) the Pallas kernel runs per shard (rows over batch axes, heads over model).
    """
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    kernels: KernelConfig = KernelConfig()

    @nn.compact
    def __call__(self, x_BSD, inputs: ForwardInputs, kv=None, block_size: int = 0):
        c, ks = self.cfg, self.kernels
        positions_BS, key_positions_BL = inputs.positions_BS, inputs.key_positions_BL
        D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        wq = param(self, "q_proj", (D, N, H), ("embed", "heads", "head_dim"), self.dtype)
        wk = param(self, "k_proj", (D, K, H), ("embed", "kv_heads", "head_dim"), self.dtype)
        wv = param(self, "v_proj", (D, K, H), ("embed", "kv_heads", "head_dim"), self.dtype)
        wo = param(self, "o_proj", (N, H, D), ("heads", "head_dim", "embed"), self.dtype)
        q = stacked.einsum("bsd,dnh->bsnh", x_BSD, wq)
        k = stacked.einsum("bsd,dkh->bskh", x_BSD, wk)
        v = stacked.einsum("bsd,dkh->bskh", x_BSD, wv)
        if c.qkv_bias:
            zeros = nn.initializers.zeros
            q = q + param(self, "q_bias", (N, H), ("heads", "head_dim"), self.dtype, zeros).astype(q.dtype)
            k = k + param(self, "k_bias", (K, H), ("kv_heads", "head_dim"), self.dtype, zeros).astype(k.dtype)
            v = v + param(self, "v_bias", (K, H), ("kv_heads", "head_dim"), self.dtype, zeros).astype(v.dtype)
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, "head_dim", self.dtype, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, "head_dim", self.dtype, name="k_norm")(k)
        q = rotary_embedding(q, positions_BS, c.rope_theta, c.rotary)
        k = rotary_embedding(k, positions_BS, c.rope_theta, c.rotary)
        # the cache's layout (dinfer_jax/cache.py), pinned row-major for XLA:TPU (cache.row_major)
        pin = _layout_pin(ks.platform, ks.mesh, x_BSD.shape[0], K)
        k, v = merge_heads(pin(k)), merge_heads(pin(v))
        if kv is not None:
            k_full, v_full = kv
            starts = as_starts(inputs.window_start, x_BSD.shape[0])
            k = window_write(k_full, k, starts, inputs.kv_write_BS)
            v = window_write(v_full, v, starts, inputs.kv_write_BS)
        k, v = pin(k), pin(v)
        with jax.named_scope("attention_core"):
            k_pos = positions_BS if key_positions_BL is None else key_positions_BL
            if block_size and k_pos.shape[1] != k.shape[1]:
                raise ValueError("block-causal attention over a cache needs key_positions_BL (B, L)")
            o_BSNH = kernels.attention(q, split_heads(k, K), split_heads(v, K), inputs.key_mask_BL,
                                       q_pos_BS=positions_BS, k_pos_BL=k_pos, block_size=block_size,
                                       impl=ks.attention, platform=ks.platform, **_shard_kw(ks.mesh, k.shape[0], K))
        return stacked.einsum("bsnh,nhd->bsd", o_BSNH, wo), (k, v)


class MLP(nn.Module):
    """Dense SwiGLU: down(silu(x @ gate) * (x @ up)). x_BSD -> y_BSD. width: F (default
    cfg.intermediate_size; the leading dense layers of a MoE model and shared experts set it)."""
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    width: int | None = None

    @nn.compact
    def __call__(self, x_BSD):
        D, F = self.cfg.hidden_size, self.width or self.cfg.intermediate_size
        wg = param(self, "gate_proj", (D, F), ("embed", "mlp"), self.dtype)
        wu = param(self, "up_proj", (D, F), ("embed", "mlp"), self.dtype)
        wd = param(self, "down_proj", (F, D), ("mlp", "embed"), self.dtype)
        h = nn.silu(x_BSD @ wg) * (x_BSD @ wu)
        return h @ wd
