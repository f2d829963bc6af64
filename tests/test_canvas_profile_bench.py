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
    from dinfer_jax.families import preset
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
    # On CPU the named scopes live only in the HLO metadata: no trace event carries them; the host
    # annotations are events (docs/profiling.md).
    import gzip
    import json
    from bench.profile_top_ops import main, top_ops
    traces = [f for f in out["trace_files"] if f.endswith(".trace.json.gz")]
    events = json.load(gzip.open(traces[0]))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"dinfer_profile", "dinfer_generate"} <= names and not {"denoise_loop", "forward_full"} & names
    res = top_ops(str(tmp_path / "prof"), top=5, source="trace")
    assert res["source"] == "trace" and len(res["ops"]) == 5 and res["total_self_us"] > 0
    assert all(o["module"].startswith("jit_") and 0 < o["self_us"] <= o["total_us"] + 1e-9 for o in res["ops"])
    assert [o["self_us"] for o in res["ops"]] == sorted((o["self_us"] for o in res["ops"]), reverse=True)
    assert main([str(tmp_path / "prof"), "--top", "3", "--source", "trace"]) == 0


def _fake_run(path, events):
    import gzip
    import json
    path.mkdir(parents=True)
    with gzip.open(path / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


@pytest.mark.smoke
def test_profile_top_ops_self_time(tmp_path, capsys):
    """Self time = duration less the direct children's on the same thread; only ops are counted."""
    from bench.profile_top_ops import main, top_ops

    def op(name, ts, dur, tid=1, **args):
        return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}
    _fake_run(tmp_path / "plugins" / "profile" / "2026_01_01", [
        {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
        op("while.1", 0, 10, hlo_op="while.1", hlo_module="jit_run"),
        op("fusion.2", 1, 4, hlo_op="fusion.2", hlo_module="jit_run"),  # inside while.1
        op("dot.3", 2, 1, hlo_op="dot.3", hlo_module="jit_run"),  # inside fusion.2: not while.1's direct child
        op("fusion.2", 20, 3, tid=2, hlo_op="fusion.2", hlo_module="jit_run"),  # another thread
        op("python_call", 0, 50, tid=3),  # not an op
        op("convolution.7", 5, 2, tid=9),  # a device "XLA Ops" line: an op without args
    ])
    res = top_ops(str(tmp_path), source="trace")
    got = {o["op"]: (o["count"], o["self_us"], o["total_us"]) for o in res["ops"]}
    assert got == {"fusion.2": (2, 6.0, 7.0), "while.1": (1, 6.0, 10.0), "dot.3": (1, 1.0, 1.0),
                   "convolution.7": (1, 2.0, 2.0)}
    assert res["total_self_us"] == 15.0 and abs(sum(o["self_pct"] for o in res["ops"]) - 100) < 1e-9
    assert [o["op"] for o in top_ops(str(tmp_path), top=2, source="trace")["ops"]] == ["fusion.2", "while.1"]
    assert main([str(tmp_path / "nothing")]) == 2
    assert "no trace here" in capsys.readouterr().err
    with pytest.raises(ValueError, match="source must be"):
        top_ops(str(tmp_path), source="tb")


@pytest.mark.smoke
def test_bench_rows(tiny):
    from dinfer_jax.benchmark import format_table, run_bench
    rows = run_bench(tiny, batches=(1, 2), strategies=("threshold",), caches=("dual",), prompt_len=8,
                     base=PARAMS, repeats=2, progress=False)
    assert [(r.batch, r.strategy, r.cache) for r in rows] == [(1, "threshold", "dual"), (2, "threshold", "dual")]
    for r in rows:
        assert r.seconds > 0 and r.nfe >= 2 and r.tokens_per_s > 0 and np.isfinite(r.tpf)
    assert format_table(rows).count("\n") == 3
