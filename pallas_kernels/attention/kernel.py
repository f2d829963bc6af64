"""Flash-style masked-token attention in Pallas for the dLLM window case (Mosaic TPU / Triton GPU).

S window queries (B, S, N, H) over the full-length K/V cache (B, L, K, H) with the window's fresh K/V
in place; GQA, a per-row key-padding mask, optionally the block-causal mask built per tile from small
int inputs (qblk (B, S_pad, 1) query block ids; kinfo (B, 2, L_pad): key block ids, and 1 valid / 0
masked / -1 tile padding). Masked keys score -1e30 (an all-masked row: uniform softmax over the L
real keys); padding keys -2e30. The GPU body may split the kv axis (flash-decoding) on small grids.
interpret=True runs either body on any platform. Layout, grids, tile budgets, the kv split:
docs/internals/kernels.md.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG = -1e30  # same finite mask value as the reference: an all-masked row gives a uniform softmax
_PAD = -2e30  # tile-padding keys: below every real key, masked or not
BACKENDS = ("tpu", "gpu")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile lengths: block_q a multiple of 8, block_kv a multiple of 128 (Triton rounds both down to
    powers of two). kv_splits (Triton only): 0 automatic, 1 off, n > 1 forces n chunks."""
    block_q: int = 64
    block_kv: int = 512
    kv_splits: int = 0  # GPU body only: 0 = automatic (gpu_tiles), 1 = never split the kv axis, n = n chunks

    def validate(self):
        if not isinstance(self.kv_splits, int) or self.kv_splits < 0:
            raise ValueError(f"BlockSizes.kv_splits={self.kv_splits} must be an int >= 0 (0 = automatic)")
        if self.block_q <= 0 or self.block_q % 8:
            raise ValueError(f"BlockSizes.block_q={self.block_q} must be a positive multiple of 8")
        if self.block_kv <= 0 or self.block_kv % 128:
            raise ValueError(f"BlockSizes.block_kv={self.block_kv} must be a positive multiple of 128")


SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def heads_per_block(K: int, H: int) -> int:
    """P: kv heads per cache column block of the TPU body (P*H % 128 == 0; the GPU body uses P = 1)."""
    for p in range(1, K + 1):
        if K % p == 0 and (p * H) % 128 == 0:
            return p
    return K


GPU_SMEM_BUDGET = 96 * 1024  # bytes of K/V tiles in flight per program (of 227 KiB on Hopper, 163-227 on Ampere)
GPU_NUM_STAGES = 2
GPU_MAX_ROWS = 128  # R = G * bq query rows per program
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


def tpu_tiles(S: int, L: int, block_sizes: BlockSizes):
    """(bq, bkv, S_pad, L_pad) for the TPU body: L <= block_kv is one whole-length tile, else block_kv
    tiles with a partial last one."""
    bq = min(block_sizes.block_q, _round_up(S, 16))
    bkv = min(block_sizes.block_kv, L)
    return bq, bkv, _round_up(S, bq), _round_up(L, bkv)


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


