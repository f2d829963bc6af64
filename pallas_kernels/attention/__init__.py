"""Masked-token attention (dLLM window queries over a full-length K/V): full bidirectional, or
block-causal (`block_size > 0`, over per-row query/key positions), with a key-padding mask.

`attention(q, k, v, key_mask, q_pos_BS=, k_pos_BL=, block_size=, impl=...)` dispatches:
  "xla" / "reference": pallas_kernels.attention.reference (pure-JAX einsums compiled by XLA,
               fp32 scores/softmax/accumulation) -- the reference every kernel is tested against;
  "cudnn":     jax.nn.dot_product_attention(implementation="cudnn") (GPU only; for benchmarks);
  "pallas":    the Pallas flash kernel: Mosaic on TPU, Triton on GPU, interpreter on CPU;
  "auto":      "xla" on every platform until the Pallas kernel is benchmarked on hardware.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention.kernel import BlockSizes, flash_attention
from pallas_kernels.attention.reference import allowed_mask, attention_reference

IMPLS = ("auto", "xla", "pallas", "reference", "cudnn")

__all__ = ["BlockSizes", "IMPLS", "allowed_mask", "attention", "attention_reference", "flash_attention"]


def _cudnn(q_BSNH, k_BLKH, v_BLKH, allowed):
    B, S, N, H = q_BSNH.shape
    L = k_BLKH.shape[1]
    mask = None
    if allowed is not None:
        allowed = jnp.broadcast_to(allowed, (B, 1, S, L))
        # Rows with no valid key: dot_product_attention would give NaN; the reference gives a
        # uniform softmax. Such rows only occur for padded queries; keep them finite.
        allowed = allowed | ~jnp.any(allowed, axis=-1, keepdims=True)
        mask = jnp.broadcast_to(allowed, (B, N, S, L))
    out = jax.nn.dot_product_attention(q_BSNH, k_BLKH.astype(q_BSNH.dtype), v_BLKH.astype(q_BSNH.dtype),
                                       mask=mask, implementation="cudnn")
    return out.astype(q_BSNH.dtype)


def attention(q_BSNH, k_BLKH, v_BLKH, key_mask_BL=None, *, q_pos_BS=None, k_pos_BL=None, block_size: int = 0,
              impl: str = "auto", block_sizes: BlockSizes | None = None, interpret: bool | None = None):
    """(B,S,N,H) queries over (B,L,K,H) keys/values -> (B,S,N,H). key_mask_BL: True = attend;
    block_size > 0: block-causal over q_pos_BS (B,S) / k_pos_BL (B,L) (reference.allowed_mask)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {IMPLS}")
    mask_kw = dict(q_pos_BS=q_pos_BS, k_pos_BL=k_pos_BL, block_size=block_size)
    if impl in ("auto", "xla", "reference"):
        return attention_reference(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, **mask_kw)
    if impl == "cudnn":
        return _cudnn(q_BSNH, k_BLKH, v_BLKH, allowed_mask(q_BSNH.shape, key_mask_BL, **mask_kw))
    if block_size:
        raise NotImplementedError("the Pallas attention kernel does not take the block-causal mask yet; "
                                  "use attention_impl='xla'")
    platform = jax.default_backend()
    backend = "gpu" if platform in ("gpu", "cuda", "rocm") else "tpu"
    if interpret is None:
        interpret = platform not in ("tpu", "gpu", "cuda", "rocm")
    return flash_attention(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, block_sizes=block_sizes or BlockSizes(),
                           backend=backend, interpret=interpret)
