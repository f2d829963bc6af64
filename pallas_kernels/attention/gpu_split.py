"""The attention kernel's GPU kv split (flash-decoding): on a small grid each (b, kv head, query
tile) program is cut into contiguous kv chunks whose fp32 partials are merged in plain JAX. When it
splits: docs/internals/kernels.md."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention.common import poison_alias

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


def flash_attention_gpu_split(q, k, v, qblk, kinfo, kernel, t, B, S, N, K, G, H, params, interpret, poison_output):
    """The kv-split Triton body: grid (B, K, nq, n_split); fp32 partials acc (B, K, nq, n, R, H), m and
    l (B, K, nq, n, R, 1) merged by combine_splits. Returns (B, S, N, H) fp32."""
    bq, R, S_pad, L_pad, n = t["bq"], t["R"], t["S_pad"], t["L_pad"], t["n_split"]
    nq = S_pad // bq
    _, in_specs = gpu_in_specs(R, H, L_pad)
    acc_spec = pl.BlockSpec((None, None, None, None, R, H), lambda b, j, i, c: (b, j, i, c, 0, 0))
    ml_spec = pl.BlockSpec((None, None, None, None, R, 1), lambda b, j, i, c: (b, j, i, c, 0, 0))
    out_shape = (jax.ShapeDtypeStruct((B, K, nq, n, R, H), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, nq, n, R, 1), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, nq, n, R, 1), jnp.float32))
    out_specs = (acc_spec, ml_spec, ml_spec)
    args = [q, k, v, qblk, kinfo]
    aliases = {}
    if poison_output:
        for idx, (spec, shape) in enumerate(zip(out_specs, out_shape)):
            aliases |= poison_alias(in_specs, args, spec, shape, idx)
    acc, m, l = pl.pallas_call(
        functools.partial(kernel, chunk_blocks=t["chunk_blocks"]),
        grid_spec=pl.GridSpec(grid=(B, K, nq, n), in_specs=in_specs, out_specs=out_specs),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=params,
        interpret=interpret,
        name="dlm_flash_attention",
    )(*args)
    out = combine_splits(acc, m, l)  # (B, K, nq, R, H)
    out = out.reshape(B, K, nq, G, bq, H).transpose(0, 2, 4, 1, 3, 5).reshape(B, S_pad, N, H)
    return out[:, :S]
