"""The attention kernel's GPU (Triton) body: one program per (b, kv head, query tile) over the
G query heads x bq rows of that kv head, K/V streamed in bkv tiles; small grids split the kv axis
(gpu_split.py). Tile budget: docs/internals/kernels.md."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention.common import NEG, PAD, BlockSizes, mask_inputs, poison_alias, pow2_ceil, pow2_floor, round_up
from pallas_kernels.attention.gpu_split import (GPU_TARGET_PROGRAMS, combine_splits, gpu_in_specs, gpu_split,
                                                split_outputs)

GPU_SMEM_BUDGET = 96 * 1024  # bytes of K/V tiles in flight per program (of 227 KiB on Hopper, 163-227 on Ampere)

GPU_NUM_STAGES = 2
GPU_MAX_ROWS = 128  # R = G * bq query rows per program


def gpu_tiles(S: int, L: int, G: int, H: int, itemsize: int, block_sizes: BlockSizes, *, B: int | None = None,
              K: int | None = None, target_programs: int = GPU_TARGET_PROGRAMS) -> dict:
    """The Triton body's tiling for a power-of-2 query group G -> dict: bq (R = G*bq rows, 16..GPU_MAX_ROWS),
    bkv (K + V tiles in flight <= GPU_SMEM_BUDGET), padded lengths, warps, stages, and the kv split
    (n_split, chunk_blocks; without B and K only a forced kv_splits splits)."""
    bq = min(pow2_floor(block_sizes.block_q), pow2_ceil(S), max(1, GPU_MAX_ROWS // G))
    bq = max(bq, pow2_ceil(-(-16 // G)))
    per_key = GPU_NUM_STAGES * 2 * H * itemsize
    bkv = min(pow2_floor(block_sizes.block_kv), pow2_ceil(max(L, 16)),
              max(16, pow2_floor(max(1, GPU_SMEM_BUDGET // per_key))))
    R = G * bq
    S_pad, L_pad = round_up(S, bq), round_up(L, bkv)
    if B is None or K is None:
        n_split, chunk = gpu_split(1, L_pad // bkv, block_sizes.kv_splits or 1)
    else:
        n_split, chunk = gpu_split(B * K * (S_pad // bq), L_pad // bkv, block_sizes.kv_splits, target_programs)
    return dict(bq=bq, bkv=bkv, R=R, S_pad=S_pad, L_pad=L_pad,
                num_warps=8 if R >= 128 else 4, num_stages=GPU_NUM_STAGES,
                smem_kv_bytes=GPU_NUM_STAGES * 2 * bkv * H * itemsize, n_split=n_split, chunk_blocks=chunk)


def _gpu_kernel(q_ref, k_ref, v_ref, qblk_ref, kinfo_ref, *refs, scale, bkv, num_kv_blocks, chunk_blocks=0):
    """Grid (b, k, i): q/o (R, H) = the G query heads x bq rows of kv head k; qblk (R, 1); k/v the
    full (L_pad, H) of kv head k, streamed in bkv tiles; kinfo (2, L_pad). kv split (chunk_blocks > 0):
    grid (b, k, i, c); program c streams its chunk of tiles and writes unnormalised fp32 acc (R, H),
    m and l (R, 1) (refs[-3:]) for combine_splits."""
    qblk = qblk_ref[...]
    kv_dtype = k_ref.dtype
    prec = jax.lax.Precision.HIGHEST if kv_dtype == jnp.float32 else None  # fp32: no TF32
    q = (q_ref[...].astype(jnp.float32) * scale).astype(kv_dtype)
    R, H = q.shape

    def body(t, carry):
        m, l, acc = carry
        sl = pl.ds(pl.multiple_of(t * bkv, bkv), bkv)
        kblk, kvalid = kinfo_ref[pl.ds(0, 1), sl], kinfo_ref[pl.ds(1, 1), sl]  # (1, bkv)
        allowed = (kvalid == 1) & (kblk <= qblk)  # (R, bkv)
        fill = jnp.where(kvalid < 0, PAD, NEG)
        s = jax.lax.dot_general(q, k_ref[sl, :], (((1,), (1,)), ((), ())), precision=prec,
                                preferred_element_type=jnp.float32)
        s = jnp.where(allowed, s, fill)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        e = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(e, axis=1, keepdims=True)
        acc = alpha * acc + jnp.dot(e.astype(kv_dtype), v_ref[sl, :], precision=prec,
                                    preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((R, 1), NEG, jnp.float32), jnp.zeros((R, 1), jnp.float32), jnp.zeros((R, H), jnp.float32))
    if not chunk_blocks:
        m, l, acc = jax.lax.fori_loop(0, num_kv_blocks, body, init)
        o_ref = refs[-1]
        o_ref[...] = (acc / l).astype(o_ref.dtype)
        return
    lo = pl.program_id(3) * chunk_blocks
    m, l, acc = jax.lax.fori_loop(lo, jnp.minimum(lo + chunk_blocks, num_kv_blocks), body, init)
    acc_ref, m_ref, l_ref = refs[-3:]
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def flash_attention_gpu(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, q_pos_BS, k_pos_BL, block_size, scale, block_sizes,
                        interpret, poison_output):
    """The Triton body: queries as (B, K, S_pad/bq, R = G*bq, H), one program per (b, kv head, query
    tile), or per (..., kv chunk) on a small grid (gpu_split; combine_splits merges)."""
    B, S, N, H = q_BSNH.shape
    L, K = k_BLKH.shape[1], k_BLKH.shape[2]
    G = N // K
    t = gpu_tiles(S, L, G, H, jnp.dtype(k_BLKH.dtype).itemsize, block_sizes, B=B, K=K)
    bq, bkv, R, S_pad, L_pad = t["bq"], t["bkv"], t["R"], t["S_pad"], t["L_pad"]
    n_split = t["n_split"]
    nq = S_pad // bq
    # (B,S,N,H) -> (B, K, nq, G*bq, H): row g*bq + s of tile i is window row i*bq + s of head k*G + g.
    q = jnp.pad(q_BSNH, ((0, 0), (0, S_pad - S), (0, 0), (0, 0)))
    q = q.reshape(B, nq, bq, K, G, H).transpose(0, 3, 1, 4, 2, 5).reshape(B, K, nq, R, H)
    k = jnp.pad(k_BLKH, ((0, 0), (0, L_pad - L), (0, 0), (0, 0))).reshape(B, L_pad, K * H)
    v = jnp.pad(v_BLKH, ((0, 0), (0, L_pad - L), (0, 0), (0, 0))).reshape(B, L_pad, K * H)
    qblk, kinfo = mask_inputs(key_mask_BL, q_pos_BS, k_pos_BL, block_size, B, S, L, S_pad, L_pad)
    qblk = jnp.broadcast_to(qblk.reshape(B, nq, 1, bq), (B, nq, G, bq)).reshape(B, nq, R, 1)  # q's tile rows

    from jax.experimental.pallas import triton as pltriton
    params = None if interpret else pltriton.CompilerParams(num_warps=t["num_warps"], num_stages=t["num_stages"])
    kernel = functools.partial(_gpu_kernel, scale=scale, bkv=bkv, num_kv_blocks=L_pad // bkv)
    q_spec, in_specs = gpu_in_specs(R, H, L_pad)
    if n_split > 1:  # flash-decoding: fp32 partials per kv chunk, merged below
        grid = (B, K, nq, n_split)
        kernel = functools.partial(kernel, chunk_blocks=t["chunk_blocks"])
        out_specs, out_shape = split_outputs(B, K, nq, n_split, R, H)
    else:
        grid, out_specs, out_shape = (B, K, nq), (q_spec,), (jax.ShapeDtypeStruct((B, K, nq, R, H), q_BSNH.dtype),)
    args = [q, k, v, qblk, kinfo]
    aliases = {}
    if poison_output:
        for idx, (spec, shape) in enumerate(zip(out_specs, out_shape)):
            aliases |= poison_alias(in_specs, args, spec, shape, idx)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pl.GridSpec(grid=grid, in_specs=in_specs, out_specs=out_specs),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=params,
        interpret=interpret,
        name="dlm_flash_attention",
    )(*args)
    out = combine_splits(*outs).astype(q_BSNH.dtype) if n_split > 1 else outs[0]  # (B, K, nq, R, H)
    out = out.reshape(B, K, nq, G, bq, H).transpose(0, 2, 4, 1, 3, 5).reshape(B, S_pad, N, H)
    return out[:, :S]
