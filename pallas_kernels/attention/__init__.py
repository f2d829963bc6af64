"""Masked-token attention (dLLM window queries over a full-length K/V): full bidirectional, or
block-causal (`block_size > 0`), with a key-padding mask. kernel.py: the Pallas flash kernel's
entry (tpu.py: the Mosaic body, gpu.py / gpu_split.py: the Triton body and its kv split, common.py
what they share; interpreted on CPU); reference.py: the pure-JAX reference it is tested against. Which one runs where is chosen in dinfer_jax/kernels.py."""
from pallas_kernels.attention.kernel import BlockSizes, flash_attention
from pallas_kernels.attention.reference import allowed_mask, attention_reference

__all__ = ["BlockSizes", "allowed_mask", "attention_reference", "flash_attention"]
