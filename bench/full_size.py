"""Full-size LLaDA-MoE-7B-A1B on CPU: a synthetic Hugging Face checkpoint (real names and shapes,
bf16, 4 safetensors shards, RANDOM seeded-normal weights: not LLaDA-MoE's, so the numbers are
time and memory, not quality) -> `convert` (peak RSS in a subprocess) -> load in bf16 ->
a dual-cache generation of a few blocks, plus the bare full-refresh and window forwards.

  python bench/full_size.py --workdir /tmp/fullsize          # 13.7 GiB checkpoint + 13.7 GiB converted
  python bench/full_size.py --workdir /tmp/fs-tiny --tiny    # the same pipeline at tiny shapes (tests)

Random weights make every confidence small, so the generation uses LLaDA's fixed schedule
(`--steps` per block): the forward count is then set by the schedule, not by the weights.
Reports: write / convert seconds, convert and load peak RSS, compile seconds, seconds of the whole
generation (median of --repeats after one compile run), its forwards, and the median seconds of
one full refresh (S = L) and one dual-cache window forward (S = block, keys over L).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# XLA:CPU has no bf16 matmul: it converts bf16 dot operands to fp32, and while-loop-invariant code
# motion then hoists that convert out of the layer scan, materialising an fp32 copy of every
# layer-stacked weight (29 GB for 7B-A1B: out of memory in 24 GiB; compiled temp = 2.3x the bf16
# params at small shapes, 0.5x with the pass off). Off for this script; the CPU default dtype
# is fp32, where nothing is converted.
CPU_BF16_XLA_FLAGS = "--xla_disable_hlo_passes=while-loop-invariant-code-motion"


def rss_gib() -> float:
    """Peak resident set of this process so far (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def config(tiny: bool):
    from dinfer_jax.families import preset
    if not tiny:
        return preset("llada-moe-7b-a1b")
    return preset("tiny").replace(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                                  intermediate_size=64, num_experts=8, num_experts_per_tok=2, vocab_size=512,
                                  mask_token_id=511, eos_token_id=510, pad_token_id=510)


def ensure_checkpoint(src: str, cfg) -> dict:
    """Write the synthetic HF checkpoint unless `src` already holds one; -> timing row."""
    from bench.make_synthetic_checkpoint import write_synthetic
    if os.path.isfile(os.path.join(src, "model.safetensors.index.json")):
        return {"write_s": None, "note": f"reused {src}"}
    t = time.perf_counter()
    nbytes = write_synthetic(src, cfg, shards=4, random=True)
    return {"write_s": round(time.perf_counter() - t, 1), "checkpoint_GiB": round(nbytes / 2**30, 2)}


def convert_in_subprocess(src: str, dst: str) -> dict:
    """bench/convert_memory.py in a fresh process, so its peak RSS is the converter's alone."""
    if os.path.isdir(dst):
        return {"note": f"reused {dst}"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "convert_memory.py"), src, dst],
                       capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    if r.returncode != 0:
        raise RuntimeError(f"convert failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="holds hf/ (synthetic checkpoint) and dj/ (converted)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--block-length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="fixed-schedule steps over the whole generation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the result row as JSON")
    a = ap.parse_args(argv)
    if "jax" not in sys.modules:  # XLA flags only apply before jax starts (script use, not tests)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_BF16_XLA_FLAGS).strip()

    import jax
    import jax.numpy as jnp
    from bench.bench_loop import bare_forwards, median_time
    from dinfer_jax import SamplingParams, load_model
    from dinfer_jax.benchmark import random_prompts
    from dinfer_jax.engine import Generator

    cfg = config(a.tiny)
    src, dst = os.path.join(a.workdir, "hf"), os.path.join(a.workdir, "dj")
    row = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "backend": jax.default_backend(),
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "params": cfg.num_params, "weights": "random N(0, 0.02^2), bf16"}
    row["write"] = ensure_checkpoint(src, cfg)
    print("checkpoint:", row["write"], flush=True)
    row["convert"] = convert_in_subprocess(src, dst)
    print("convert:", row["convert"], flush=True)

    t = time.perf_counter()
    model = load_model(dst, dtype=jnp.bfloat16)
    row["load_s"] = round(time.perf_counter() - t, 1)
    row["load_peak_rss_GiB"] = round(rss_gib(), 2)
    print(f"loaded in {row['load_s']} s, peak RSS {row['load_peak_rss_GiB']} GiB", flush=True)

    prompts = random_prompts(cfg, a.batch, a.prompt_len, seed=0)
    sp = SamplingParams(gen_length=a.gen_length, block_length=a.block_length, strategy="fixed", steps=a.steps,
                        cache="dual")
    gen = Generator(model)
    t = time.perf_counter()
    res = gen.generate(prompts, sp)
    row["first_call_s"] = round(time.perf_counter() - t, 1)  # compile + one generation
    secs = median_time(lambda: gen.generate(prompts, sp).raw_ids, a.repeats)
    t_full, t_win = bare_forwards(model, gen, prompts, sp, a.repeats)
    row.update(batch=a.batch, prompt_len=a.prompt_len, gen_length=a.gen_length, block_length=a.block_length,
               steps=a.steps, generation_s=round(secs, 3), nfe_full=res.batch_nfe_full,
               nfe_window=res.batch_nfe_window, full_refresh_s=round(t_full, 3), window_forward_s=round(t_win, 3),
               bare_sum_s=round(res.batch_nfe_full * t_full + res.batch_nfe_window * t_win, 3),
               tokens=int(np.sum(res.raw_ids != cfg.eos_token_id)), peak_rss_GiB=round(rss_gib(), 2))
    print(json.dumps(row), flush=True)
    print("\n| params | batch | prompt+gen (block) | forwards full+window | s / full refresh | s / window fwd "
          "| s / generation | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {cfg.num_params / 1e9:.2f} B | {a.batch} | {a.prompt_len}+{a.gen_length} ({a.block_length}) | "
          f"{row['nfe_full']}+{row['nfe_window']} | {row['full_refresh_s']} | {row['window_forward_s']} | "
          f"{row['generation_s']} | {row['peak_rss_GiB']} GiB |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(row, f, indent=1)
    return row


if __name__ == "__main__":
    main()
