"""Bidirectional masked-token attention (dLLM window queries over a full-length K/V).

`attention(q, k, v, key_mask, impl=...)` dispatches:
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
from pallas_kernels.attention.reference import attention_reference

IMPLS = ("auto", "xla", "pallas", "reference", "cudnn")

__all__ = ["BlockSizes", "IMPLS", "attention", "attention_reference", "flash_attention"]


def _cudnn(q_BSNH, k_BLKH, v_BLKH, key_mask_BL):
    B, S, N, H = q_BSNH.shape
    mask = None if key_mask_BL is None else jnp.broadcast_to(
        key_mask_BL[:, None, None, :], (B, N, S, key_mask_BL.shape[1]))
    if key_mask_BL is not None:
        # Rows with no valid key: dot_product_attention would give NaN; the reference gives a
        # uniform softmax. Such rows only occur for padded queries; keep them finite.
        mask = mask | ~jnp.any(key_mask_BL, axis=-1)[:, None, None, None]
    out = jax.nn.dot_product_attention(q_BSNH, k_BLKH.astype(q_BSNH.dtype), v_BLKH.astype(q_BSNH.dtype),
                                       mask=mask, implementation="cudnn")
    return out.astype(q_BSNH.dtype)


def attention(q_BSNH, k_BLKH, v_BLKH, key_mask_BL=None, *, impl: str = "auto",
              block_sizes: BlockSizes | None = None, interpret: bool | None = None):
    """(B,S,N,H) queries over (B,L,K,H) keys/values -> (B,S,N,H). key_mask_BL: True = attend."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {IMPLS}")
    if impl in ("auto", "xla", "reference"):
        return attention_reference(q_BSNH, k_BLKH, v_BLKH, key_mask_BL)
    if impl == "cudnn":
        return _cudnn(q_BSNH, k_BLKH, v_BLKH, key_mask_BL)
    platform = jax.default_backend()
    backend = "gpu" if platform in ("gpu", "cuda", "rocm") else "tpu"
    if interpret is None:
        interpret = platform not in ("tpu", "gpu", "cuda", "rocm")
    return flash_attention(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, block_sizes=block_sizes or BlockSizes(),
                           backend=backend, interpret=interpret)