def gpu_tiles(S: int, L: int, G: int, H: int, itemsize: int, block_sizes: BlockSizes, *, B: int | None = None,
              K: int | None = None, target_programs: int = GPU_TARGET_PROGRAMS) -> dict:
    """The Triton body's tiling for a power-of-2 query group G -> dict: bq (R = G*bq rows, 16..GPU_MAX_ROWS),
    bkv (K + V tiles in flight <= GPU_SMEM_BUDGET), padded lengths, warps, stages, and the kv split
    (n_split, chunk_blocks; without B and K only a forced kv_splits splits)."""
    bq = min(_pow2_floor(block_sizes.block_q), _pow2_ceil(S), max(1, GPU_MAX_ROWS // G))
    bq = max(bq, _pow2_ceil(-(-16 // G)))
    per_key = GPU_NUM_STAGES * 2 * H * itemsize
    bkv = min(_pow2_floor(block_sizes.block_kv), _pow2_ceil(max(L, 16)),
              max(16, _pow2_floor(max(1, GPU_SMEM_BUDGET // per_key))))
    R = G * bq
    S_pad, L_pad = _round_up(S, bq), _round_up(L, bkv)
    if B is None or K is None:
        n_split, chunk = gpu_split(1, L_pad // bkv, block_sizes.kv_splits or 1)
    else:
        n_split, chunk = gpu_split(B * K * (S_pad // bq), L_pad // bkv, block_sizes.kv_splits, target_programs)
    return dict(bq=bq, bkv=bkv, R=R, S_pad=S_pad, L_pad=L_pad,
                num_warps=8 if R >= 128 else 4, num_stages=GPU_NUM_STAGES,
                smem_kv_bytes=GPU_NUM_STAGES * 2 * bkv * H * itemsize, n_split=n_split, chunk_blocks=chunk)


def _tile_update(q, k, v, qblk, kblk, kvalid, m, l, acc, *, P: int, H: int):
    """One kv tile of the online softmax for one query head group g.

    q (bq, W) fp32 pre-scaled; k, v (bkv, W); qblk (bq, 1) int; kblk, kvalid (1, bkv) int (kinfo rows);
    m, l: P-tuples of (bq, 1) fp32 running max / sum; acc (bq, W) fp32. Returns (m, l, acc)."""
    allowed = (kvalid == 1) & (kblk <= qblk)  # (bq, bkv)
    fill = jnp.where(kvalid < 0, _PAD, _NEG)  # (1, bkv)
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
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
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


def _gpu_kernel(q_ref, k_ref, v_ref, qblk_ref, kinfo_ref, *refs, scale, bkv, num_kv_blocks, chunk_blocks=0):
    """Grid (b, k, i): q/o (R, H) = the G query heads x bq rows of kv head k; qblk (R, 1); k/v the
    full (L_pad, H) of kv head k, streamed in bkv tiles; kinfo (2, L_pad). kv split (chunk_blocks > 0):
    grid (b, k, i, c); program c streams its chunk of tiles and writes unnormalised fp32 acc (R, H),
    m and l (R, 1) (refs[-3:]) for _combine_splits."""
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
        fill = jnp.where(kvalid < 0, _PAD, _NEG)
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

    init = (jnp.full((R, 1), _NEG, jnp.float32), jnp.zeros((R, 1), jnp.float32), jnp.zeros((R, H), jnp.float32))
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


def _combine_splits(acc, m, l):
    """The kv split's partials -> attention output (fp32), in plain JAX: acc (..., n, R, H), m and l
    (..., n, R, 1) over the split axis n (-3): sum_c w_c acc_c / sum_c w_c l_c, w_c = exp(m_c - max_c m_c);
    equal to one pass, all-masked rows included (docs/internals/kernels.md)."""
    w = jnp.exp(m - jnp.max(m, axis=-3, keepdims=True))
    return jnp.sum(w * acc, axis=-3) / jnp.sum(w * l, axis=-3)


def validate(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, block_sizes: BlockSizes, *, q_pos_BS=None, k_pos_BL=None,
             block_size: int = 0, backend: str = "tpu"):
    """Clear errors for shapes the kernel does not support."""
    if backend not in BACKENDS:
        raise ValueError(f"flash_attention: backend {backend!r} is not one of {BACKENDS}")
    if q_BSNH.ndim != 4 or k_BLKH.ndim != 4 or v_BLKH.shape != k_BLKH.shape:
        raise ValueError(f"flash_attention: expected q (B,S,N,H) and k == v shape (B,L,K,H), got "
                         f"q{tuple(q_BSNH.shape)} k{tuple(k_BLKH.shape)} v{tuple(v_BLKH.shape)}")
    B, S, N, H = q_BSNH.shape
    Bk, L, K, Hk = k_BLKH.shape
    if Bk != B or Hk != H:
        raise ValueError(f"flash_attention: q{tuple(q_BSNH.shape)} and k{tuple(k_BLKH.shape)} disagree on batch or head_dim")
    if N % K:
        raise ValueError(f"flash_attention: {N} query heads is not a multiple of {K} kv heads")
    if H not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"flash_attention: head_dim={H} is not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if key_mask_BL is not None and tuple(key_mask_BL.shape) != (B, L):
        raise ValueError(f"flash_attention: key_mask shape {tuple(key_mask_BL.shape)} != (B, L) = {(B, L)}")
    if block_size < 0:
        raise ValueError(f"flash_attention: block_size={block_size} must be >= 0")
    if block_size:
        if q_pos_BS is None or k_pos_BL is None:
            raise ValueError("flash_attention: block-causal attention (block_size > 0) needs q_pos_BS and k_pos_BL")
        if tuple(q_pos_BS.shape) != (B, S) or tuple(k_pos_BL.shape) != (B, L):
            raise ValueError(f"flash_attention: q_pos_BS {tuple(q_pos_BS.shape)} / k_pos_BL {tuple(k_pos_BL.shape)} "
                             f"must be (B, S) = {(B, S)} / (B, L) = {(B, L)}")
    block_sizes.validate()


def _poison(in_specs: list, args: list, out_spec, out_shape, out_index: int = 0) -> dict:
    """Tests' poison_output: append a NaN buffer as an input aliased to output `out_index` (so a tile
    the kernel fails to write stays NaN); returns pallas_call's input_output_aliases."""
    in_specs.append(out_spec)
    args.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
    return {len(args) - 1: out_index}


def _mask_inputs(key_mask_BL, q_pos_BS, k_pos_BL, block_size, B, S, L, S_pad, L_pad):
    """qblk (B, S_pad) query block ids (0 when not block-causal) and kinfo (B, 2, L_pad): row 0 key
    block ids, row 1 1 valid / 0 masked / -1 padding."""
    valid = jnp.ones((B, L), jnp.int32) if key_mask_BL is None else key_mask_BL.astype(jnp.int32)
    valid = jnp.pad(valid, ((0, 0), (0, L_pad - L)), constant_values=-1)
    if block_size:
        qblk = (q_pos_BS.astype(jnp.int32) // block_size)
        kblk = (k_pos_BL.astype(jnp.int32) // block_size)
    else:
        qblk, kblk = jnp.zeros((B, S), jnp.int32), jnp.zeros((B, L), jnp.int32)
    qblk = jnp.pad(qblk, ((0, 0), (0, S_pad - S)))
    return qblk, jnp.stack([jnp.pad(kblk, ((0, 0), (0, L_pad - L))), valid], axis=1)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "block_sizes", "backend", "interpret",
                                             "poison_output"))
def flash_attention(q_BSNH, k_BLKH, v_BLKH, key_mask_BL=None, *, q_pos_BS=None, k_pos_BL=None, block_size: int = 0,
                    scale: float | None = None, block_sizes: BlockSizes = BlockSizes(), backend: str = "tpu",
                    interpret: bool = False, poison_output: bool = False):
    """Masked-token attention (B,S,N,H) x (B,L,K,H) -> (B,S,N,H), fp32 softmax and accumulation.

    key_mask_BL: True = attend. block_size > 0: block-causal over q_pos_BS (B,S) / k_pos_BL (B,L).
    backend: "tpu" (Mosaic) or "gpu" (Triton); interpret=True: the Pallas interpreter.
    poison_output (tests): the output starts as NaN, so an unwritten tile shows up.
    """
    validate(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, block_sizes, q_pos_BS=q_pos_BS, k_pos_BL=k_pos_BL,
             block_size=block_size, backend=backend)
    B, S, N, H = q_BSNH.shape
    L, K = k_BLKH.shape[1], k_BLKH.shape[2]
    G = N // K
    if backend == "gpu" and G & (G - 1):
        # Triton needs a power-of-2 query group (e.g. Qwen2.5-7B's 28/4 = 7): pad each group with
        # zero queries to the next power of two, attend, drop them (G'/G more query work, same cache reads).
        Gp = 1 << (G - 1).bit_length()
        q_pad = jnp.pad(q_BSNH.reshape(B, S, K, G, H), ((0, 0), (0, 0), (0, 0), (0, Gp - G), (0, 0)))
        o = flash_attention(q_pad.reshape(B, S, K * Gp, H), k_BLKH, v_BLKH, key_mask_BL, q_pos_BS=q_pos_BS,
                            k_pos_BL=k_pos_BL, block_size=block_size, scale=scale, block_sizes=block_sizes,
                            backend=backend, interpret=interpret, poison_output=poison_output)
        return o.reshape(B, S, K, Gp, H)[:, :, :, :G].reshape(B, S, N, H)
    scale = H ** -0.5 if scale is None else scale
    if backend == "gpu":
        return _flash_attention_gpu(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, q_pos_BS, k_pos_BL, block_size, scale,
                                    block_sizes, interpret, poison_output)
    P = heads_per_block(K, H)
    W = P * H
    bq, bkv, S_pad, L_pad = tpu_tiles(S, L, block_sizes)

    # Queries (small): (B,S,N,H) -> (B, K/P, G, S_pad, W); n = (j*P + p)*G + g.
    q = jnp.pad(q_BSNH, ((0, 0), (0, S_pad - S), (0, 0), (0, 0)))
    q = q.reshape(B, S_pad, K // P, P, G, H).transpose(0, 2, 4, 1, 3, 5).reshape(B, K // P, G, S_pad, W)
    # The cache (large): a free reshape (the partial last tile is masked in-kernel).
    k = k_BLKH.reshape(B, k_BLKH.shape[1], K * H)
    v = v_BLKH.reshape(B, v_BLKH.shape[1], K * H)
    qblk, kinfo = _mask_inputs(key_mask_BL, q_pos_BS, k_pos_BL, block_size, B, S, L, S_pad, L_pad)
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
    aliases = _poison(in_specs, args, q_spec, out_shape) if poison_output else {}
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


def _flash_attention_gpu(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, q_pos_BS, k_pos_BL, block_size, scale, block_sizes,
                         interpret, poison_output):
    """The Triton body: queries as (B, K, S_pad/bq, R = G*bq, H), one program per (b, kv head, query
    tile), or per (..., kv chunk) on a small grid (gpu_split; _combine_splits merges)."""
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
    qblk, kinfo = _mask_inputs(key_mask_BL, q_pos_BS, k_pos_BL, block_size, B, S, L, S_pad, L_pad)
    qblk = jnp.broadcast_to(qblk.reshape(B, nq, 1, bq), (B, nq, G, bq)).reshape(B, nq, R, 1)  # q's tile rows

    from jax.experimental.pallas import triton as pltriton
    params = None if interpret else pltriton.CompilerParams(num_warps=t["num_warps"], num_stages=t["num_stages"])
    kernel = functools.partial(_gpu_kernel, scale=scale, bkv=bkv, num_kv_blocks=L_pad // bkv)
    if n_split > 1:
        return _flash_attention_gpu_split(q, k, v, qblk, kinfo, kernel, t, B, S, N, K, G, H, params, interpret,
                                          poison_output).astype(q_BSNH.dtype)
    out_shape = jax.ShapeDtypeStruct((B, K, nq, R, H), q_BSNH.dtype)
    q_spec, in_specs = _gpu_in_specs(R, H, L_pad)
    args = [q, k, v, qblk, kinfo]
    aliases = _poison(in_specs, args, q_spec, out_shape) if poison_output else {}
    out = pl.pallas_call(
        kernel,
        grid_spec=pl.GridSpec(grid=(B, K, nq), in_specs=in_specs, out_specs=q_spec),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=params,
        interpret=interpret,
        name="dlm_flash_attention",
    )(*args)
    out = out.reshape(B, K, nq, G, bq, H).transpose(0, 2, 4, 1, 3, 5).reshape(B, S_pad, N, H)
    return out[:, :S]


def _gpu_in_specs(R: int, H: int, L_pad: int):
    """(q_spec, [q, k, v, qblk, kinfo] BlockSpecs) of the Triton body for a grid (b, j, i) or, with
    the kv split, (b, j, i, c): every input is the same for all chunks c of a (b, j, i)."""
    q_spec = pl.BlockSpec((None, None, None, R, H), lambda b, j, i, *c: (b, j, i, 0, 0))
    kv_spec = pl.BlockSpec((None, L_pad, H), lambda b, j, i, *c: (b, 0, j))
    return q_spec, [q_spec, kv_spec, kv_spec, pl.BlockSpec((None, None, R, 1), lambda b, j, i, *c: (b, i, 0, 0)),
                    pl.BlockSpec((None, 2, L_pad), lambda b, j, i, *c: (b, 0, 0))]


def _flash_attention_gpu_split(q, k, v, qblk, kinfo, kernel, t, B, S, N, K, G, H, params, interpret, poison_output):
    """The kv-split Triton body: grid (B, K, nq, n_split); fp32 partials acc (B, K, nq, n, R, H), m and
    l (B, K, nq, n, R, 1) merged by _combine_splits. Returns (B, S, N, H) fp32."""
    bq, R, S_pad, L_pad, n = t["bq"], t["R"], t["S_pad"], t["L_pad"], t["n_split"]
    nq = S_pad // bq
    _, in_specs = _gpu_in_specs(R, H, L_pad)
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
            aliases |= _poison(in_specs, args, spec, shape, idx)
    acc, m, l = pl.pallas_call(
        functools.partial(kernel, chunk_blocks=t["chunk_blocks"]),
        grid_spec=pl.GridSpec(grid=(B, K, nq, n), in_specs=in_specs, out_specs=out_specs),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=params,
        interpret=interpret,
        name="dlm_flash_attention",
    )(*args)
    out = _combine_splits(acc, m, l)  # (B, K, nq, R, H)
    out = out.reshape(B, K, nq, G, bq, H).transpose(0, 2, 4, 1, 3, 5).reshape(B, S_pad, N, H)
    return out[:, :S]
