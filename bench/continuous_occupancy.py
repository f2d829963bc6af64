"""Issue 33 (continuous slower than static under load): rows/s of the continuous loop itself
(decoding/segments.RunningBatch, no server) by batch slots B and rows admitted per segment, beside
static batches of 16 -- whether the gap comes from the segment mechanics or from occupancy.

  python bench/continuous_occupancy.py [--rows 300] [--out bench/continuous_occupancy.json]

The demo model at its defaults (one block of 16 per request: one or two forwards). Each
configuration: a RunningBatch of B slots; before every segment (at most 8 iterations; it ends as
soon as a row finishes) up to A waiting prompts are admitted into free slots, as a server does when
A requests arrived since the last segment; rows/s over `--rows` finished rows, after the programs
are compiled (warm_segment_programs). Static: `generate` on batches of 16 prompts. "+ repack": the
server's rule between segments (continuous.repack_size): the rows move into a batch of the
power-of-two size covering them and the next admissions when that halves the slots (every size and
its row mover compiled first, as the server does on its compile thread). Arrivals beyond a batch's
free slots wait for the next segment (the server would open a second batch for them).
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
from dinfer_jax.serving.continuous import repack_size  # noqa: E402
from dinfer_jax.decoding.segments import RunningBatch, abstract_state  # noqa: E402
from dinfer_jax.engine import SamplingParams, generate  # noqa: E402
from dinfer_jax.tasks import sample  # noqa: E402
from dinfer_jax.tokenizer import load_tokenizer  # noqa: E402


def continuous(model, params, prompts, batch: int, admit: int, rows: int, repack: bool = False) -> dict:
    """repack: the scheduler's rule (continuous.repack_size) between segments: the rows move into a
    batch of the power-of-two size covering them and the next admissions, when that halves the slots."""
    gen = model.generator
    rb = gen.running_batch(params, batch, 32)
    sizes = [batch]
    while repack and sizes[-1] > 1:
        sizes.append(sizes[-1] // 2)
    states = {}
    for b in sizes:
        gen.warm_segment_programs(rb.spec, rb.gen_start, b)
        if repack:  # a state of this size: what the movers compile for
            tmp = RunningBatch(gen, rb.spec, rb.gen_start, b)
            tmp.admit([(0, prompts[0], params)])
            states[b] = abstract_state(tmp.state)
    for src in states:
        for dst in states:
            if src != dst:
                gen.warm_move_program(gen.move_key(rb.spec, rb.gen_start, src, dst, True), None, states[src])
    t_admit = t_step = 0.0
    segments = done = k = moves = 0
    t0 = time.perf_counter()
    while done < rows:
        queued = min(admit, len(prompts) - k)
        size = repack_size(rb.running, queued, [rb.B], batch) if repack else None
        if size is not None and size != rb.B:  # (arrivals beyond the free slots wait a segment; the server
            # would open a second batch for them)
            small = RunningBatch(gen, rb.spec, rb.gen_start, size)
            small.take_rows(rb, [b for b, t in enumerate(rb.slots) if t is not None])
            rb, moves = small, moves + 1
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
    return {"batch": batch, "admit_per_segment": admit, "repack": repack, "moves": moves, "rows": done,
            "rows_per_s": round(done / total, 1),
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
    for batch, admit, repack in ((16, 16, False), (16, 8, False), (16, 2, False), (16, 2, True), (4, 4, False),
                                 (4, 2, False)):
        r = continuous(model, params, prompts, batch, admit, a.rows, repack)
        rows.append(r)
        print(f"| continuous{' + repack' if repack else ''} | {batch} | {admit} | {r['rows_per_s']} | "
              f"{r['segments']} | {r['ms_per_segment']} |", flush=True)
    s = static(model, params, prompts, a.rows)
    print(f"| static | 16 | 16 (whole batches) | {s['rows_per_s']} | - | - |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"continuous": rows, "static": s, "jax": jax.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
