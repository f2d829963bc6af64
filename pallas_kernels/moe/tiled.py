"""Megablox-style grouped SwiGLU in pure JAX: rows sorted by expert, padded per group to whole
`tile`s, and a scan over the tiles that multiplies each by its own expert's weights (never gathered
into a (tiles, D, F) copy). Work vs ragged_dot / the all-experts einsum: docs/internals/kernels.md.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def tile_rows_for(rows: int, experts: int) -> int:
    """Tile height: the power of two in [8, 128] at or above the mean group size rows / experts
    (about one tile per expert; measurements: docs/internals/kernels.md)."""
    mean = max(1, -(-rows // max(1, experts)))
    return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def swiglu_experts_tiled(x_RD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, tile: int | None = None,
                         weight_matmul=None):
    """Rows x_RD sorted by expert (group e: group_sizes_E[e] consecutive rows, summing to at most R)
    -> y_RD = down_e(silu(x @ gate_e) * (x @ up_e)); rows past the sum give 0. weight_matmul:
    (rows, w, e) -> rows @ w[e] (models/stacked.expert_matmul reads a layer-stacked weight in place)."""
    R, D = x_RD.shape
    E = w_gate_EDF.shape[-3]
    m = tile or tile_rows_for(R, E)
    num_tiles = -(-(R + E * (m - 1)) // m)  # static upper bound on tiles over all padded groups
    sizes = group_sizes_E.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    padded = (sizes + m - 1) // m * m
    pstarts = jnp.cumsum(padded) - padded
    row_group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(R, dtype=jnp.int32), side="right")
    in_group = row_group < E
    row_group = jnp.minimum(row_group, E - 1)
    dump = num_tiles * m  # rows in no group go here: dropped on write, read back as 0
    dest = jnp.where(in_group, pstarts[row_group] + jnp.arange(R, dtype=jnp.int32) - starts[row_group], dump)
    buf = jnp.zeros((num_tiles * m, D), x_RD.dtype).at[dest].set(x_RD, mode="drop")
    tile_expert = jnp.clip(jnp.searchsorted(pstarts + padded, jnp.arange(num_tiles, dtype=jnp.int32) * m,
                                            side="right"), 0, E - 1)

    used_tiles = jnp.sum(padded) // m  # tiles past this hold no rows: skip their matmuls

    def mm(rows, w, e):
        if weight_matmul is not None:
            return weight_matmul(rows, w, e)
        return rows @ w[e]

    def compute(t):
        rows = jax.lax.dynamic_slice_in_dim(buf, t * m, m)
        e = tile_expert[t]
        h = jax.nn.silu(mm(rows, w_gate_EDF, e)) * mm(rows, w_up_EDF, e)
        return mm(h, w_down_EFD, e)

    def one(_, t):
        return None, jax.lax.cond(t < used_tiles, compute, lambda t: jnp.zeros((m, D), buf.dtype), t)

    _, y = jax.lax.scan(one, None, jnp.arange(num_tiles))
    y = jnp.concatenate([y.reshape(num_tiles * m, D), jnp.zeros((1, D), y.dtype)])
    return y[dest]
