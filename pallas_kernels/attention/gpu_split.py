"""The attention kernel's GPU kv split (flash-decoding): on a small grid each (b, kv head, query
tile) program is cut into contiguous kv chunks whose fp32 partials are merged in plain JAX. When it
splits: docs/internals/kernels.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

GPU_TARGET_PROGRAMS = 132
"""Programs the Triton grid should offer before the kv axis is split: the SM count of the H200 (and
H100 SXM) the kernel was measured on. At B=1, S=64, L=4096, 16/16 heads, H=128, bf16 the unsplit grid
(B, K, nq) = (1, 16, 1) ran 16 programs on 132 SMs and took 0.237 ms vs XLA's 0.19 ms; at B=8 (128
programs) it was 2.65x faster than XLA, so 128 programs is treated as a full grid."""

GPU_MIN_SPLIT_TILES = 2  # a kv chunk of the split holds at least this many bkv tiles (automatic split)
# The automatic split applies only to grids of at most target // GPU_SPLIT_MAX_FRACTION programs: the
# one measured loss to XLA had 16 programs (B 1, 16 kv heads); grids of 64+ programs (B 16 at 16/4
# heads: 2.66x faster than XLA unsplit) keep the measured kernel until a device times the split there.
GPU_SPLIT_MAX_FRACTION = 4


def gpu_split(programs: int, num_kv_blocks: int, kv_splits: int = 0,
              target: int = GPU_TARGET_PROGRAMS) -> tuple[int, int]:
    """(n_split, chunk_blocks): the Triton body's kv split for a grid of `programs` = B*K*nq programs
    over num_kv_blocks tiles; kv_splits = n forces n chunks (1 = off), 0 decides from the grid (rule:
    docs/internals/kernels.md). Chunks are contiguous runs of chunk_blocks tiles, none empty."""
    if kv_splits:
        n = min(kv_splits, num_kv_blocks)
    else:
        small = programs <= target // GPU_SPLIT_MAX_FRACTION
        n = max(1, min(target // max(1, programs), num_kv_blocks // GPU_MIN_SPLIT_TILES)) if small else 1
    chunk = -(-num_kv_blocks // n)
    return -(-num_kv_blocks // chunk), chunk


def combine_splits(acc, m, l):
    """The kv split's partials -> attention output (fp32), in plain JAX: acc (..., n, R, H), m and l
    (..., n, R, 1) over the split axis n (-3): sum_c w_c acc_c / sum_c w_c l_c, w_c = exp(m_c - max_c m_c);
    equal to one pass, all-masked rows included (docs/internals/kernels.md)."""
    w = jnp.exp(m - jnp.max(m, axis=-3, keepdims=True))
    return jnp.sum(w * acc, axis=-3) / jnp.sum(w * l, axis=-3)


def gpu_in_specs(R: int, H: int, L_pad: int):
    """(q_spec, [q, k, v, qblk, kinfo] BlockSpecs) of the Triton body for a grid (b, j, i) or, with
    the kv split, (b, j, i, c): every input is the same for all chunks c of a (b, j, i)."""
    q_spec = pl.BlockSpec((None, None, None, R, H), lambda b, j, i, *c: (b, j, i, 0, 0))
    kv_spec = pl.BlockSpec((None, L_pad, H), lambda b, j, i, *c: (b, 0, j))
    return q_spec, [q_spec, kv_spec, kv_spec, pl.BlockSpec((None, None, R, 1), lambda b, j, i, *c: (b, i, 0, 0)),
                    pl.BlockSpec((None, 2, L_pad), lambda b, j, i, *c: (b, 0, 0))]


def split_outputs(B: int, K: int, nq: int, n: int, R: int, H: int):
    """(out_specs, out_shape) of the kv-split Triton body on grid (B, K, nq, n): fp32 partials acc
    (B, K, nq, n, R, H), m and l (B, K, nq, n, R, 1), merged by combine_splits."""
    acc_spec = pl.BlockSpec((None, None, None, None, R, H), lambda b, j, i, c: (b, j, i, c, 0, 0))
    ml_spec = pl.BlockSpec((None, None, None, None, R, 1), lambda b, j, i, c: (b, j, i, c, 0, 0))
    return (acc_spec, ml_spec, ml_spec), (jax.ShapeDtypeStruct((B, K, nq, n, R, H), jnp.float32),
                                          jax.ShapeDtypeStruct((B, K, nq, n, R, 1), jnp.float32),
                                          jax.ShapeDtypeStruct((B, K, nq, n, R, 1), jnp.float32))
