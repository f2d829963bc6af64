"""KV cache for bidirectional dLLMs and per-row window read/write ops.

The cache is (k, v), each (layers, B, L, K*H) (heads merged: the attention kernel's layout); window
forwards write their fresh K/V into a copy (only full refreshes persist). Row b's window is
[start_b, start_b + S), S static. Why this layout: docs/internals/runtime.md, docs/accelerators.md.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint


def as_starts(start, batch: int):
    """A scalar or (B,) window start -> int32 (B,)."""
    return jnp.broadcast_to(jnp.asarray(start, jnp.int32), (batch,))


def window_slice(x_BL, starts_B, size: int):
    """Per-row x[b, starts_b : starts_b + size, ...] -> (B, size, ...). Starts must keep the window in range."""
    def one(row, s):
        return jax.lax.dynamic_slice_in_dim(row, s, size, axis=0)
    return jax.vmap(one)(x_BL, starts_B)


def window_write(full_BL, new_BS, starts_B, write_BS=None):
    """Per-row write of new_BS into full_BL at [starts_b, starts_b + S); where write_BS is False the
    old value is kept. Returns the updated copy."""
    new_BS = new_BS.astype(full_BL.dtype)
    if write_BS is not None:
        old = window_slice(full_BL, starts_B, new_BS.shape[1])
        shape = write_BS.shape + (1,) * (new_BS.ndim - 2)
        new_BS = jnp.where(write_BS.reshape(shape), new_BS, old)

    def one(row, new, s):
        return jax.lax.dynamic_update_slice_in_dim(row, new, s, axis=0)
    return jax.vmap(one)(full_BL, new_BS, starts_B)


def cache_shape(num_layers: int, batch: int, length: int, kv_heads: int, head_dim: int) -> tuple:
    """The shape of k (and of v) in the cache: (layers, B, L, K*H)."""
    return num_layers, batch, length, kv_heads * head_dim


def empty_cache(num_layers: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype):
    """Zero (k, v), each `cache_shape`."""
    shape = cache_shape(num_layers, batch, length, kv_heads, head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def row_major(x):
    """x pinned to the row-major layout (the cache's), for TPU targets only (docs/internals/runtime.md)."""
    return with_layout_constraint(x, Layout(tuple(range(x.ndim))))


def per_row(mask_B):
    """A (B,) row mask shaped to broadcast over a cache's (layers, B, L, K*H) k or v."""
    return mask_B[None, :, None, None]


def merge_heads(x_BLKH):
    """(B, L, K, H) -> (B, L, K*H): a layer's K or V as the cache stores it."""
    return x_BLKH.reshape(*x_BLKH.shape[:-2], x_BLKH.shape[-2] * x_BLKH.shape[-1])


def split_heads(x_BLF, kv_heads: int):
    """(B, L, K*H) -> (B, L, K, H)."""
    return x_BLF.reshape(*x_BLF.shape[:-1], kv_heads, x_BLF.shape[-1] // kv_heads)
