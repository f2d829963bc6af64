"""The per-forward inputs beside the tokens, one typed pytree from the Transformer down to
Attention (the layer stack broadcasts it to every layer)."""
from __future__ import annotations

from typing import Any

from flax import struct


@struct.dataclass
class ForwardInputs:
    """positions_BS: the S inputs' rotary positions. key_mask_BL: True = attend (None: all keys).
    window_start: scalar or (B,): where the S inputs' K/V go in a given full-length cache (None:
    no cache). kv_write_BS: which of them are written (None: all). key_positions_BL: the keys'
    positions, for block-causal masks over a cache (None: positions_BS)."""
    positions_BS: Any
    key_mask_BL: Any = None
    window_start: Any = None
    kv_write_BS: Any = None
    key_positions_BL: Any = None
