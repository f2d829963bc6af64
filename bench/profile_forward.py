"""Where one forward's time goes: the top XLA ops of a jax.profiler trace of the real forward at the
roofline benchmark shape (bench/roofline.py: llada-moe-7b-a1b cut to 2 layers, fp32, batch 1,
prompt 128, gen 64, block 32, random weights).

  python bench/profile_forward.py --kind dual          # or full; --layers, --repeats, --top
  python bench/profile_forward.py --tiny --kind dual   # seconds (tests)
  python bench/profile_forward.py --preset medium      # the medium dense LLaDA (bench/forward_ab.py)

Prints ms per forward and calls per forward of the --top ops by total duration (trace events of
the XLA:CPU thunk executor or the device ops on an accelerator), and the share of the forward taken
by per-layer copies of scanned params (`dynamic-slice` fusions that run once per layer).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import roofline as rl  # noqa: E402
from bench.bench_loop import median_time  # noqa: E402
from dinfer_jax.families import preset  # noqa: E402
from dinfer_jax.models import Transformer  # noqa: E402

HOST_EVENTS = ("ThunkExecutor", "block_until_ready", "PjitFunction", "stop_trace", "SlinkyThreadPool", "$")


def op_times(trace_dir: str, repeats: int) -> dict[str, tuple[float, float]]:
    """{op name: (ms per forward, calls per forward)} from the newest trace under trace_dir."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        raise RuntimeError(f"no trace written under {trace_dir}")
    events = json.load(gzip.open(files[-1]))["traceEvents"]
    dur, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(HOST_EVENTS):
            dur[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    return {k: (dur[k] / repeats / 1e3, calls[k] / repeats) for k in dur}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="dual", choices=["full", "dual"])
    ap.add_argument("--preset", default="llada-moe-7b-a1b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None, help="JSON here")
    a = ap.parse_args(argv)
    if a.tiny:
        cfg, prompt, gen, block = rl.tiny_configs()[0], 96, 32, 16
    elif a.preset == "medium":
        from bench.forward_ab import model_config
        cfg, prompt, gen, block = model_config("medium", 0), 128, 64, 32
    else:
        cfg, prompt, gen, block = preset(a.preset).replace(num_layers=a.layers), 128, 64, 32
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    params = rl.random_params(cfg, dtype)
    module = Transformer(cfg, dtype=dtype)
    gs, Lc = rl.canvas_layout("dual", prompt, gen)
    canvas = rl.random_canvas(cfg, 1, Lc)
    full = jax.jit(rl.forward_fn(module, None, 1, Lc, gs, prompt, block))
    _, kv = full(params, canvas)
    if a.kind == "full":
        fn, args = full, (params, canvas)
    else:
        fn, args = jax.jit(rl.forward_fn(module, (0, block, 0), 1, Lc, gs, prompt, block)), (params, canvas, kv)
    fwd_ms = median_time(lambda: fn(*args), a.repeats, warmup=2) * 1e3
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(a.repeats):
            jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        ops = op_times(d, a.repeats)
    layer_copies = {k: v for k, v in ops.items() if k.startswith("dynamic-slice") and v[1] == cfg.num_layers}
    copy_ms = sum(v[0] for v in layer_copies.values())
    print(f"{a.kind} forward, {cfg.num_layers} layers, {dtype.__name__ if hasattr(dtype, '__name__') else dtype}: "
          f"{fwd_ms:.1f} ms (median of {a.repeats}, untraced)\n")
    print("| op | ms / forward | calls / forward | share |\n|---|---|---|---|")
    for k, (ms, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"| {k[:60]} | {ms:.2f} | {n:g} | {100 * ms / fwd_ms:.1f}% |")
    print(f"\nonce-per-layer dynamic-slice fusions (copies of scanned params): {len(layer_copies)} ops, "
          f"{copy_ms:.1f} ms = {100 * copy_ms / fwd_ms:.1f}% of the forward")
    res = dict(kind=a.kind, layers=cfg.num_layers, forward_ms=fwd_ms, layer_copy_ms=copy_ms,
               ops={k: dict(ms=v[0], calls=v[1]) for k, v in ops.items()})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
