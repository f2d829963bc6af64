"""RowKnobs for tests that drive a strategy directly: SamplingParams()' values for every knob, the
given ones over them."""
from __future__ import annotations

import jax.numpy as jnp


def row_knobs(batch: int = 1, **values):
    from dinfer_jax.decoding.rows import knob_value
    from dinfer_jax.decoding.spec import RowKnobs
    from dinfer_jax.engine import SamplingParams
    p = SamplingParams()
    base = RowKnobs.build(lambda k, dt: jnp.full((batch,), knob_value(p, k), dt))
    return base.replace(**{k: jnp.asarray(v) for k, v in values.items()})
