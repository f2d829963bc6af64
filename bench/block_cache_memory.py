"""Per-chip bytes of the block-diffusion generate program compiled for a TPU topology (libtpu
compile-only, no TPU): what the block loop's persisting windows cost in temporaries.

  python bench/block_cache_memory.py [--preset sdar-1.7b] [--topology v5e:1x1] [--batch 16]

Prints arguments / temp GiB per chip and the stacked KV cache's own size (layers, B, L, K*H) x 2.
docs/accelerators.md quotes it before and after the windows wrote into the carried cache in place.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="sdar-1.7b")
    ap.add_argument("--topology", default="v5e:1x1")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-length", type=int, default=256)
    a = ap.parse_args(argv)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    from dinfer_jax import plan
    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.families import preset
    cfg = preset(a.preset)
    p = SamplingParams.for_model(cfg, gen_length=a.gen_length, cache="block")
    t = time.perf_counter()
    pl = plan.compile_plan(cfg, plan.get_topology(a.topology), {"data": 1, "expert": 1, "model": 1},
                           batch=a.batch, prompt_len=a.prompt_len, sampling=p)
    out = pl.as_json()
    pc = out["per_chip_bytes"]
    canvas = out["canvas_length"]
    cache = 2 * cfg.num_layers * a.batch * canvas * cfg.num_kv_heads * cfg.head_dim * 2  # k and v, bf16
    print(f"{a.preset} on {a.topology}, batch {a.batch}, prompt {a.prompt_len}, gen {a.gen_length}: "
          f"arguments {pc['arguments'] / 2**30:.2f} GiB, temp {pc['temp'] / 2**30:.2f} GiB per chip; "
          f"the stacked KV cache {cache / 2**30:.2f} GiB (canvas {canvas}); compiled in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
