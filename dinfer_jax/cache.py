"""KV cache for bidirectional dLLMs and per-row window read/write ops.

The cache is the pair (k, v), each (layers, B, L, K, H): K/V of every canvas position from the
last full refresh. Window forwards read it and write their fresh window K/V into a *copy* used
for that forward only (dInfer semantics: only full refreshes persist).

Windows are per row: row b's window is [start_b, start_b + S) with a static S and a traced start.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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


def empty_cache(num_layers: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype):
    shape = (num_layers, batch, length, kv_heads, head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
