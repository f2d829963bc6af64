"""Top HLO ops by self time in a `dinfer-jax profile` trace (docs/profiling.md).

  python bench/profile_top_ops.py TRACE_DIR [--top 20] [--source auto|trace|xprof] [--json]

TRACE_DIR is the profile's --logdir (its newest run under plugins/profile/) or one run folder.
Sources:
  trace  the *.trace.json.gz that jax.profiler writes beside the .xplane.pb (no extra package).
         Complete events on one thread nest; an op's self time is its duration less its direct
         children's on that thread. Ops: events with an `hlo_op` arg (XLA:CPU's thunks) or on a
         line named "XLA Ops" (the TPU / GPU device line). Times are summed over threads.
  xprof  xprof's own HLO op table (`hlo_stats`, pip install xprof). XProf builds it from device
         planes only: for a CPU trace it has no rows.
  auto   xprof's table when xprof is installed and the table has rows, else trace.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
from collections import defaultdict


def run_dir(path: str) -> str:
    """The run folder: `path` itself when it holds trace files, else the newest under plugins/profile/."""
    if glob.glob(os.path.join(path, "*.xplane.pb")) or glob.glob(os.path.join(path, "*.trace.json.gz")):
        return path
    runs = sorted(glob.glob(os.path.join(path, "plugins", "profile", "*", "")))
    if not runs:
        raise FileNotFoundError(f"{path}: no trace here (no *.xplane.pb, and no plugins/profile/RUN/ folder)")
    return runs[-1].rstrip(os.sep)


def ops_from_trace(run: str) -> list[dict]:
    """[{op, module, count, self_us, total_us}] from the run's *.trace.json.gz files."""
    files = sorted(glob.glob(os.path.join(run, "*.trace.json.gz")))
    if not files:
        raise FileNotFoundError(f"{run}: no *.trace.json.gz (jax.profiler writes one beside each .xplane.pb)")
    stats = defaultdict(lambda: {"count": 0, "self_us": 0.0, "total_us": 0.0})
    for f in files:
        with gzip.open(f) as fh:
            events = json.load(fh)["traceEvents"]
        names = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        lines = defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and "dur" in e:
                lines[(e["pid"], e.get("tid"))].append(e)
        for key, evs in lines.items():
            op_line = names.get(key) == "XLA Ops"
            evs.sort(key=lambda e: (e["ts"], -e["dur"]))
            stack, child_us = [], defaultdict(float)  # open events; id(event) -> its children's time
            for e in evs:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                    stack.pop()
                if stack:
                    child_us[id(stack[-1])] += e["dur"]
                stack.append(e)
            for e in evs:
                args = e.get("args", {})
                if "hlo_op" not in args and not op_line:
                    continue
                s = stats[(args.get("hlo_op", e["name"]), args.get("hlo_module", ""))]
                s["count"] += 1
                s["total_us"] += e["dur"]
                s["self_us"] += max(e["dur"] - child_us[id(e)], 0.0)
    return [{"op": op, "module": mod, **s} for (op, mod), s in stats.items()]


def ops_from_xprof(run: str) -> list[dict]:
    """[{op, module, count, self_us, total_us}] from xprof's hlo_stats table (its program id as module)."""
    from xprof.convert import raw_to_tool_data
    xplanes = sorted(glob.glob(os.path.join(run, "*.xplane.pb")))
    if not xplanes:
        raise FileNotFoundError(f"{run}: no *.xplane.pb")
    data, _ = raw_to_tool_data.xspace_to_tool_data(xplanes, "hlo_stats", {})
    table = json.loads(data or "{}")
    table = table[0] if isinstance(table, list) else table
    cols = [c["id"] for c in table.get("cols", [])]
    out = []
    for row in table.get("rows", []):
        r = dict(zip(cols, (c.get("v") if c else None for c in row["c"])))
        out.append({"op": r["hlo_op_name"], "module": str(r.get("program_id", "")), "count": int(r["occurrences"]),
                    "self_us": float(r["total_self_time"]), "total_us": float(r["total_time"])})
    return out


def top_ops(path: str, top: int = 20, source: str = "auto") -> dict:
    """{run, source, total_self_us, ops: the `top` ops by self time, each with self_pct}."""
    if source not in ("auto", "trace", "xprof"):
        raise ValueError(f"source must be auto, trace or xprof, got {source!r}")
    run = run_dir(path)
    ops = []
    if source in ("auto", "xprof"):
        try:
            ops = ops_from_xprof(run)
        except ImportError:
            if source == "xprof":
                raise ImportError("--source xprof needs xprof (pip install xprof)") from None
        if source == "auto" and ops:
            source = "xprof"
    if source in ("auto", "trace") and not ops:
        ops, source = ops_from_trace(run), "trace"
    total = sum(o["self_us"] for o in ops)
    ops.sort(key=lambda o: (-o["self_us"], o["op"]))  # ties by name: the same order every run
    for o in ops:
        o["self_pct"] = 100.0 * o["self_us"] / total if total else 0.0
    return {"run": run, "source": source, "total_self_us": total, "ops": ops[:top]}


def format_table(res: dict) -> str:
    lines = [f"{res['run']} ({res['source']}): {res['total_self_us'] / 1e3:.3f} ms self time in ops",
             f"{'self ms':>9} {'self %':>7} {'total ms':>9} {'count':>6}  op (module)"]
    for o in res["ops"]:
        lines.append(f"{o['self_us'] / 1e3:9.3f} {o['self_pct']:7.2f} {o['total_us'] / 1e3:9.3f} {o['count']:6d}  "
                     f"{o['op']}" + (f" ({o['module']})" if o["module"] else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--source", choices=("auto", "trace", "xprof"), default="auto")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        res = top_ops(a.trace_dir, a.top, a.source)
    except (FileNotFoundError, ImportError) as e:
        print(f"profile_top_ops: error: {e}", file=sys.stderr)
        return 2
    if not res["ops"]:
        print(f"profile_top_ops: error: {res['run']}: no ops in the {res['source']} source", file=sys.stderr)
        return 1
    print(json.dumps(res) if a.json else format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
