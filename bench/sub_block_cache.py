"""Fast-dLLM v2's sub-block DualCache (SamplingParams.sub_block_cache) on vs off, on CPU.

A random model of Fast-dLLM v2's kind (Qwen2 block: q/k/v biases, GQA, shifted logits, block-causal
attention) scaled down (`--layers`, `--dim`), block 32, sub-blocks of 8, threshold 0.9, greedy,
ignore_eos (every generated token decoded). A random model is flat, so each step commits one token:
most steps of a sub-block are sub-block forwards (9 query rows instead of 33), the shape the cache is
for. Reported per setting: forwards, sub-block forwards, median wall time of `--repeats` runs after a
compile run (on / off alternated), and how many generated tokens differ from the exact path (sub_block_cache=False).

  python bench/sub_block_cache.py [--prompt 512] [--gen 64] [--batch 1] [--layers 4] [--dim 1024]
                                  [--repeats 5] [--json bench/sub_block_cache.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np


def run(prompt: int = 512, gen: int = 64, batch: int = 1, layers: int = 4, dim: int = 1024, repeats: int = 5) -> dict:
    from dinfer_jax.families import preset
    from dinfer_jax.engine import SamplingParams, generate
    from dinfer_jax.model import Model
    from dinfer_jax.models import init_params
    base = preset("fast-dllm-v2-7b")
    heads = dim // 64
    cfg = base.replace(vocab_size=4096, hidden_size=dim, num_layers=layers, num_heads=heads,
                       num_kv_heads=max(1, heads // 4), head_dim=64, intermediate_size=4 * dim,
                       mask_token_id=4095, eos_token_id=4094, pad_token_id=4093, eot_token_id=None)
    model = Model(cfg, init_params(cfg, 0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 4000, prompt).tolist() for _ in range(batch)]
    out = dict(model=f"random fast_dllm_v2 D{dim} L{layers} N{heads}/{cfg.num_kv_heads} V4096",
               prompt=prompt, gen=gen, batch=batch, platform=jax.default_backend(), rows=[])
    sps = {cache: SamplingParams(gen_length=gen, block_length=32, cache="block", sub_block_length=8, threshold=0.9,
                                 ignore_eos=True, sub_block_cache=cache) for cache in (False, True)}
    res = {cache: generate(model, prompts, sp) for cache, sp in sps.items()}  # compile both
    times = {False: [], True: []}
    for _ in range(repeats):  # alternated, so load changes on a shared machine hit both alike
        for cache, sp in sps.items():
            t = time.perf_counter()
            res[cache] = generate(model, prompts, sp)
            times[cache].append(time.perf_counter() - t)
    for cache, r in res.items():
        out["rows"].append(dict(sub_block_cache=cache, nfe=r.nfe, sub_block_forwards=r.sub_block_forwards,
                                seconds_median=statistics.median(times[cache]), seconds=times[cache]))
    tokens = {cache: r.token_ids for cache, r in res.items()}
    out["tokens_differing"] = [sum(a != b for a, b in zip(x, y)) for x, y in zip(tokens[True], tokens[False])]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = run(a.prompt, a.gen, a.batch, a.layers, a.dim, a.repeats)
    print("| sub_block_cache | forwards | sub-block forwards | median s |")
    print("|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['sub_block_cache']} | {sum(r['nfe'])} | {sum(r['sub_block_forwards'] or [0])} | "
              f"{r['seconds_median']:.3f} |")
    print(f"generated tokens differing from the exact path: {res['tokens_differing']} of {a.gen}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
