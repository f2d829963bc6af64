"""Compile-only TPU plans (dinfer_jax.plan, libtpu, no TPU attached) for docs/accelerators.md's table: per-chip
bytes, fit, Mosaic calls, collectives, compile seconds and the spec-sheet floor of each case below.

  python bench/tpu_plan.py [--only NAME ...] [--json bench/tpu_plan.json]
  python bench/tpu_plan.py --table bench/tpu_plan.json      # docs/accelerators.md's markdown table

Every case: bf16, prompt 256, gen 256, the family's cache (dual; block diffusion for block-causal
models, block = the model's attention block), TPF 1 in the floor (scale it by a measured TPF).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (preset, topology, mesh, batch)
CASES = {
    "7b-a1b v5e:1x1": ("llada-moe-7b-a1b", "v5e:1x1", None, 1),
    "llada2-mini v5e:2x2 expert=4": ("llada2-mini", "v5e:2x2", "expert=4", 1),
    "7b-a1b v5e:2x4 data=2,expert=2,model=2 b2": ("llada-moe-7b-a1b", "v5e:2x4", "data=2,expert=2,model=2", 2),
    "llada2-flash v6e:2x4 expert=8 b16": ("llada2-flash", "v6e:2x4", "expert=8", 16),
    "fast-dllm-v2-7b v7x:2x2x1 b32": ("fast-dllm-v2-7b", "v7x:2x2x1", None, 32),
    "7b-a1b v5e:4x4 (4 hosts) data=2,expert=8 b16": ("llada-moe-7b-a1b", "v5e:4x4", "data=2,expert=8", 16),
}


def table(rows: list[dict]) -> str:
    """Markdown: one line per case."""
    gib = lambda b: f"{b / 2**30:.2f}"
    out = ["| case | device | mesh | GiB per chip: args + temp = total (of HBM) | fits | Mosaic calls | collectives "
           "(count) | floor tok/s at TPF 1 | compile s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pc, m = r["per_chip_bytes"], r["mesh"]
        coll = sum(v["count"] for v in r["collectives"].values())
        out.append(f"| {r['case']} | {r['device_kind']} x {r['chips']} | data={m['data']},expert={m['expert']},"
                   f"model={m['model']} | {gib(pc['arguments'])} + {gib(pc['temp'])} = {gib(pc['total'])} "
                   f"({gib(r['hbm_bytes'])}) | {r['fits']} | {r['mosaic_calls']} | {coll} | "
                   f"{r['predicted']['tokens_per_s']} | {r['compile_seconds']} |")
    return "\n".join(out)


def run(name: str) -> dict:
    from dinfer_jax import plan
    from dinfer_jax.families import preset
    from dinfer_jax.engine import SamplingParams
    p, topo, mesh, batch = CASES[name]
    cfg = preset(p)
    block = cfg.attention_mask == "block_causal"
    sp = SamplingParams(gen_length=256, block_length=cfg.block_size or 32, cache="block" if block else "dual")
    out = plan.plan(cfg, topo, mesh, find_batch=False, batch=batch, prompt_len=256, sampling=sp)
    return {"case": name, "preset": p, **{k: out.get(k) for k in (
        "topology", "device_kind", "chips", "mesh", "batch", "per_chip_bytes", "hbm_bytes", "fits", "mosaic_calls",
        "interpreted", "collectives", "flops", "bytes_accessed", "compile_seconds", "predicted", "audits", "meshes",
        "reason")}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", default=None, choices=list(CASES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--table", nargs="+", default=None, help="print the markdown table of these JSON files, exit")
    a = ap.parse_args(argv)
    if a.table:
        rows = []
        for path in a.table:
            with open(path) as f:
                rows += json.load(f)
        print(table(rows))
        return None
    rows = []
    for name in a.only or CASES:
        r = run(name)
        rows.append(r)
        pc = r["per_chip_bytes"] or {}
        print(json.dumps({"case": name, "mesh": r["mesh"], "fits": r["fits"],
                          "arguments_gib": round(pc.get("arguments", 0) / 2**30, 2),
                          "temp_gib": round(pc.get("temp", 0) / 2**30, 2), "compile_s": r["compile_seconds"],
                          "floor_tok_s": (r["predicted"] or {}).get("tokens_per_s")}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
