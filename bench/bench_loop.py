"""Denoising-loop overhead and tokens/s per strategy x cache (fp32, CPU).

  python bench/bench_loop.py [--configs tiny small] [--repeats 5] [--out bench/loop_results.json]
  python bench/bench_loop.py --block [--block-configs tiny-block small-block]   # block diffusion rows too

Overhead ratio = seconds of one whole jitted generation / (its full forwards x seconds of one bare
jitted full forward + its window forwards x seconds of one bare jitted window forward), medians.
The bare forwards are the same module calls the loop makes (same shapes, logits for the block
only; for the prefix cache, the mean over the blocks' window lengths). Weights are random with the LM head scaled x40 so threshold strategies unmask several
tokens per forward (as in tests/test_engine.py); tokens/s counts generated non-EOS tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import SamplingParams, preset
from dinfer_jax.engine import Generator
from dinfer_jax.model import Model
from dinfer_jax.models import init_params

CONFIGS = {
    "tiny": dict(preset="tiny", batch=2, prompt=24, gen=32, block=8),
    "small": dict(preset="tiny", batch=2, prompt=32, gen=32, block=16,
                  overrides=dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                                 intermediate_size=256, num_experts=16, num_experts_per_tok=4, vocab_size=2048,
                                 mask_token_id=2047, eos_token_id=2046, pad_token_id=2046)),
}


# Block diffusion (cache="block") on LLaDA2-shaped models (block-causal, sigmoid group router, shared expert).
BLOCK_CONFIGS = {
    "tiny-block": dict(preset="tiny-llada2", batch=2, prompt=24, gen=32, block=8),
    "small-block": dict(preset="tiny-llada2", batch=2, prompt=32, gen=64, block=16,
                        overrides=dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                                       rotary_dim=16, intermediate_size=128, dense_intermediate_size=512,
                                       num_experts=16, num_experts_per_tok=4, vocab_size=2048,
                                       mask_token_id=2047, eos_token_id=2046, pad_token_id=2046)),
}


def build(name):
    c = {**CONFIGS, **BLOCK_CONFIGS}[name]
    cfg = preset(c["preset"]).replace(**c.get("overrides", {}))
    params = init_params(cfg, seed=0)
    params["lm_head"]["unembedding"] = params["lm_head"]["unembedding"] * 40.0
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, cfg.vocab_size - 2, c["prompt"] - i).tolist() for i in range(c["batch"])]
    return Model(cfg, params), prompts, c


def median_time(fn, repeats, warmup=1):
    """Median wall seconds of fn() (results blocked until ready) after `warmup` untimed calls."""
    for _ in range(warmup):  # compile / warm up
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bare_forwards(model, gen, prompts, sp, repeats):
    """Median seconds of one full forward and one window forward at the loop's shapes."""
    prog, args, rows, spec, gen_start = gen._prepare(prompts, sp)
    params, canvas, pad = args[0], args[1], args[2]
    B, Lc = canvas.shape
    Bk = spec.block_length
    idx = jnp.arange(Lc)
    pos = jnp.maximum(idx[None] - pad[:, None], 0)
    km = (idx[None] >= pad[:, None]) & (idx[None] < gen_start + spec.gen_length)
    start = jnp.full((B,), gen_start, jnp.int32)
    m = model.module
    full = jax.jit(lambda p, x: m.apply({"params": p}, tokens_BS=x, positions_BS=pos, key_mask_BL=km,
                                        logits_window=(start, Bk)))
    t_full = median_time(lambda: full(params, canvas), repeats)
    _, kv = full(params, canvas)
    if spec.cache == "none":
        return t_full, 0.0
    if spec.cache == "dual":
        windows = [(start, Bk, 0)]
    elif spec.cache == "vicinity":
        windows = [(start - spec.prefix_look, Bk + spec.prefix_look + spec.after_look, spec.prefix_look)]
    else:  # prefix: block j's window runs to the end; average over blocks (exact for equal steps per block)
        windows = [(start + j * Bk, Lc - gen_start - j * Bk, 0) for j in range(spec.num_blocks)]
    times = []
    for ws, size, off in windows:
        win = jax.jit(lambda p, x, ws=ws, size=size, off=off: m.apply(
            {"params": p}, tokens_BS=jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, size))(x, ws),
            positions_BS=jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, size))(pos, ws), key_mask_BL=km,
            kv=kv, window_start=ws, logits_window=(jnp.full((B,), off, jnp.int32), Bk)))
        times.append(median_time(lambda: win(params, canvas), repeats))
    return t_full, statistics.mean(times)


