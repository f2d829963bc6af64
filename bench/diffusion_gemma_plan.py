"""DiffusionGemma-26B-A4B compiled for TPU topologies (libtpu compile-only, no TPU needed): per-chip
bytes of the whole generate program and whether it fits, one row per (topology, mesh, batch).

  python bench/diffusion_gemma_plan.py [--layers N] [--out bench/results/diffusion_gemma_plan.json] \
      [--rows v6e:2x2/expert=4/1 ...]

--layers N compiles the preset cut to N layers (a quicker look at the per-layer shapes; the bytes are
then not the full model's). Each row is `dinfer_jax.families.diffusion_gemma_plan.compile_plan`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROWS = ["v6e:2x2/data=1,expert=4,model=1/1", "v5e:2x4/data=1,expert=8,model=1/1"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rows", nargs="*", default=ROWS, help="TOPOLOGY/MESH/BATCH")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from dinfer_jax.families import diffusion_gemma as dg
    from dinfer_jax.families import diffusion_gemma_plan as dgp
    hf = json.loads(json.dumps(dg.PRESETS["diffusion-gemma-26b-a4b"]))
    if a.layers:
        hf["text_config"]["num_hidden_layers"] = a.layers
    cfg, canvas = dg.config_from_hf(hf)
    results = []
    for row in a.rows:
        topo, mesh, batch = row.split("/")
        t = time.perf_counter()
        try:
            out = dgp.compile_plan(cfg, canvas, topo, mesh, batch=int(batch), prompt_len=a.prompt_len,
                                   max_new_tokens=a.gen_length)
        except Exception as e:  # a row that does not compile is a result too
            out = {"compiled": False, "topology": topo, "mesh": mesh, "batch": int(batch),
                   "reason": " ".join(str(e).split())[:500]}
        out["layers"] = cfg.num_layers
        out["wall_seconds"] = round(time.perf_counter() - t, 1)
        results.append(out)
        b = out.get("per_chip_bytes", {})
        print(json.dumps({k: out.get(k) for k in ("topology", "mesh", "batch", "layers", "compiled", "fits",
                                                   "compile_seconds", "reason")}
                         | {k: round(v / 2**30, 2) for k, v in b.items()}), flush=True)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
