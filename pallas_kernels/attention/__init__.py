"""Bidirectional masked-token attention (dLLM window queries over a full-length K/V)."""
from pallas_kernels.attention.reference import attention_reference

__all__ = ["attention_reference"]
