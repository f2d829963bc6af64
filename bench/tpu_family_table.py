"""docs/accelerators.md's per-family TPU table (issue 27 item 6), compile-only (libtpu, no TPU):
for every family's flagship preset and each TPU generation, the smallest topology of a ladder
on which the batch-1 generate program fits (`dinfer_jax.plan.plan`: the mesh with the best floor
that fits), then per-chip GiB at batch 16 and 64 on that topology and mesh.

  python bench/tpu_family_table.py [--only PRESET ...] [--gens v5e ...] --json bench/tpu_family_table.json
  python bench/tpu_family_table.py --table bench/tpu_family_table.json

Every program: bf16, prompt 256, gen 256, the family's own decoding defaults (`SamplingParams.for_model`;
block diffusion for block-causal models). Rows are appended to the JSON as they finish, so a run
can be resumed: cells already in the JSON are skipped (`--redo` compiles them again).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGSHIPS = ("llada-8b", "llada-moe-7b-a1b", "llada2-mini", "llada2-flash", "dream-7b", "sdar-8b",
             "sdar-30b-a3b", "fast-dllm-v2-7b")
# smallest first; the ladder stops at the first topology that fits
LADDERS = {
    "v5e": ("v5e:1x1", "v5e:2x2", "v5e:2x4", "v5e:4x4", "v5e:4x8"),
    "v6e": ("v6e:1x1", "v6e:2x2", "v6e:2x4", "v6e:4x4"),
    "v5p": ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4"),
    "v7x": ("v7x:2x2x1", "v7x:2x2x2"),
}
BATCHES = (16, 64)
GiB = 2**30


def _sampling(cfg):
    from dinfer_jax.engine import SamplingParams
    over = {"gen_length": 256}
    if cfg.attention_mask == "block_causal":
        over["cache"] = "block"
    return SamplingParams.for_model(cfg, **over)


def cell(name: str, gen: str) -> dict:
    """The smallest fitting topology of `gen`'s ladder for preset `name`, its mesh, GiB per chip at
    batch 1 / 16 / 64 and the floor tokens/s at TPF 1."""
    from dinfer_jax import plan
    from dinfer_jax.families import preset
    cfg = preset(name)
    kw = dict(prompt_len=256, sampling=_sampling(cfg))
    tried = []
    t0 = time.perf_counter()
    for topo_name in LADDERS[gen]:
        out = plan.plan(cfg, topo_name, None, find_batch=False, every_mesh=False, batch=1, **kw)
        if not out.get("fits"):
            tried.append({"topology": topo_name, "reason": out.get("reason")})
            continue
        row = {"preset": name, "gen": gen, "topology": topo_name, "device_kind": out["device_kind"],
               "chips": out["chips"], "devices": out["devices"], "mesh": out["mesh"], "hbm_bytes": out["hbm_bytes"],
               "per_batch": {1: {"total": out["per_chip_bytes"]["total"], "fits": True,
                                 "tokens_per_s": out["predicted"]["tokens_per_s"]}},
               "audits": out["audits"], "tried": tried}
        topo = plan.get_topology(topo_name)
        for b in BATCHES:
            try:
                p = plan.compile_plan(cfg, topo, out["mesh"], batch=b, **kw)
                row["per_batch"][b] = {"total": p.main.total, "fits": p.fits,
                                       "tokens_per_s": p.predicted()["tokens_per_s"]}
            except plan.DoesNotFit as e:
                row["per_batch"][b] = {"total": None, "fits": False, "reason": str(e)[:300]}
            except plan.PlanError as e:  # the batch does not divide the mesh's data axis
                row["per_batch"][b] = {"total": None, "fits": None, "reason": str(e)[:300]}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        return row
    return {"preset": name, "gen": gen, "topology": None, "tried": tried, "seconds": round(time.perf_counter() - t0, 1)}


def table(rows: list[dict]) -> str:
    """Markdown: one line per preset x generation."""
    def gib(r, b):
        x = r["per_batch"].get(str(b), r["per_batch"].get(b))
        if x is None:
            return "-"
        if x["total"] is None:
            return "does not fit" if x["fits"] is False else "n/a"
        return f"{x['total'] / GiB:.2f}" + ("" if x["fits"] else " (over)")
    out = ["| preset | generation | smallest topology that fits (batch 1) | mesh | GiB per chip at batch 1 / 16 / 64 "
           "(of HBM) | floor tok/s at TPF 1, batch 1 / 16 / 64 | KV-cache copies in the loop, batch 1 (MiB) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["topology"] is None:
            last = r["tried"][-1] if r["tried"] else {"topology": "-", "reason": ""}
            out.append(f"| {r['preset']} | {r['gen']} | none up to {last['topology']} | - | - | - | - |")
            continue
        m = r["mesh"]
        pb = lambda b: r["per_batch"].get(str(b), r["per_batch"].get(b)) or {}
        tps = " / ".join(str(pb(b).get("tokens_per_s") or "-") for b in (1, *BATCHES))
        out.append(f"| {r['preset']} | {r['gen']} | {r['topology']} ({r['devices']} devices) | data={m['data']},"
                   f"expert={m['expert']},model={m['model']} | {' / '.join(gib(r, b) for b in (1, *BATCHES))} "
                   f"({r['hbm_bytes'] / GiB:.0f}) | {tps} | {r['audits']['kv_copies_in_loop']} "
                   f"({r['audits']['kv_copy_bytes'] / 2**20:.0f}) |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", default=list(FLAGSHIPS))
    ap.add_argument("--gens", nargs="+", default=list(LADDERS), choices=list(LADDERS))
    ap.add_argument("--json", default="bench/tpu_family_table.json")
    ap.add_argument("--redo", action="store_true", help="compile cells already in --json again")
    ap.add_argument("--table", nargs="+", default=None, help="print the markdown table of these JSON files, exit")
    a = ap.parse_args(argv)
    if a.table:
        rows = [r for path in a.table for r in json.load(open(path))]
        order = {(p, g): i for i, (p, g) in enumerate((p, g) for p in FLAGSHIPS for g in LADDERS)}
        print(table(sorted(rows, key=lambda r: order.get((r["preset"], r["gen"]), 1e9))))
        return
    import jax
    jax.config.update("jax_platforms", "cpu")
    rows = json.load(open(a.json)) if os.path.exists(a.json) else []
    done = {(r["preset"], r["gen"]) for r in rows}
    for gen in a.gens:  # generation-major: a partial run covers every preset on the first generations
        for name in a.only:
            if (name, gen) in done and not a.redo:
                continue
            rows = [r for r in rows if (r["preset"], r["gen"]) != (name, gen)]
            r = cell(name, gen)
            rows.append(r)
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
            print(json.dumps({k: r.get(k) for k in ("preset", "gen", "topology", "mesh", "seconds")}), flush=True)


if __name__ == "__main__":
    main()
