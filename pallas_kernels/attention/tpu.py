"""The attention kernel's TPU (Mosaic) body: kv heads packed P per 128-lane column block, grid
(b, column block, query tile, kv tile), online softmax in VMEM scratch. Layout: docs/internals/kernels.md."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention.common import NEG, PAD, BlockSizes, mask_inputs, poison_alias, round_up



def heads_per_block(K: int, H: int) -> int:
    """P: kv heads per cache column block of the TPU body (P*H % 128 == 0; the GPU body uses P = 1)."""
    for p in range(1, K + 1):
        if K % p == 0 and (p * H) % 128 == 0:
            return p
    return K


def tpu_tiles(S: int, L: int, block_sizes: BlockSizes):
    """(bq, bkv, S_pad, L_pad) for the TPU body: L <= block_kv is one whole-length tile, else block_kv
    tiles with a partial last one."""
    bq = min(block_sizes.block_q, round_up(S, 16))
    bkv = min(block_sizes.block_kv, L)
    return bq, bkv, round_up(S, bq), round_up(L, bkv)


def _tile_update(q, k, v, qblk, kblk, kvalid, m, l, acc, *, P: int, H: int):
    """One kv tile of the online softmax for one query head group g.

    q (bq, W) fp32 pre-scaled; k, v (bkv, W); qblk (bq, 1) int; kblk, kvalid (1, bkv) int (kinfo rows);
    m, l: P-tuples of (bq, 1) fp32 running max / sum; acc (bq, W) fp32. Returns (m, l, acc)."""
    allowed = (kvalid == 1) & (kblk <= qblk)  # (bq, bkv)
    fill = jnp.where(kvalid < 0, PAD, NEG)  # (1, bkv)
    k = k.astype(jnp.float32)
    v = v.astype(jnp.float32)
    W = q.shape[1]
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, W), 1) if P > 1 else None
    new_m, new_l = [], []
    for p in range(P):
        on_p = None if P == 1 else (lane >= p * H) & (lane < (p + 1) * H)  # (1, W): kv head p's lanes
        q_p = q if P == 1 else jnp.where(on_p, q, 0.0)
        s = jax.lax.dot_general(q_p, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = jnp.where(allowed, s, fill)
        m_new = jnp.maximum(m[p], jnp.max(s, axis=1, keepdims=True))
        e = jnp.exp(s - m_new)
        alpha = jnp.exp(m[p] - m_new)
        new_l.append(alpha * l[p] + jnp.sum(e, axis=1, keepdims=True))
        new_m.append(m_new)
        pv = alpha * acc + jnp.dot(e, v, preferred_element_type=jnp.float32)
        acc = pv if P == 1 else jnp.where(on_p, pv, acc)
    return tuple(new_m), tuple(new_l), acc


def _finish(acc, l, *, P: int, H: int):
    """acc / l per kv head's lanes."""
    if P == 1:
        return acc / l[0]
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, acc.shape[1]), 1)
    denom = l[0]
    for p in range(1, P):
        denom = jnp.where(lane >= p * H, l[p], denom)
    return acc / denom


