"""Flash-style masked-token attention in Pallas for the dLLM window case (Mosaic TPU / Triton GPU).

S window queries (B, S, N, H) over the full-length K/V cache (B, L, K, H); GQA, key-padding and
optional block-causal masks. Masks, layout, grids, tile budgets, the kv split: docs/internals/kernels.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention.common import BlockSizes, validate
from pallas_kernels.attention.gpu import flash_attention_gpu
from pallas_kernels.attention.tpu import flash_attention_tpu


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
    K = k_BLKH.shape[2]
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
        return flash_attention_gpu(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, q_pos_BS, k_pos_BL, block_size, scale,
                                   block_sizes, interpret, poison_output)
    return flash_attention_tpu(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, q_pos_BS, k_pos_BL, block_size, scale,
                               block_sizes, interpret, poison_output)
