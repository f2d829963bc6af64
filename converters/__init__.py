"""Hugging Face / PyTorch checkpoints <-> dinfer-jax checkpoints, streamed tensor by tensor."""
from converters.convert import convert, export
from converters.errors import ConversionError
from converters.hf_import import load_hf_params

__all__ = ["ConversionError", "convert", "export", "load_hf_params"]
