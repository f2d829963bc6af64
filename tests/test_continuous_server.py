"""The continuous scheduler behind the server, under an open-loop load (bench/serve_load.py at a
small, bounded scale) side by side with the static batcher: every request completes, the run
stops by itself, and the continuous scheduler really swaps rows between segments."""
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


def test_serve_load_small_and_bounded():
    from bench.serve_load import run
    t = time.perf_counter()
    out = run(rate=8.0, duration=2.0, drain=60.0, mix=(16, 32), max_batch=4, seed=1)
    assert time.perf_counter() - t < 300
    for name in ("static", "continuous"):
        r = out["runs"][name]
        assert r["sent"] >= 4 and r["completed"] == r["sent"] and r["unfinished"] == 0, (name, r)
        assert r["tokens_per_s"] > 0 and 0 < r["ttfb_p50"] <= r["e2e_p99"]
    cont = out["runs"]["continuous"]["server_stats"]
    assert cont["segments"] >= cont["admitted"] > 0 and cont["completed"] >= out["runs"]["continuous"]["sent"]