def block_row(name, repeats):
    """Overhead of the block-diffusion loop: generation seconds / (one prefill + its B-token window
    forwards + its 2B-token commit forwards, each timed bare at the loop's shapes), medians."""
    model, prompts, c = build(name)
    gen = Generator(model)
    sp = SamplingParams(gen_length=c["gen"], block_length=c["block"], cache="block", threshold=0.35)
    gen.generate(prompts, sp)  # compile
    secs = median_time(lambda: gen.generate(prompts, sp).raw_ids, repeats)
    prog, args, rows, spec, gen_start = gen._prepare(prompts, sp)
    _, stats = prog(*args)  # donates the canvas: prepare again below
    prog, args, rows, spec, gen_start = gen._prepare(prompts, sp)
    res = gen.generate(prompts, sp)
    n_commit, n_window = int(stats["nfe_commit"]), int(stats["nfe_window"]) - int(stats["nfe_commit"])
    params, canvas, pad = args[0], args[1], args[2]
    B, Lc = canvas.shape
    Bk = spec.block_length
    idx = jnp.arange(Lc)
    pos = jnp.maximum(idx[None] - pad[:, None], 0)
    km = (idx[None] >= pad[:, None]) & (idx[None] < gen_start + spec.gen_length + Bk)
    m = model.module.clone(attention_block=Bk)
    zero = jnp.zeros((B,), jnp.int32)
    pre = jax.jit(lambda p, x: m.apply({"params": p}, tokens_BS=x[:, :gen_start], positions_BS=pos[:, :gen_start],
                                       key_mask_BL=km[:, :gen_start], logits_window=(zero, 1)))
    t_pre = median_time(lambda: pre(params, canvas), repeats)
    _, kvp = pre(params, canvas)
    kv = tuple(jnp.zeros((model.config.num_layers, B, Lc) + t.shape[3:], t.dtype).at[:, :, :gen_start].set(t)
               for t in kvp)
    start = jnp.full((B,), gen_start, jnp.int32)

    def win(size, back):
        f = jax.jit(lambda p, x: m.apply(
            {"params": p}, tokens_BS=jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, size))(x, start - back),
            positions_BS=jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, size))(pos, start - back),
            key_mask_BL=km, kv=kv, window_start=start - back, key_positions_BL=pos,
            logits_window=(jnp.full((B,), back, jnp.int32), Bk)))
        return median_time(lambda: f(params, canvas), repeats)
    t_win, t_commit = win(Bk, 0), win(2 * Bk, Bk)
    bare = t_pre + n_window * t_win + n_commit * t_commit
    tokens = int(np.sum(res.raw_ids != model.config.eos_token_id))
    return dict(config=name, batch=len(prompts), gen=c["gen"], block=c["block"], strategy="threshold", cache="block",
                seconds=round(secs, 4), tokens_per_s=round(tokens / secs, 1), tpf=round(float(np.mean(res.tpf)), 2),
                nfe_full=0, nfe_window=n_window + n_commit, nfe_commit=n_commit, prefill_ms=round(t_pre * 1e3, 2),
                window_fwd_ms=round(t_win * 1e3, 2), commit_fwd_ms=round(t_commit * 1e3, 2),
                full_fwd_ms=None, overhead=round(secs / bare, 3))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=["tiny", "small"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--strategies", nargs="+", default=["fixed", "threshold", "factor", "credit", "hierarchy"])
    ap.add_argument("--caches", nargs="+", default=["none", "prefix", "dual", "vicinity"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--block", action="store_true", help="also the block-diffusion rows (--block-configs)")
    ap.add_argument("--block-configs", nargs="+", default=list(BLOCK_CONFIGS))
    a = ap.parse_args()
    rows = []
    if a.block:
        for name in a.block_configs:
            rows.append(block_row(name, a.repeats))
            print(json.dumps(rows[-1]), flush=True)
    print(f"jax {jax.__version__} on {jax.default_backend()}, {jax.device_count()} device(s)")
    for name in a.configs:
        model, prompts, c = build(name)
        gen = Generator(model)
        for strategy in a.strategies:
            for cache in a.caches:
                sp = SamplingParams(gen_length=c["gen"], block_length=c["block"], strategy=strategy, cache=cache,
                                    threshold=0.35, low_threshold=0.3, factor=2.0, steps=c["gen"],
                                    prefix_look=4, after_look=4, warmup_steps=1)
                res = gen.generate(prompts, sp)  # compile
                secs = median_time(lambda: gen.generate(prompts, sp).raw_ids, a.repeats)
                res = gen.generate(prompts, sp)
                t_full, t_win = bare_forwards(model, gen, prompts, sp, a.repeats)
                bare = res.batch_nfe_full * t_full + res.batch_nfe_window * t_win
                tokens = int(np.sum(res.raw_ids != model.config.eos_token_id))
                row = dict(config=name, batch=len(prompts), gen=c["gen"], block=c["block"], strategy=strategy,
                           cache=cache, seconds=round(secs, 4), tokens_per_s=round(tokens / secs, 1),
                           tpf=round(float(np.mean(res.tpf)), 2), nfe_full=res.batch_nfe_full,
                           nfe_window=res.batch_nfe_window, full_fwd_ms=round(t_full * 1e3, 2),
                           window_fwd_ms=round(t_win * 1e3, 2), overhead=round(secs / bare, 3))
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| config | strategy | cache | tok/s | TPF | NFE full+window | overhead |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['strategy']} | {r['cache']} | {r['tokens_per_s']} | {r['tpf']} | "
              f"{r['nfe_full']}+{r['nfe_window']} | {r['overhead']} |")


if __name__ == "__main__":
    main()
