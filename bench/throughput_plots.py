"""Tokens/s of the built-in demo model vs batch size and vs strategy (fp32, CPU), as PNG plots.

  python bench/throughput_plots.py --out bench/throughput        # -> .json, _vs_batch.png, _vs_strategy.png
  python bench/throughput_plots.py --tiny --out /tmp/tp           # two batch sizes, two strategies

Prompts are fresh demo-task problems (dinfer_jax/tasks.py, seed 777), so confidences, tokens per
forward and early stop are those of a trained model. Each setting is compiled by an untimed call,
then the same batch is generated --repeats times; medians. tokens/s = generated non-EOS tokens /
wall seconds of the jitted call (results blocked until ready); generation 16 tokens, block 16.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(model, tok, batch: int, strategy: str, cache: str, repeats: int) -> dict:
    from dinfer_jax import tasks as T
    from dinfer_jax.engine import generate
    from dinfer_jax.evaluate import sampling_params
    cfg = model.config
    probs = T.sample(batch, seed=777)
    prompts = [np.asarray(p, np.int32) for p in tok.encode_batch([p["prompt"] for p in probs])]
    sp = sampling_params(strategy, cache, 16, 16)
    generate(model, prompts, sp)  # compile
    secs, toks, correct = [], 0, 0
    for _ in range(repeats):
        t = time.perf_counter()
        r = generate(model, prompts, sp)
        secs.append(time.perf_counter() - t)
    toks = int(np.sum((r.raw_ids != cfg.eos_token_id) & (r.raw_ids != cfg.mask_token_id)))
    correct = sum(tok.decode(ids) == p["answer"] for ids, p in zip(r.token_ids, probs))
    s = statistics.median(secs)
    return {"batch": batch, "strategy": strategy, "cache": cache, "seconds": s, "tokens": toks,
            "tokens_per_s": toks / s, "nfe": float(np.mean(r.nfe)), "tpf": float(np.mean(r.tpf)),
            "accuracy": correct / batch}


def plot(rows: list[dict], x: str, series: str, path: str, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    if x == "batch":
        for key in sorted({r[series] for r in rows}):
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows if r[series] == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
    else:
        names = list(dict.fromkeys(r["strategy"] for r in rows))
        caches = list(dict.fromkeys(r["cache"] for r in rows))
        w = 0.8 / len(caches)
        for j, c in enumerate(caches):
            vals = [next((r["tokens_per_s"] for r in rows if r["strategy"] == n and r["cache"] == c), 0) for n in names]
            ax.bar(np.arange(len(names)) + j * w, vals, w, label=f"cache {c}")
        ax.set_xticks(np.arange(len(names)) + w * (len(caches) - 1) / 2, names)
        ax.set_xlabel("strategy")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="path prefix of the .json and the two .png files")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--strategy-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="batches 1,4; strategies fixed, threshold; 2 repeats")
    a = ap.parse_args(argv)
    import jax
    from dinfer_jax import load_model
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    from dinfer_jax.tokenizer import load_tokenizer

    model = load_model(DEMO_MODEL_DIR)
    tok = load_tokenizer(DEMO_MODEL_DIR)
    batches = [1, 4] if a.tiny else [int(b) for b in a.batches.split(",")]
    strategies = ["fixed", "threshold"] if a.tiny else ["fixed", "threshold", "factor", "credit", "hierarchy"]
    repeats = 2 if a.tiny else a.repeats
    rows = []
    for strategy in ("fixed", "threshold"):
        for b in batches:
            rows.append(measure(model, tok, b, strategy, "dual", repeats))
            print(json.dumps(rows[-1]), flush=True)
    sb = 4 if a.tiny else a.strategy_batch
    by_strategy = []
    for strategy in strategies:
        for cache in ("dual", "none"):
            hit = next((r for r in rows if (r["batch"], r["strategy"], r["cache"]) == (sb, strategy, cache)), None)
            by_strategy.append(hit or measure(model, tok, sb, strategy, cache, repeats))
            if hit is None:
                print(json.dumps(by_strategy[-1]), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "backend": jax.default_backend(),
            "command": " ".join(sys.argv), "model": "built-in demo model (fp32)", "gen_length": 16,
            "block_length": 16}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "vs_batch": rows, "vs_strategy": by_strategy}, f, indent=1)
    plot(rows, "batch", "strategy", a.out + "_vs_batch.png", "demo model, dual cache: tokens/s vs batch")
    plot(by_strategy, "strategy", "cache", a.out + "_vs_strategy.png", f"demo model, batch {sb}: tokens/s by strategy")
    print("\n| batch | strategy | cache | s / batch | tokens/s | forwards | tokens/forward | exact match |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows + [r for r in by_strategy if r not in rows]:
        print(f"| {r['batch']} | {r['strategy']} | {r['cache']} | {r['seconds']:.4f} | {r['tokens_per_s']:.0f} | "
              f"{r['nfe']:.1f} | {r['tpf']:.2f} | {r['accuracy']:.2f} |")
    return rows, by_strategy


if __name__ == "__main__":
    main()
