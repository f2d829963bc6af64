"""Issue 33 (continuous slower than static under load): rows/s of the continuous loop itself
(decoding/segments.RunningBatch, no server) by batch slots B and rows admitted per segment, beside
static batches of 16 -- whether the gap comes from the segment mechanics or from occupancy.

  python bench/continuous_occupancy.py [--rows 300] [--out bench/continuous_occupancy.json]

The demo model at its defaults (one block of 16 per request: one or two forwards). Each
configuration: a RunningBatch of B slots; before every segment (at most 8 iterations; it ends as
soon as a row finishes) up to A waiting prompts are admitted into free slots, as a server does when
A requests arrived since the last segment; rows/s over `--rows` finished rows, after the programs
are compiled (warm_segment_programs). Static: `generate` on batches of 16 prompts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dinfer_jax import load_model  # noqa: E402
from dinfer_jax.checkpoint import DEMO_MODEL_DIR  # noqa: E402
from dinfer_jax.engine import SamplingParams, generate  # noqa: E402
from dinfer_jax.tasks import sample  # noqa: E402
from dinfer_jax.tokenizer import load_tokenizer  # noqa: E402


def continuous(model, params, prompts, batch: int, admit: int, rows: int) -> dict:
    rb = model.generator.running_batch(params, batch, 32)
    model.generator.warm_segment_programs(rb.spec, rb.gen_start, batch)
    t_admit = t_step = 0.0
    segments = done = k = 0
    t0 = time.perf_counter()
    while done < rows:
        n = min(len(rb.free), admit, len(prompts) - k)
        if n:
            t = time.perf_counter()
            rb.admit([(k + i, prompts[k + i], params) for i in range(n)])
            jax.block_until_ready(rb.state)
            t_admit += time.perf_counter() - t
            k += n
        t = time.perf_counter()
        done += len(rb.step(8))
        t_step += time.perf_counter() - t
        segments += 1
    total = time.perf_counter() - t0
    return {"batch": batch, "admit_per_segment": admit, "rows": done, "rows_per_s": round(done / total, 1),
            "segments": segments, "admit_s": round(t_admit, 3), "segment_s": round(t_step, 3),
            "ms_per_segment": round(1e3 * t_step / segments, 2)}


def static(model, params, prompts, rows: int) -> dict:
    generate(model, prompts[:16], params)  # compile
    t0 = time.perf_counter()
    n = 0
    while n < rows:
        generate(model, prompts[n:n + 16], params)
        n += 16
    total = time.perf_counter() - t0
    return {"batch": 16, "rows": n, "rows_per_s": round(n / total, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model, tok = load_model(DEMO_MODEL_DIR), load_tokenizer(DEMO_MODEL_DIR)
    params = SamplingParams.for_model(model.config, DEMO_MODEL_DIR)
    prompts = [np.asarray(tok.encode(s["prompt"]), np.int32) for s in sample(2 * a.rows + 64, seed=1)]
    rows = []
    for batch, admit in ((16, 16), (16, 8), (16, 2), (4, 4), (4, 2)):
        r = continuous(model, params, prompts, batch, admit, a.rows)
        rows.append(r)
        print(f"| continuous | {batch} | {admit} | {r['rows_per_s']} | {r['segments']} | {r['ms_per_segment']} |",
              flush=True)
    s = static(model, params, prompts, a.rows)
    print(f"| static | 16 | 16 (whole batches) | {s['rows_per_s']} | - | - |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"continuous": rows, "static": s, "jax": jax.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
