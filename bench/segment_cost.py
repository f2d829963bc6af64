"""Cost of a continuous-batching segment boundary (decoding/segments.py), to pick the segment length.

One batch of prompts is decoded (a) by the one-shot program (`generate`, one jitted while_loop)
and (b) by a RunningBatch stepped in segments of n iterations (n = 1, 2, 4, 8, 16), which returns
to the host after every segment (dispatch + one read of the `done` flags). Both after compile;
medians of --repeats. Boundary cost = (T_n - T_fewest) / (segments_n - segments_fewest): the same
segment programs, compared with the run that returns to the host least often.

  python bench/segment_cost.py [--batch 8] [--repeats 5] [--json bench/segment_cost.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def run(model, tok, batch: int, repeats: int, settings: dict, lengths=(1, 2, 4, 8, 16)) -> dict:
    from dinfer_jax import tasks as T
    from dinfer_jax.engine import SamplingParams, generate
    probs = T.sample(batch, seed=3)
    prompts = [np.asarray(tok.encode(p["prompt"]), np.int32) for p in probs]
    sp = SamplingParams(**settings)
    generate(model, prompts, sp)  # compile

    def one_shot():
        t = time.perf_counter()
        r = generate(model, prompts, sp)
        return time.perf_counter() - t, max(r.nfe)

    def segmented(n):
        rb = model.generator.running_batch(sp, batch, max(len(p) for p in prompts))
        t = time.perf_counter()
        rb.admit([(i, p, sp) for i, p in enumerate(prompts)])
        done = 0
        while done < len(prompts):
            done += len(rb.step(n))
        return time.perf_counter() - t, rb.segments

    base = [one_shot() for _ in range(repeats)]
    t0 = statistics.median(t for t, _ in base)
    out = {"settings": settings, "batch": batch, "one_shot_s": t0, "iterations": base[0][1], "segments": {}}
    for n in lengths:
        segmented(n)  # compile
        runs = [segmented(n) for _ in range(repeats)]
        out["segments"][n] = {"seconds": statistics.median(t for t, _ in runs), "segments": runs[0][1]}
    # boundary cost against the run with the fewest segments (same programs, fewer host returns)
    ref = min(out["segments"].values(), key=lambda r: r["segments"])
    for r in out["segments"].values():
        r["ratio_vs_one_shot"] = r["seconds"] / t0
        extra = r["segments"] - ref["segments"]
        r["boundary_ms"] = 1e3 * (r["seconds"] - ref["seconds"]) / extra if extra else None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from dinfer_jax import load_model
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    from dinfer_jax.tokenizer import load_tokenizer
    model, tok = load_model(DEMO_MODEL_DIR), load_tokenizer(DEMO_MODEL_DIR)
    rows = []
    for settings in (dict(gen_length=64, block_length=16, strategy="fixed", steps=64, cache="dual"),
                     dict(gen_length=64, block_length=16, strategy="fixed", steps=64, cache="dual", early_stop=False)):
        r = run(model, tok, a.batch, a.repeats, settings)
        rows.append(r)
        print(f"{settings}: one-shot {1e3 * r['one_shot_s']:.1f} ms ({r['iterations']} iterations)")
        for n, s in r["segments"].items():
            bms = "" if s["boundary_ms"] is None else f", {s['boundary_ms']:.2f} ms per extra boundary"
            print(f"  segment {n:>2}: {1e3 * s['seconds']:.1f} ms, {s['segments']} segments, "
                  f"vs one-shot {s['ratio_vs_one_shot']:.3f}{bms}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "python": sys.version.split()[0]}, f, indent=1)


if __name__ == "__main__":
    main()
