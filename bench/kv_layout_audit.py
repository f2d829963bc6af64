"""The KV-cache relayout audit, before and after the cache layout change (issue 27), compile-only
(libtpu, no TPU). For every cell of bench/tpu_family_table.json (preset x TPU generation: the
smallest topology that fits at batch 1, with its mesh), the batch-1 generate program is compiled
again with this checkout and its audit (`Plan.audits`: KV-cache-shaped copies inside the decoding
loop) and per-chip bytes are set beside the table's, which were compiled with the (layers, B, L,
K, H) cache, before the (layers, B, L, K*H) one (dinfer_jax/cache.py).

  python bench/kv_layout_audit.py [--only PRESET ...] --json bench/kv_layout_audit.json
  python bench/kv_layout_audit.py --table bench/kv_layout_audit.json

Rows are appended as they finish; cells already in the JSON are skipped (--redo compiles them again).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tpu_family_table import _sampling  # noqa: E402  (the table's own settings)

GiB = 2**30
MiB = 2**20


def audit(row: dict) -> dict:
    """Compile the batch-1 program of one table row (same topology, mesh, settings) -> its audit."""
    from dinfer_jax import plan
    from dinfer_jax.families import preset
    cfg = preset(row["preset"])
    mesh = ",".join(f"{k}={v}" for k, v in row["mesh"].items())
    t0 = time.perf_counter()
    out = plan.plan(cfg, row["topology"], mesh, find_batch=False, batch=1, prompt_len=256, sampling=_sampling(cfg))
    a = out["audits"]
    return {"preset": row["preset"], "gen": row["gen"], "topology": row["topology"], "mesh": row["mesh"],
            "before": {"kv_copies_in_loop": row["audits"]["kv_copies_in_loop"],
                       "kv_copy_bytes": row["audits"]["kv_copy_bytes"],
                       "total": row["per_batch"]["1"]["total"]},
            "after": {"kv_copies_in_loop": a["kv_copies_in_loop"], "kv_copy_bytes": a["kv_copy_bytes"],
                      "total": out["per_chip_bytes"]["total"], "temp": out["per_chip_bytes"]["temp"],
                      "largest_copy_in_loop_bytes": a["largest_copy_in_loop_bytes"]},
            "seconds": round(time.perf_counter() - t0, 1)}


def table(rows: list[dict]) -> str:
    lines = ["| preset | topology | mesh | KV copies in the loop, before -> after (MiB) | GiB per chip at batch 1, "
             "before -> after |", "|---|---|---|---|---|"]
    for r in rows:
        b, a = r["before"], r["after"]
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
        lines.append(f"| {r['preset']} | {r['topology']} | {mesh} | {b['kv_copies_in_loop']} "
                     f"({b['kv_copy_bytes'] / MiB:.0f}) -> {a['kv_copies_in_loop']} ({a['kv_copy_bytes'] / MiB:.0f}) | "
                     f"{b['total'] / GiB:.2f} -> {a['total'] / GiB:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--cells", default=os.path.join(here, "tpu_family_table.json"),
                    help="the table's rows (bench/tpu_family_table.py --json)")
    ap.add_argument("--json", help="append rows here (and skip cells already in it)")
    ap.add_argument("--only", nargs="*", help="presets to audit (default: every cell)")
    ap.add_argument("--redo", action="store_true")
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of a finished JSON and exit")
    a = ap.parse_args(argv)
    if a.table:
        print(table(json.load(open(a.table))))
        return
    cells = [r for r in json.load(open(a.cells)) if r.get("per_batch") and (not a.only or r["preset"] in a.only)]
    done = json.load(open(a.json)) if a.json and os.path.exists(a.json) else []
    have = {(r["preset"], r["gen"]) for r in done}
    for row in cells:
        if (row["preset"], row["gen"]) in have and not a.redo:
            continue
        out = audit(row)
        print(json.dumps(out), flush=True)
        done = [r for r in done if (r["preset"], r["gen"]) != (row["preset"], row["gen"])] + [out]
        if a.json:
            with open(a.json, "w") as f:
                json.dump(done, f, indent=1)
    print(table(done))


if __name__ == "__main__":
    main()
