"""What the attention kernel's bodies share: tile sizes (BlockSizes), the score values of masked
and padding keys, shape validation, and the per-row mask inputs (qblk, kinfo)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp


NEG = -1e30  # same finite mask value as the reference: an all-masked row gives a uniform softmax
PAD = -2e30  # tile-padding keys: below every real key, masked or not
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


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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


def poison_alias(in_specs: list, args: list, out_spec, out_shape, out_index: int = 0) -> dict:
    """Tests' poison_output: append a NaN buffer as an input aliased to output `out_index` (so a tile
    the kernel fails to write stays NaN); returns pallas_call's input_output_aliases."""
    in_specs.append(out_spec)
    args.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
    return {len(args) - 1: out_index}


def mask_inputs(key_mask_BL, q_pos_BS, k_pos_BL, block_size, B, S, L, S_pad, L_pad):
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
