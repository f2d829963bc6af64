"""Per-position token constraints inside the jitted loop (canvas templates: infilling, structured
output; dinfer_jax/canvas_template.py builds them on the host).

A constrained program (DecodeSpec.constraint_classes = C > 0) carries two extra per-row arrays in
its knobs:
  allow_class (B, L) int32: per canvas position, -1 = a fixed token (the template's skeleton or an
      infill suffix: kept as it is, never committed, never edited), 0 = any token, c >= 1 = only
      the tokens of class c;
  allowed (B, C, V) bool: class c's token set (row c = 0 is all True).
The logits of every step are filtered before the strategy sees them, so confidences, thresholds,
sampling and editing all act inside the allowed sets; nothing leaves the device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

CONSTRAINT_KNOBS = ("allow_class", "allowed")
NEG_INF = -jnp.inf


def constraint_buckets(n_classes: int) -> int:
    """DecodeSpec.constraint_classes for a template of n_classes token sets (+ class 0, any): the
    next power of two >= n_classes + 1, at least 2, so programs stay few."""
    return max(2, 1 << n_classes.bit_length())


def constrain_logits(logits_BSV, cls_BS, allowed_BCV, x_BS):
    """logits with every token outside a position's set at -inf; a fixed position (-1) allows only
    its current token x_BS (so an editing rule never changes it). Shapes: S window positions."""
    V = logits_BSV.shape[-1]
    ok_BSV = jax.vmap(lambda table_CV, c_S: table_CV[c_S])(allowed_BCV, jnp.maximum(cls_BS, 0))
    iota = jnp.arange(V, dtype=jnp.int32)[None, None, :]
    fixed_BSV = iota == x_BS[..., None]
    keep = jnp.where((cls_BS < 0)[..., None], fixed_BSV, ok_BSV)
    return jnp.where(keep, logits_BSV, jnp.asarray(NEG_INF, logits_BSV.dtype))