def _tpu_kernel(q_ref, k_ref, v_ref, qblk_ref, kinfo_ref, *refs, scale, G, P, H, L):
    """Grid (b, j, i, t): q/o (G, bq, W), k/v (bkv, W), qblk (bq, 1), kinfo (2, bkv); scratch m, l
    (G*P, bq, 1), acc (G, bq, W). L: the cache length (rows of a last tile past L are zeroed)."""
    if len(refs) == 5:  # pre-poisoned output (tests): its aliased input ref comes first
        refs = refs[1:]
    o_ref, m_ref, l_ref, acc_ref = refs
    t = pl.program_id(3)

    @pl.when(t == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    k, v, qblk, kblk, kvalid = k_ref[...], v_ref[...], qblk_ref[...], kinfo_ref[0:1, :], kinfo_ref[1:2, :]
    bkv = k.shape[0]
    if L % bkv:
        inside = t * bkv + jax.lax.broadcasted_iota(jnp.int32, (bkv, 1), 0) < L
        k = jnp.where(inside, k, jnp.zeros_like(k))
        v = jnp.where(inside, v, jnp.zeros_like(v))
    for g in range(G):
        q = q_ref[g].astype(jnp.float32) * scale
        m = tuple(m_ref[g * P + p] for p in range(P))
        l = tuple(l_ref[g * P + p] for p in range(P))
        m, l, acc = _tile_update(q, k, v, qblk, kblk, kvalid, m, l, acc_ref[g], P=P, H=H)
        for p in range(P):
            m_ref[g * P + p] = m[p]
            l_ref[g * P + p] = l[p]
        acc_ref[g] = acc

    @pl.when(t == pl.num_programs(3) - 1)
    def _write():
        for g in range(G):
            l = tuple(l_ref[g * P + p] for p in range(P))
            o_ref[g] = _finish(acc_ref[g], l, P=P, H=H).astype(o_ref.dtype)


def flash_attention_tpu(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, q_pos_BS, k_pos_BL, block_size, scale, block_sizes,
                        interpret, poison_output):
    """The Mosaic body: queries as (B, K/P, G, S_pad, W = P*H), one program per (b, kv column block,
    query tile, kv tile); online softmax in VMEM scratch."""
    B, S, N, H = q_BSNH.shape
    L, K = k_BLKH.shape[1], k_BLKH.shape[2]
    G = N // K
    P = heads_per_block(K, H)
    W = P * H
    bq, bkv, S_pad, L_pad = tpu_tiles(S, L, block_sizes)

    # Queries (small): (B,S,N,H) -> (B, K/P, G, S_pad, W); n = (j*P + p)*G + g.
    q = jnp.pad(q_BSNH, ((0, 0), (0, S_pad - S), (0, 0), (0, 0)))
    q = q.reshape(B, S_pad, K // P, P, G, H).transpose(0, 2, 4, 1, 3, 5).reshape(B, K // P, G, S_pad, W)
    # The cache (large): a free reshape (the partial last tile is masked in-kernel).
    k = k_BLKH.reshape(B, k_BLKH.shape[1], K * H)
    v = v_BLKH.reshape(B, v_BLKH.shape[1], K * H)
    qblk, kinfo = mask_inputs(key_mask_BL, q_pos_BS, k_pos_BL, block_size, B, S, L, S_pad, L_pad)
    qblk = qblk[:, :, None]  # (B, S_pad, 1)

    out_shape = jax.ShapeDtypeStruct((B, K // P, G, S_pad, W), q_BSNH.dtype)
    args = [q, k, v, qblk, kinfo]
    from jax.experimental.pallas import tpu as pltpu
    grid = (B, K // P, S_pad // bq, L_pad // bkv)
    q_spec = pl.BlockSpec((None, None, G, bq, W), lambda b, j, i, t: (b, j, 0, i, 0))
    kv_spec = pl.BlockSpec((None, bkv, W), lambda b, j, i, t: (b, t, j))
    in_specs = [q_spec, kv_spec, kv_spec, pl.BlockSpec((None, bq, 1), lambda b, j, i, t: (b, i, 0)),
                pl.BlockSpec((None, 2, bkv), lambda b, j, i, t: (b, 0, t))]
    kernel = functools.partial(_tpu_kernel, scale=scale, G=G, P=P, H=H, L=L)
    scratch = [pltpu.VMEM((G * P, bq, 1), jnp.float32), pltpu.VMEM((G * P, bq, 1), jnp.float32),
               pltpu.VMEM((G, bq, W), jnp.float32)]
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    aliases = poison_alias(in_specs, args, q_spec, out_shape) if poison_output else {}
    out = pl.pallas_call(
        kernel,
        grid_spec=pl.GridSpec(grid=grid, in_specs=in_specs, out_specs=q_spec, scratch_shapes=scratch),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=None if interpret else params,
        interpret=interpret,
        name="dlm_flash_attention",
    )(*args)
    out = out.reshape(B, K // P, G, S_pad, P, H).transpose(0, 3, 1, 4, 2, 5).reshape(B, S_pad, N, H)
    return out[:, :S]
