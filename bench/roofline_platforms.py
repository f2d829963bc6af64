"""Roofline floors per platform (counted, not measured): for each platform x model x batch x weight
format, the FLOPs and fewest bytes of the decode forwards the loop runs (bench/roofline.py's
`forward_cost` / `window_shapes`), the vendor spec-sheet peaks, and the floor

    forward floor = max(FLOPs / matmul peak for the format, bytes / HBM bandwidth)
    tokens/s floor = batch x TPF x forwards/s                      (per forward kind)
    loop tokens/s  = batch x block / (one block's forwards)        (the loop's cycle, see below)

No hardware is measured and no model is compiled: everything is arithmetic over the preset configs
(dinfer_jax.families.preset) and the spec sheets tabled in PLATFORMS (each number with its source).

  python bench/roofline_platforms.py                      # writes bench/roofline_platforms.md / .json
  python bench/roofline_platforms.py --platforms h200 v6e --models llada2-mini --batches 1 64 --out-md /tmp/r.md
  python bench/roofline_platforms.py --weight-only        # int8/fp8 weights dequantised: bf16 matmul rate

Canvas (stated, the loop's layout from bench/roofline.py's `canvas_layout`): prompt 256 (bucketed to
a multiple of 32: gen_start 256) + gen 256, canvas L = 512.
Forwards per model (the decoding loop's default cache per family):
  llada-moe-7b-a1b: dual cache, block 64 (dInfer's LLaDA-MoE setting, docs/facts/benchmarks.md section 3):
      "full"  full refresh at block entry, q = kv = L, logits for the block (its logits decode too);
      "dual"  window forward, q = block, keys over L (cache read for the rest).
  llada-8b: dual cache, block 32 (LLaDA / Fast-dLLM default, docs/facts/decoding.md C2): same two kinds.
  llada2-mini: block diffusion (decoding/block_loop.py), block 32 (the model's block size):
      "block"  one block of 32 over the exact prefix cache: q = 32, kv = gen_start + (j+1) * 32, the
               mean over the 8 blocks j (block-causal: no keys after the block);
      "block2" a block's first step, [previous | current] = 64 queries over the same keys (it commits
               the previous block's K/V); the prompt prefill (once per request) is not counted.
Loop cycle per block, with n = block / TPF forwards per block (TPF = tokens per forward):
  dual models: 1 full refresh + (n - 1) dual windows;  llada2-mini: 1 "block2" + (n - 1) "block".
  loop tokens/s = batch * block / (t_first + (n - 1) * t_window).

Weight formats: bf16 (2 bytes per weight), int8 and fp8 (1 byte per weight; scales not counted).
Activations, the KV cache and the router stay bf16; logits fp32. The matmul peak of a format is the
platform's native peak for it (W8A8: activations quantised too) where the spec sheet lists one, else
the bf16 peak (the weights are dequantised to bf16 in VMEM / registers: the bytes stay the smaller
ones, the FLOP rate is bf16's). --weight-only takes the bf16 peak for every format (dinfer-jax has
no quantised matmul today: these int8 / fp8 rows are what such a path could reach).

Memory: weights (num_params x bytes per weight) + the KV cache at this canvas (batch x L x 2 x
layers x kv_heads x head_dim x 2 bytes) against one chip's HBM (no headroom for the compiler's
buffers, so "fits" is optimistic); where it does not fit, `chips` says how many chips the bytes
need and the floor shown is still one chip's arithmetic (split over N chips with perfect TP/EP the
floor would be about 1/N, collectives not counted).

Experts touched per forward: E * (1 - (1 - X/E)^T) for T tokens under uniform independent routing
(bench/roofline.py; LLaDA2's group-limited sigmoid router is treated as uniform too).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.roofline import canvas_layout, forward_cost, window_shapes  # noqa: E402
from dinfer_jax.families import preset  # noqa: E402

REF = "docs/facts"

# ---------------------------------------------------------------------------------------------
# Spec sheets (dense figures, per chip). peak: ops/s per weight format where the matrix unit runs it
# natively; a format absent from `peak` runs at the bf16 rate.

PLATFORMS = {
    "h200": dict(
        name="NVIDIA H200 SXM", hbm_bytes=141e9, hbm_bw=4.8e12,
        peak={"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12},
        source="https://www.nvidia.com/en-us/data-center/h200/",
        note=("NVIDIA's H200 page lists BF16 1,979 TFLOPS, FP8 3,958 TFLOPS, INT8 3,958 TOPS 'with sparsity' "
              "(2:4); dense is half: 989 / 1,979 / 1,979. 141 GB HBM3e, 4.8 TB/s. The NVIDIA page itself was not "
              "retrievable from this sandbox; the figures and the sparsity footnote agree with "
              "https://lzwjava.github.io/nvidia-h200-gpu-specs-en ('*Performance figures include sparsity') and "
              "https://itkb.uw.cz/2026/06/nvidia-h200-vs-b300-precisions-cores.html (dense: ~989 BF16, ~1,979 "
              "FP8). bf16, fp8 and int8 all native (Hopper tensor cores).")),
    "v5e": dict(
        name="Google TPU v5e", hbm_bytes=16e9, hbm_bw=819e9,
        peak={"bf16": 197e12, "int8": 393e12},
        source="https://docs.cloud.google.com/tpu/docs/v5e",
        note=("197 TFLOPS bf16, 393 TOPS int8, 16 GB HBM2 at 819 GB/s (the same page's newer revision says "
              "'800 GiBps' = 859 GB/s; 819 GB/s taken). No fp8 on the sheet: fp8 weights run at the bf16 rate.")),
    "v6e": dict(
        name="Google TPU v6e (Trillium)", hbm_bytes=32e9, hbm_bw=1638e9,
        peak={"bf16": 918e12, "int8": 1836e12},
        source="https://docs.cloud.google.com/tpu/docs/v6e",
        note="918 TFLOPS bf16, 1,836 TOPS int8, 32 GB HBM at 1,638 GB/s. No fp8 on the sheet: fp8 at the bf16 rate."),
    "v5p": dict(
        name="Google TPU v5p", hbm_bytes=95e9, hbm_bw=2765e9,
        peak={"bf16": 459e12, "int8": 918e12, "fp8": 459e12},
        source="https://docs.cloud.google.com/tpu/docs/v5p-training",
        note=("459 TFLOPS bf16, 'FP8 459 TFLOPs' (same as bf16: fp8 accepted, no faster), 95 GB HBM2e at "
              "2,765 GB/s (one revision of the page says 95 GiB; GB taken). int8 918 TOPS is from Google's "
              "launch announcement (https://cloud.google.com/blog/products/ai-machine-learning/"
              "introducing-cloud-tpu-v5p-and-ai-hypercomputer), read here second-hand "
              "(https://aiwiki.ai/wiki/google_tpu_v5p), not on the spec page.")),
}

FORMATS = {"bf16": 2, "int8": 1, "fp8": 1}  # bytes per weight element

# Per model: the loop's forwards, block, and a TPF (tokens per forward) with where it comes from.
MODELS = {
    "llada-moe-7b-a1b": dict(
        cache="dual", block=64, tpf=4.24,
        tpf_source=("ASSUMED: dInfer's per-benchmark TPF for LLaDA-MoE is in its paper's tables, not in the "
                    "reference files (docs/facts/benchmarks.md section 3). Proxy: Fast-dLLM's 4.24 tokens/step at "
                    "threshold 0.8 (LLaDA-8B, GSM8K-256; docs/facts/decoding.md C2), dInfer's threshold for LLaDA-MoE being "
                    "0.8 (docs/facts/benchmarks.md section 3).")),
    "llada-8b": dict(
        cache="dual", block=32, tpf=3.25,
        tpf_source="Fast-dLLM, threshold 0.9, LLaDA-8B GSM8K-256: 3.25 tokens/step (docs/facts/decoding.md C2; Fig. 5)."),
    "llada2-mini": dict(
        cache="block", block=32, tpf=5.3,
        tpf_source=("LLaDA2.1-mini S-mode reported average TPF about 5.3 (2.0-mini: 2.6) (docs/facts/models.md B6); "
                    "tokens/s scale linearly with TPF (x 0.49 for 2.6).")),
}

# Published end-to-end figures to set beside the floors (docs/facts/benchmarks.md).
PUBLISHED = [
    dict(system="dInfer, LLaDA-MoE-7B-A1B", hw="8x H800, batch 1", tok_s=1011, what="HumanEval TPS",
         ref="benchmarks.md section 3 (gen 1024, block 64, threshold 0.8, dual cache)"),
    dict(system="dInfer, LLaDA-MoE-7B-A1B", hw="8x H800, batch 1", tok_s=681, what="average TPS over 6 benchmarks",
         ref="benchmarks.md section 3"),
    dict(system="Fast-dLLM, LLaDA-8B-Instruct", hw="1x A100 80GB, batch 1", tok_s=54.4, what="GSM8K 5-shot, gen 256",
         ref="benchmarks.md C3"),
]
SGLANG_NOTE = ("SGLang LLaDA2.1-mini throughput: no figure in docs/facts (SGLang appears there with its "
               "algorithms and defaults only, llada2_and_dream.md section 10), so none is printed.")


def platform_peak(plat: dict, fmt: str, weight_only: bool = False) -> tuple[float, bool]:
    """(matmul ops/s used for this weight format, native?)"""
    if weight_only or fmt not in plat["peak"]:
        return plat["peak"]["bf16"], fmt == "bf16"
    return plat["peak"][fmt], True


def model_forwards(model: str, prompt: int, gen: int, block: int) -> dict[str, list[tuple[int, int, int]]]:
    """{kind: [(q_len, kv_len, logits_len), ...]}: the decode forwards the loop runs for this model
    (a list: block-diffusion windows are averaged over the blocks)."""
    spec = MODELS[model]
    if spec["cache"] == "dual":
        return {"full": window_shapes("full", prompt, gen, block), "dual": window_shapes("dual", prompt, gen, block)}
    gs, L = canvas_layout("dual", prompt, gen)  # block diffusion: the same canvas, gen_start bucketed
    nb = -(-gen // block)
    return {"block": [(block, gs + (j + 1) * block, block) for j in range(nb)],
            "block2": [(2 * block, gs + (j + 1) * block, block) for j in range(nb)]}


def cost(cfg, batch: int, shapes, weight_bytes: float) -> dict:
    """forward_cost at bf16 activations / KV (mean over shapes), with the given weight bytes."""
    cs = [forward_cost(cfg, batch, q, L, g, dtype_bytes=2, cached=q != L,
                       moe_impl="ragged", backend="gpu", weight_bytes=weight_bytes) for q, L, g in shapes]
    n = len(cs)
    return dict(flops=sum(c["flops"] for c in cs) / n, bytes=sum(c["bytes"] for c in cs) / n,
                q_len=sum(q for q, _, _ in shapes) / n, kv_len=sum(L for _, L, _ in shapes) / n,
                parts={p: sum(c["parts"][p]["bytes"] for c in cs) / n for p in cs[0]["parts"]},
                assumptions=cs[0]["assumptions"])


def memory_need(cfg, batch: int, weight_bytes: float, canvas: int) -> float:
    kv = batch * canvas * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    return cfg.num_params * weight_bytes + kv


def build(platforms, models, batches, formats, prompt=256, gen=256, weight_only=False, tpf=None) -> dict:
    rows, loops = [], []
    for m in models:
        cfg = preset(m)
        spec = MODELS[m]
        block = spec["block"]
        t = (tpf or {}).get(m, spec["tpf"])
        fw = model_forwards(m, prompt, gen, block)
        _, L = canvas_layout("dual", prompt, gen)
        first, window = ("full", "dual") if spec["cache"] == "dual" else ("block2", "block")
        for b in batches:
            for f in formats:
                wb = FORMATS[f]
                costs = {k: cost(cfg, b, shapes, wb) for k, shapes in fw.items()}
                need = memory_need(cfg, b, wb, L)
                for p in platforms:
                    plat = PLATFORMS[p]
                    peak, native = platform_peak(plat, f, weight_only)
                    chips = max(1, math.ceil(need / plat["hbm_bytes"]))
                    times = {}
                    for k, c in costs.items():
                        tf, tb = c["flops"] / peak, c["bytes"] / plat["hbm_bw"]
                        fl = max(tf, tb)
                        times[k] = fl
                        rows.append(dict(platform=p, model=m, batch=b, format=f, kind=k, q_len=c["q_len"],
                                         kv_len=c["kv_len"], flops=c["flops"], bytes=c["bytes"],
                                         intensity=c["flops"] / c["bytes"], peak=peak, native=native,
                                         t_flops=tf, t_bytes=tb, floor_s=fl, bound="FLOPs" if tf >= tb else "bytes",
                                         fwd_per_s=1.0 / fl, tpf=t, tok_per_s=b * t / fl, mem_bytes=need,
                                         fits=chips == 1, chips=chips))
                    n = block / t  # forwards per block
                    t_block = times[first] + max(n - 1.0, 0.0) * times[window]
                    loops.append(dict(platform=p, model=m, batch=b, format=f, block=block, tpf=t,
                                      forwards_per_block=n, first=first, window=window, t_first=times[first],
                                      t_window=times[window], block_s=t_block, tok_per_s=b * block / t_block,
                                      fits=chips == 1, chips=chips, mem_bytes=need))
    return dict(canvas=dict(prompt=prompt, gen=gen, L=canvas_layout("dual", prompt, gen)[1]),
                weight_only=weight_only, platforms={p: PLATFORMS[p] for p in platforms},
                models={m: dict(MODELS[m], params=preset(m).num_params, active_params=preset(m).num_active_params)
                        for m in models},
                published=PUBLISHED, sglang_note=SGLANG_NOTE, rows=rows, loops=loops)


def g(x, nd=3):
    return f"{x:.{nd}g}" if abs(x) < 1000 else f"{x:,.0f}"


def n0(x):
    """A rate: whole numbers with thousands separators (3 significant figures below 100)."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def markdown(res: dict) -> str:
    out = []
    cv = res["canvas"]
    out.append("# Roofline floors per platform (counted from spec sheets, not measured)\n")
    out.append(f"Generated by `bench/roofline_platforms.py`. Canvas: prompt {cv['prompt']} + gen {cv['gen']} "
               f"(L = {cv['L']}). Activations, KV cache and routers bf16; weights per format "
               f"(bf16 2 B, int8 / fp8 1 B, scales not counted). Floors are lower bounds on time from "
               f"FLOP and byte counts; no hardware was measured."
               + (" --weight-only: every format at the bf16 matmul rate." if res["weight_only"] else "") + "\n")
    out.append("## Platforms (dense peaks, per chip)\n")
    out.append("| platform | bf16 TFLOP/s | int8 TOP/s | fp8 TFLOP/s | HBM GB | HBM GB/s | source |")
    out.append("|---|---|---|---|---|---|---|")
    for p, s in res["platforms"].items():
        pk = s["peak"]
        cell = lambda f: (f"{pk[f] / 1e12:.0f}" if f in pk and (f == "bf16" or pk[f] != pk["bf16"])  # noqa: E731
                          else (f"{pk[f] / 1e12:.0f} (= bf16 rate)" if f in pk else "not native: bf16 rate"))
        out.append(f"| {s['name']} | {cell('bf16')} | {cell('int8')} | {cell('fp8')} | {s['hbm_bytes'] / 1e9:.0f} | "
                   f"{s['hbm_bw'] / 1e9:.0f} | {s['source']} |")
    out.append("")
    for p, s in res["platforms"].items():
        out.append(f"- {s['name']}: {s['note']}")
    out.append("\n## Models, forwards, TPF\n")
    out.append("| model | params (active) | cache, block | forwards counted | TPF | TPF source |")
    out.append("|---|---|---|---|---|---|")
    for m, s in res["models"].items():
        kinds = "full refresh + dual window" if s["cache"] == "dual" else "block window (32 q) + first step (64 q)"
        out.append(f"| {m} | {s['params'] / 1e9:.2f} G ({s['active_params'] / 1e9:.2f} G) | {s['cache']}, "
                   f"{s['block']} | {kinds} | {s['tpf']} | {s['tpf_source']} |")
    out.append("\n## Headline: batch 1 and 64, bf16 vs int8, H200 and v6e\n")
    out.append("window = the loop's repeated forward (dual window; llada2-mini: the 32-query block window); "
               "loop tok/s = the block cycle below.\n")
    out.append("| model | batch | format | platform | window floor ms (bound) | first-forward floor ms (bound) | "
               "loop tok/s | fits one chip |")
    out.append("|---|---|---|---|---|---|---|---|")
    fidx = {(r["platform"], r["model"], r["batch"], r["format"], r["kind"]): r for r in res["rows"]}
    for m in res["models"]:
        for b in (1, 64):
            for f in ("bf16", "int8"):
                for p in ("h200", "v6e"):
                    lp = next((r for r in res["loops"] if (r["platform"], r["model"], r["batch"], r["format"])
                               == (p, m, b, f)), None)
                    if lp is None:
                        continue
                    w, fr = fidx[(p, m, b, f, lp["window"])], fidx[(p, m, b, f, lp["first"])]
                    out.append(f"| {m} | {b} | {f} | {p} | {g(w['floor_s'] * 1e3)} ({w['bound']}) | "
                               f"{g(fr['floor_s'] * 1e3)} ({fr['bound']}, {fr['kind']}) | {n0(lp['tok_per_s'])} | "
                               f"{'yes' if lp['fits'] else 'no: ' + str(lp['chips']) + ' chips'} |")
    out.append("\n## Loop floor: tokens/s per chip (one block's forwards: first + (block/TPF - 1) windows)\n")
    plats = list(res["platforms"])
    fmts = sorted({r["format"] for r in res["loops"]}, key=list(FORMATS).index)
    out.append("| model | batch | format | " + " | ".join(res["platforms"][p]["name"] for p in plats) + " |")
    out.append("|---|---|---|" + "---|" * len(plats))
    idx = {(r["platform"], r["model"], r["batch"], r["format"]): r for r in res["loops"]}
    for m in res["models"]:
        for b in sorted({r["batch"] for r in res["loops"]}):
            for f in fmts:
                cells = []
                for p in plats:
                    r = idx.get((p, m, b, f))
                    cells.append("-" if r is None else
                                 f"{n0(r['tok_per_s'])}" + ("" if r["fits"] else f" (needs {r['chips']} chips)"))
                out.append(f"| {m} | {b} | {f} | " + " | ".join(cells) + " |")
    out.append("\nPublished end-to-end figures, for scale (measured systems, not floors):\n")
    for q in res["published"]:
        out.append(f"- {q['system']}: {q['tok_s']} tok/s, {q['what']}, {q['hw']} ({REF}/{q['ref']})")
    out.append(f"- {res['sglang_note']}")
    out.append("\n## Per forward\n")
    out.append("bound: which term sets the floor. fwd/s = 1 / floor; tok/s = batch x TPF x fwd/s for that "
               "forward kind alone. mem: weights + KV cache at this canvas; chips: chips whose HBM that needs.\n")
    out.append("| platform | model | batch | format | kind | q / kv | GFLOP | GB | FLOP/B | t_flops ms | t_bytes ms | "
               "floor ms | bound | fwd/s | tok/s | mem GB | chips |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    order = {k: i for i, k in enumerate(["full", "dual", "block2", "block"])}
    for r in sorted(res["rows"], key=lambda r: (plats.index(r["platform"]), list(res["models"]).index(r["model"]),
                                                r["batch"], list(FORMATS).index(r["format"]), order[r["kind"]])):
        out.append(f"| {r['platform']} | {r['model']} | {r['batch']} | {r['format']}"
                   f"{'' if r['native'] else '*'} | {r['kind']} | {g(r['q_len'])} / {g(r['kv_len'])} | "
                   f"{g(r['flops'] / 1e9)} | {g(r['bytes'] / 1e9)} | {g(r['intensity'])} | {g(r['t_flops'] * 1e3)} | "
                   f"{g(r['t_bytes'] * 1e3)} | {g(r['floor_s'] * 1e3)} | {r['bound']} | {n0(r['fwd_per_s'])} | "
                   f"{n0(r['tok_per_s'])} | {g(r['mem_bytes'] / 1e9)} | {r['chips']}{'' if r['fits'] else ' !'} |")
    out.append("\n`*` format not native on that platform's matrix unit: bf16 matmul rate, smaller bytes. "
               "`!` does not fit one chip's HBM (floor shown is one chip's arithmetic).")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platforms", nargs="+", default=list(PLATFORMS), choices=list(PLATFORMS))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--weight-only", action="store_true", help="int8/fp8 weights dequantised: bf16 matmul rate")
    ap.add_argument("--out-md", default=os.path.join(ROOT, "bench", "roofline_platforms.md"))
    ap.add_argument("--json", dest="out_json", default=None,
                    help="JSON path (default: --out-md with .json)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    res = build(a.platforms, a.models, a.batches, a.formats, a.prompt, a.gen, a.weight_only)
    md = markdown(res)
    out_json = a.out_json or os.path.splitext(a.out_md)[0] + ".json"
    for path, text in ((a.out_md, md), (out_json, json.dumps(res, indent=1))):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    if not a.quiet:
        print(md)
    return res


if __name__ == "__main__":
    main()
