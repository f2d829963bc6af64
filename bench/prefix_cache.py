"""Prompt prefix cache (decoding/prefix_cache.py) on vs off, on the block-diffusion demo model.

N requests share a system prompt of S tokens (random ids from the demo vocabulary, as a long shared
instruction would) followed by a demo task prompt. They go through one continuous batch
(RunningBatch, `--batch` slots) in groups of `--batch` as the server admits them: admit, decode to
the end, next group. With the cache, each round starts empty, so the first group misses and the
rest reuse the system prompt's blocks. Reported: median admission time (the prefill) and median
end-to-end time per round, cache on / off alternated in one run, and whether every answer is
identical with and without the cache.

  python bench/prefix_cache.py [--system 128 384] [--n 16] [--batch 4] [--rounds 5] [--json bench/prefix_cache.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np


def run(system_lens=(128, 384), n: int = 16, batch: int = 4, rounds: int = 5, seed: int = 0) -> dict:
    from dinfer_jax import load_model
    from dinfer_jax import tasks as T
    from dinfer_jax.checkpoint import DEMO_BLOCK_MODEL_DIR
    from dinfer_jax.decoding.prefix_cache import PrefixCache
    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.tokenizer import load_tokenizer
    model, tok = load_model(DEMO_BLOCK_MODEL_DIR), load_tokenizer(DEMO_BLOCK_MODEL_DIR)
    cfg = model.config
    sp = SamplingParams(gen_length=16, block_length=cfg.block_size, cache="block", threshold=0.7)
    gen = model.generator
    rng = np.random.default_rng(seed)
    special = {cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id}
    vocab = np.array([t for t in range(cfg.vocab_size) if t not in special])
    out = {"model": "demo_block_model", "batch": batch, "n": n, "rounds": rounds, "settings": dict(gen_length=16, block_length=cfg.block_size, cache="block", threshold=0.7),
           "rows": []}
    for S in system_lens:
        system = rng.choice(vocab, S).tolist()
        prompts = [np.asarray(system + tok.encode(p["prompt"]), np.int32) for p in T.sample(n, seed=seed + 1)]

        cache_on, cache_off = PrefixCache(256 << 20), PrefixCache(0)

        def one_round(on: bool):
            cache_on.clear()  # each round starts empty (the pool stays allocated, as in a server)
            gen.prefix_cache = cache_on if on else cache_off
            rb = gen.running_batch(sp, batch, max(map(len, prompts)))
            admit_s, answers = [], {}
            t0 = time.perf_counter()
            for g in range(0, n, batch):
                t = time.perf_counter()
                rb.admit([(i, prompts[i], sp) for i in range(g, min(n, g + batch))])
                jax.block_until_ready(rb.state.kv)
                admit_s.append(time.perf_counter() - t)
                while rb.running:
                    for r in rb.step(8):
                        answers[r.tag] = r.token_ids
            return time.perf_counter() - t0, statistics.median(admit_s), answers, gen.prefix_cache.snapshot()

        one_round(True), one_round(False)  # compile every program both paths use
        on_t, off_t, on_a, off_a = [], [], [], []
        stats = None
        for _ in range(rounds):  # alternate on / off
            t, a, ans_on, stats = one_round(True)
            on_t.append(t), on_a.append(a)
            t, a, ans_off, _ = one_round(False)
            off_t.append(t), off_a.append(a)
        row = dict(system_tokens=S, prompt_tokens=int(np.median([len(p) for p in prompts])),
                   admit_ms_off=1e3 * statistics.median(off_a), admit_ms_on=1e3 * statistics.median(on_a),
                   round_s_off=statistics.median(off_t), round_s_on=statistics.median(on_t),
                   hit_rate=stats["hit_rate"], prefill_tokens_on=stats["prefill_tokens"],
                   prefill_tokens_off=stats["prefill_tokens_full"], identical=ans_on == ans_off,
                   spread_round_s_on=[min(on_t), max(on_t)], spread_round_s_off=[min(off_t), max(off_t)])
        row["admit_speedup"] = row["admit_ms_off"] / row["admit_ms_on"]
        row["round_speedup"] = row["round_s_off"] / row["round_s_on"]
        out["rows"].append(row)
        print(f"system {S}: admit {row['admit_ms_off']:.1f} -> {row['admit_ms_on']:.1f} ms "
              f"({row['admit_speedup']:.2f}x), round {row['round_s_off']:.3f} -> {row['round_s_on']:.3f} s "
              f"({row['round_speedup']:.2f}x), hit rate {row['hit_rate']:.2f}, prefill tokens "
              f"{row['prefill_tokens_off']} -> {row['prefill_tokens_on']}, identical {row['identical']}", flush=True)
    gen.prefix_cache = PrefixCache(0)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", type=int, nargs="+", default=[128, 384])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    out = run(tuple(a.system), a.n, a.batch, a.rounds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0 if all(r["identical"] for r in out["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
