"""End-to-end generation at LLaDA-MoE-7B-A1B shapes on one device: random weights built on the device
(no checkpoint), the real decode loop (engine.Generator: one jitted while_loop per batch shape), and
the bytes/FLOPs floor of each forward from bench/roofline.py's counts and measured ceilings.

  python bench/gpu/e2e_bench.py                         # 7B-A1B, bf16, batch 1 4 16, prompt 256, gen 256, block 64
  python bench/gpu/e2e_bench.py --batches 1 --gen 128   # fewer / other shapes
  python bench/gpu/e2e_bench.py --tiny                  # tiny model on CPU, seconds (what the tests run)

Decoding: threshold 0.9, dual cache, block 64, temperature 0, early stop OFF (every row decodes all
gen positions, so the work does not hinge on when a random model happens to emit EOS).
Weights: dinfer_jax.models.init_params under jit on the default device (normal 0.02, norms 1), with
the LM head scaled by --head-scale (default x10): random weights give flat logits, and scaling the
head sharpens them so threshold decoding commits several tokens per forward (bench/bench_loop.py
does the same, x40 with a lower threshold). The tokens-per-forward this gives is a property of the
random weights, not of LLaDA-MoE: read forwards/s and measured/floor as the engine's numbers, and
TPF/tokens/s only for this setting.

Per batch: seconds of one generation (median of --repeats after a compile run), forwards (NFE: full
refreshes + window forwards the batch program ran), forwards/s, generated tokens/s, and the floor:
floor per forward = max(FLOPs / measured matmul peak, bytes / measured copy bandwidth) for one window
forward (q = block, keys over L) and one full refresh (q = kv = L); generation floor = full x NFE_full
+ window x NFE_window; measured / floor.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import roofline as rl  # noqa: E402
from dinfer_jax import SamplingParams, preset  # noqa: E402
from dinfer_jax.engine import Generator  # noqa: E402
from dinfer_jax.model import Model  # noqa: E402

# roofline window kind per cache. "block" (block diffusion, LLaDA2 / SDAR): a window of the block over
# the cached canvas, costed as a dual-cache window (an upper bound on its attention bytes: block-causal
# windows read only the blocks before them; weights dominate the bytes at these batches anyway).
CACHE_KIND = {"dual": "dual", "prefix": "prefix", "vicinity": "vicinity", "none": "full", "block": "dual"}


def tiny_config():
    return preset("tiny").replace(vocab_size=512, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                                  intermediate_size=64, num_experts=8, num_experts_per_tok=2, num_layers=2,
                                  mask_token_id=511, eos_token_id=510, pad_token_id=510)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llada-moe-7b-a1b")
    ap.add_argument("--layers", type=int, default=None, help="keep this many layers (default: all)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 4 16 (tiny: 1 4)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt length (default 256; tiny 24)")
    ap.add_argument("--gen", type=int, default=None, help="gen length (default 256; tiny 32)")
    ap.add_argument("--block", type=int, default=None, help="block length (default 64; tiny 16)")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--cache", default="dual", choices=sorted(CACHE_KIND))
    ap.add_argument("--head-scale", type=float, default=10.0, help="LM head multiplier (see the docstring)")
    ap.add_argument("--early-stop", action="store_true", help="stop rows at EOS (default off)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on accelerators, float32 on CPU")
    ap.add_argument("--moe-impl", default="auto")
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny model and shapes: seconds on CPU")
    ap.add_argument("--out", default=None, help="JSON results here")
    a = ap.parse_args(argv)

    backend = jax.default_backend()
    dtype = jnp.dtype(a.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    if a.tiny:
        cfg = preset(a.preset) if a.preset.startswith("tiny") else tiny_config()
        batches, prompt, gen, block = a.batches or [1, 4], a.prompt or 24, a.gen or 32, a.block or 16
        repeats, mm_n, copy_bytes = min(a.repeats, 2), 256, 8 << 20
    else:
        cfg = preset(a.preset)
        if a.layers:
            cfg = cfg.replace(num_layers=a.layers)
        batches, prompt, gen, block = a.batches or [1, 4, 16], a.prompt or 256, a.gen or 256, a.block or 64
        repeats, mm_n, copy_bytes = a.repeats, None, None
    print(f"jax {jax.__version__}, backend {backend}, devices {jax.devices()}")
    print(f"e2e: {'tiny' if a.tiny else a.preset} layers={cfg.num_layers} {cfg.num_params / 1e9:.3f} G params {dtype.name}; "
          f"prompt {prompt}, gen {gen}, block {block}, cache {a.cache}, threshold {a.threshold}, "
          f"head x{a.head_scale}, early_stop={a.early_stop}", flush=True)

    t = time.perf_counter()
    mm = rl.measure_matmul_peak(mm_n, dtype if backend != "cpu" else jnp.float32)
    bw = rl.measure_copy_bandwidth(copy_bytes)
    peak, bandwidth = mm["flops_per_s"], bw["bytes_per_s"]
    print(f"ceilings: matmul {peak / 1e12:.3f} TFLOP/s ({mm['n']}^3 {mm['dtype']}), copy {bandwidth / 1e9:.1f} GB/s "
          f"({time.perf_counter() - t:.1f} s)", flush=True)

    t = time.perf_counter()
    params = rl.random_params(cfg, dtype, seed=0, head_scale=a.head_scale)
    print(f"random weights on {jax.devices()[0]}: {time.perf_counter() - t:.1f} s", flush=True)
    model = Model(cfg, params, moe_impl=a.moe_impl, attention_impl=a.attention_impl)
    generator = Generator(model)
    sp = SamplingParams(gen_length=gen, block_length=block, strategy="threshold", cache=a.cache,
                        threshold=a.threshold, early_stop=a.early_stop)
    w = dtype.itemsize
    rows = []
    for B in batches:
        prompts = np.asarray(rl.random_canvas(cfg, B, prompt, seed=B))
        t = time.perf_counter()
        res = generator.generate(prompts, sp)
        first = time.perf_counter() - t
        secs = []
        for _ in range(repeats):
            res = generator.generate(prompts, sp)
            secs.append(res.seconds)
        s = statistics.median(secs)
        nfe_full, nfe_win = res.batch_nfe_full, res.batch_nfe_window
        raw = res.raw_ids
        tokens = int(np.sum((raw != cfg.eos_token_id) & (raw != cfg.mask_token_id)))
        kw = dict(dtype_bytes=w, moe_impl=a.moe_impl)
        c_full = rl.kind_cost(cfg, "full", B, prompt, gen, block, **kw)
        c_win = rl.kind_cost(cfg, CACHE_KIND[a.cache], B, prompt, gen, block, **kw)

        def floors(cst):
            return cst["flops"] / peak, cst["bytes"] / bandwidth
        ff, fb = floors(c_full)
        wf, wb = floors(c_win)
        floor_full, floor_win = max(ff, fb), max(wf, wb)
        if a.cache == "none":
            nfe_full, nfe_win = nfe_full + nfe_win, 0
        gen_floor = nfe_full * floor_full + nfe_win * floor_win
        row = dict(batch=B, prompt=prompt, gen=gen, block=block, cache=a.cache, seconds=s, first_call_s=first,
                   nfe_full=nfe_full, nfe_window=nfe_win, nfe=nfe_full + nfe_win,
                   forwards_per_s=(nfe_full + nfe_win) / s, tokens=tokens, tokens_per_s=tokens / s,
                   tpf=tokens / max(1, nfe_full + nfe_win) / B,
                   full_fwd=dict(flops=c_full["flops"], bytes=c_full["bytes"], floor_flops_s=ff, floor_bytes_s=fb),
                   window_fwd=dict(flops=c_win["flops"], bytes=c_win["bytes"], floor_flops_s=wf, floor_bytes_s=wb),
                   gen_floor_s=gen_floor, measured_over_floor=s / gen_floor)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = dict(jax=jax.__version__, backend=backend, device=str(jax.devices()[0]), dtype=dtype.name,
               config=cfg.to_dict(), head_scale=a.head_scale, threshold=a.threshold,
               ceilings=dict(matmul=mm, copy=bw), rows=rows)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print(f"\n### End-to-end generation ({backend}, {dtype.name}; ceilings: matmul {peak / 1e12:.3f} TFLOP/s, "
          f"copy {bandwidth / 1e9:.1f} GB/s)\n")
    rl.print_table(["batch", "seconds", "NFE full+window", "forwards/s", "tokens/s", "TPF/row",
                    "window fwd floor ms (FLOP / byte)", "full fwd floor ms (FLOP / byte)", "gen floor ms",
                    "measured/floor"],
                   [[r["batch"], f"{r['seconds']:.3f}", f"{r['nfe_full']}+{r['nfe_window']}", f"{r['forwards_per_s']:.1f}",
                     f"{r['tokens_per_s']:.1f}", f"{r['tpf']:.2f}",
                     f"{1e3 * r['window_fwd']['floor_flops_s']:.3g} / {1e3 * r['window_fwd']['floor_bytes_s']:.3g}",
                     f"{1e3 * r['full_fwd']['floor_flops_s']:.3g} / {1e3 * r['full_fwd']['floor_bytes_s']:.3g}",
                     f"{1e3 * r['gen_floor_s']:.3g}", f"{r['measured_over_floor']:.2f}"] for r in rows])
    return out


if __name__ == "__main__":
    main()
