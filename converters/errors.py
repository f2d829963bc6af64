"""Errors raised by the converters: always a message naming the file / tensor at fault."""


class ConversionError(ValueError):
    """A checkpoint that cannot be converted (missing, unexpected, mis-shaped or corrupt tensors)."""
