"""The live canvas view, XProf profiling and the throughput benchmark on the tiny model."""
from __future__ import annotations

import io

import numpy as np
import pytest

from dinfer_jax.canvas_view import MASK_GLYPH, CanvasView
from dinfer_jax.engine import SamplingParams

PARAMS = SamplingParams(gen_length=16, block_length=8, threshold=0.3)


@pytest.fixture(scope="module")
def tiny():
    from dinfer_jax.config import preset
    from dinfer_jax.model import Model
    from dinfer_jax.models import init_params
    cfg = preset("tiny")
    return Model(cfg, init_params(cfg, seed=3))


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.smoke
def test_canvas_view_redraws_each_step(tiny):
    out = _Tty()
    view = CanvasView(tiny.config.mask_token_id, {tiny.config.eos_token_id}, stream=out)
    r = tiny.generator.generate([[1, 2, 3]], PARAMS, observer=view)
    text = out.getvalue()
    assert view.steps == r.nfe[0]
    assert text.count("step ") == r.nfe[0]  # one frame per denoising step
    assert MASK_GLYPH in text and "\x1b[1;32m" in text  # masks shown; fresh tokens highlighted
    assert "\x1b[" in text and "F\x1b[J" in text  # frames redraw in place
    assert "done" in text.splitlines()[-2]


@pytest.mark.smoke
def test_canvas_view_is_off_when_not_a_tty(tiny):
    out = io.StringIO()
    view = CanvasView(tiny.config.mask_token_id, stream=out)
    tiny.generator.generate([[1, 2, 3]], PARAMS, observer=view)
    assert out.getvalue() == "" and not view.enabled


@pytest.mark.smoke
def test_profile_writes_a_trace_with_our_regions(tiny, tmp_path):
    from dinfer_jax.profiling import profile_generation
    out = profile_generation(tiny, [[1, 2, 3]], PARAMS, str(tmp_path / "prof"))
    xplanes = [f for f in out["trace_files"] if f.endswith(".xplane.pb")]
    assert xplanes
    data = open(xplanes[0], "rb").read()
    for region in (b"dinfer_profile", b"dinfer_generate", b"denoise_loop", b"forward_full", b"forward_window",
                   b"strategy"):
        assert region in data, region


@pytest.mark.smoke
def test_bench_rows(tiny):
    from dinfer_jax.benchmark import format_table, run_bench
    rows = run_bench(tiny, batches=(1, 2), strategies=("threshold",), caches=("dual",), prompt_len=8,
                     base=PARAMS, repeats=2, progress=False)
    assert [(r.batch, r.strategy, r.cache) for r in rows] == [(1, "threshold", "dual"), (2, "threshold", "dual")]
    for r in rows:
        assert r.seconds > 0 and r.nfe >= 2 and r.tokens_per_s > 0 and np.isfinite(r.tpf)
    assert format_table(rows).count("\n") == 3
