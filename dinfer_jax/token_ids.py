"""Validation of user token ids, shared by every family: a clear ValueError naming the problem
instead of an index error from deep inside a jitted gather."""
from __future__ import annotations

import numpy as np


def check_token_ids(ids, vocab_size: int, max_length: int | None = None, what: str = "token ids") -> np.ndarray:
    """ids: (L,) or (B, L) integers in [0, vocab_size), L <= max_length -> the same shape as int32."""
    try:
        arr = np.asarray(ids)
    except ValueError as e:  # ragged nesting
        raise ValueError(f"{what} must be a rectangular (L,) or (B, L) array ({e})") from None
    if arr.ndim not in (1, 2) or arr.size == 0:
        raise ValueError(f"{what} must be a non-empty (L,) or (B, L) array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        raise ValueError(f"token id {int(arr[bad].flat[0])} is out of the vocabulary "
                         f"[0, {vocab_size}) ({int(bad.sum())} bad ids in {what})")
    if max_length is not None and arr.shape[-1] > max_length:
        raise ValueError(f"sequence length {arr.shape[-1]} exceeds max_position_embeddings={max_length} ({what})")
    return arr.astype(np.int32)
