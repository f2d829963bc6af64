"""Weight quantization at LLaDA-MoE-7B-A1B widths: bytes on disk, peak RSS of loading, logits error.

Writes a synthetic bf16 HF checkpoint (bench/make_synthetic_checkpoint.py --random: N(0, 0.02^2)
weights, so routers spread tokens), converts it three times (bf16 as stored, `--quantize int8`,
`--quantize fp8`), then in a fresh process per checkpoint loads it (bf16 activations; the
quantized params stay int8 / fp8 + fp32 scales) and runs one forward over a 64-token prompt.
Reported: the params' bytes in memory, the process's RSS right after load and its peak RSS
(VmHWM) after load and after the forward; the logits error is
max |logits_q - logits_bf16| / max |logits_bf16| and top-1 agreement over the 64 positions.

  python bench/quantize_memory.py                      # 2 layers (the numbers in RESULTS.md)
  python bench/quantize_memory.py --full               # all 16 layers: ~15 GB on disk, ~16+ GB RAM
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _du(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def _status_kib(field: str) -> int:
    """A /proc/self/status field in bytes: VmRSS (now) or VmHWM (peak of this process image;
    ru_maxrss is not used: after fork + exec Linux keeps the parent's peak in it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _load_and_forward(folder: str, logits_out: str):
    """Child process: load, forward, report peak RSS (GiB) after each."""
    import jax
    import jax.numpy as jnp

    from dinfer_jax import load_model
    t = time.perf_counter()
    m = load_model(folder, dtype=jnp.bfloat16)
    load_s = time.perf_counter() - t
    rss_load = _status_kib("VmHWM")
    rss_now = _status_kib("VmRSS")
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(m.params))
    ids = (np.arange(64) * 7919 + 13) % m.config.vocab_size
    t = time.perf_counter()
    np.save(logits_out, m.logits(ids))
    fwd_s = time.perf_counter() - t
    rss_fwd = _status_kib("VmHWM")
    print(json.dumps({"param_bytes_GiB": round(param_bytes / 2**30, 3), "rss_after_load_GiB": round(rss_now / 2**30, 3),
                      "peak_rss_after_load_GiB": round(rss_load / 2**30, 3),
                      "peak_rss_after_forward_GiB": round(rss_fwd / 2**30, 3),
                      "load_seconds": round(load_s, 1), "forward_seconds": round(fwd_s, 1)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="all layers of the preset (needs ~16+ GB of RAM)")
    ap.add_argument("--preset", default="llada-moe-7b-a1b")
    ap.add_argument("--work", default="/tmp/dinfer_quantize_bench")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "quantize_memory.json"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints in --work")
    ap.add_argument("--reuse", action="store_true", help="reuse the HF folder and checkpoints already in --work "
                    "(their convert times from convert_seconds.json there)")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        return _load_and_forward(*a._child)

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from make_synthetic_checkpoint import write_synthetic

    from converters import convert
    from dinfer_jax.families import preset
    cfg = preset(a.preset)
    if not a.full:
        cfg = cfg.replace(num_layers=a.layers)
    hf = os.path.join(a.work, "hf")
    times_path = os.path.join(a.work, "convert_seconds.json")
    if not a.reuse:
        shutil.rmtree(a.work, ignore_errors=True)
        t = time.perf_counter()
        write_synthetic(hf, cfg, random=True)
        print(f"synthetic HF checkpoint {_du(hf) / 2**30:.2f} GiB in {time.perf_counter() - t:.0f}s", flush=True)
    times = json.load(open(times_path)) if os.path.isfile(times_path) else {}
    rows = {}
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for kind in ("bf16", "int8", "fp8"):
        dst = os.path.join(a.work, kind)
        if not (a.reuse and os.path.isfile(os.path.join(dst, "dinfer_jax.json"))):
            shutil.rmtree(dst, ignore_errors=True)
            t = time.perf_counter()
            convert(hf, dst, progress=False, quantize=None if kind == "bf16" else kind)
            times[kind] = round(time.perf_counter() - t, 1)
            with open(times_path, "w") as f:
                json.dump(times, f)
        logits = os.path.join(a.work, f"logits_{kind}.npy")
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", dst, logits],
                           capture_output=True, text=True, env=env)
        if p.returncode:
            raise SystemExit(f"{kind}: load/forward failed:\n{p.stderr[-3000:]}")
        rows[kind] = {"disk_bytes": _du(dst), "disk_GiB": round(_du(dst) / 2**30, 3),
                      "convert_seconds": times.get(kind),
                      **json.loads(p.stdout.strip().splitlines()[-1])}
        print(kind, rows[kind], flush=True)
    ref = np.load(os.path.join(a.work, "logits_bf16.npy")).astype(np.float64)
    for kind in ("int8", "fp8"):
        out = np.load(os.path.join(a.work, f"logits_{kind}.npy")).astype(np.float64)
        rows[kind]["logits_max_abs_err_rel"] = float(np.abs(out - ref).max() / np.abs(ref).max())
        rows[kind]["logits_rms_err_rel"] = float(np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref ** 2)))
        rows[kind]["top1_agreement"] = float(np.mean(out.argmax(-1) == ref.argmax(-1)))
        # Are the disagreements near-ties? The bf16 top-1 minus top-2 logit per position, next to the
        # quantized logits' max |error| at that position (both relative to max |logits_bf16|).
        top2 = np.sort(ref, axis=-1)[..., -2:]
        margin = (top2[..., 1] - top2[..., 0]) / np.abs(ref).max()
        err = np.abs(out - ref).max(-1) / np.abs(ref).max()
        differ = out.argmax(-1) != ref.argmax(-1)
        rows[kind]["bf16_top1_margin_rel_median"] = float(np.median(margin))
        rows[kind]["positions_margin_below_2x_err"] = float(np.mean(margin < 2 * err))
        rows[kind]["disagreeing_margin_rel_max"] = float(margin[differ].max()) if differ.any() else None
        rows[kind]["disk_vs_bf16"] = round(rows[kind]["disk_bytes"] / rows["bf16"]["disk_bytes"], 3)
    result = {"preset": a.preset, "layers": cfg.num_layers, "full_size": a.full, "hidden": cfg.hidden_size,
              "experts": cfg.num_experts, "moe_ffn": cfg.intermediate_size, "vocab": cfg.vocab_size,
              "activations": "bf16 (CPU)", "prompt_tokens": 64, "weights": "synthetic N(0, 0.02^2) bf16",
              "results": rows}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    if not a.keep:
        shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
