"""serving_metrics.Histogram against a direct count, and blocks_at_cap."""
import math

import numpy as np
import pytest

from dinfer_jax.serving_metrics import Histogram, blocks_at_cap


def test_histogram_matches_direct_count():
    rng = np.random.default_rng(0)
    vals = np.concatenate([rng.exponential(0.3, 500), [0.1, 0.25, 1.0, 1e9, float("nan"), float("inf")]])
    h = Histogram("x", "help", (0.1, 0.25, 1.0, 4.0))
    for v in vals:
        h.observe(v)
    finite = vals[np.isfinite(vals)]  # NaN / inf are not observed
    lines = {ln.split()[0]: float(ln.split()[1]) for ln in h.lines() if not ln.startswith("#")}
    for b in (0.1, 0.25, 1.0, 4.0):  # le is inclusive, as Prometheus defines it
        assert lines[f'x_bucket{{le="{b:g}"}}'] == np.sum(finite <= b)
    assert lines['x_bucket{le="+Inf"}'] == lines["x_count"] == len(finite)
    assert lines["x_sum"] == pytest.approx(finite.sum(), rel=1e-6)
    assert math.isfinite(lines["x_sum"])


def test_histogram_buckets_must_increase():
    with pytest.raises(ValueError, match="increase"):
        Histogram("x", "h", (1.0, 0.5))


def test_blocks_at_cap():
    assert blocks_at_cap([3, 8, 8, 0], cap=8, adaptive=True) == (3, 2)
    assert blocks_at_cap([8, 8], cap=8, adaptive=False) == (2, 0)  # fixed steps: always at the bound
