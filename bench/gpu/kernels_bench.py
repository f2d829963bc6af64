"""Attention and MoE layer timings: our Pallas kernel vs jax.nn.dot_product_attention (cuDNN) vs
the XLA reference; MoE expert paths (ragged_dot, tiled scan, dense einsum; the Pallas GMM on TPU).

  python bench/gpu/kernels_bench.py            # LLaDA-MoE windows S=64 over L=1k..32k (N=K=16, H=128), GQA 16/4 block-causal, bf16
  python bench/gpu/kernels_bench.py --tiny     # tiny shapes, runs anywhere (Pallas in interpret mode on CPU)

Prints one JSON line per measurement and a markdown table; medians of --repeats timed calls after
one warm-up (compile) call. On a GPU, the Pallas rows record the kernel's kv split (kv_split, from
gpu_tiles: > 1 on small grids such as B=1, S=64, L=4k), and a shape that splits is timed again with
the split forced off (impl "pallas_nosplit", BlockSizes.kv_splits=1) for a before/after.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp


def median_ms(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


class Rows(list):
    """A list of result rows that prints each one (a JSON line) as it is added: a run cut short by a
    time limit keeps what it measured."""

    def append(self, row):
        print(json.dumps(row), flush=True)
        super().append(row)


def attention_rows(tiny: bool, repeats: int, all_shapes: bool = False):
    from dinfer_jax.kernels import attention
    from pallas_kernels.attention import BlockSizes
    from pallas_kernels.attention.gpu import gpu_tiles
    on_gpu = jax.default_backend() == "gpu"
    on_accel = jax.default_backend() in ("gpu", "tpu")
    dtype = jnp.bfloat16
    # (B, S, L, N, K, H, block_size): LLaDA-MoE windows over caches up to 32k and its full refresh
    # (S = L = 512); LLaDA2-style GQA 16/4 with the block-causal mask (block 32); Qwen2.5-7B's 28/4
    # (Dream / Fast-dLLM v2: a query group of 7, padded to 8 by the GPU kernel) block-causal.
    shapes = ([(1, 8, 160, 4, 2, 16, 0), (1, 8, 160, 4, 2, 16, 4), (1, 8, 160, 7, 1, 16, 4)] if tiny else
              [(1, 64, 4096, 16, 16, 128, 0), (8, 64, 4096, 16, 16, 128, 0), (8, 64, 32768, 16, 16, 128, 0),
               (16, 32, 4096, 16, 4, 128, 32), (16, 32, 4096, 28, 4, 128, 32), (16, 512, 512, 16, 16, 128, 0)]
              if not all_shapes else
              [(B, 64, L, 16, 16, 128, 0) for B in (1, 8) for L in (1024, 4096, 32768)]
              + [(B, 32, 4096, 16, 4, 128, 32) for B in (1, 16)]
              + [(B, 32, 4096, 28, 4, 128, 32) for B in (1, 16)]
              + [(B, 512, 512, 16, 16, 128, 0) for B in (1, 16)])
    base_impls = ["xla", "pallas"] + (["cudnn"] if on_gpu else [])
    rows = Rows()
    for B, S, L, N, K, H, block_size in shapes:
        block_sizes = BlockSizes(64 if not tiny else 8, 512 if not tiny else 128)
        G = 1 << (N // K - 1).bit_length()  # the GPU body's (padded) query group
        kv_split = gpu_tiles(S, L, G, H, jnp.dtype(dtype).itemsize, block_sizes, B=B, K=K)["n_split"]
        impls = base_impls + (["pallas_nosplit"] if on_gpu and kv_split > 1 else [])
        ks = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(ks[0], (B, S, N, H), dtype)
        k = jax.random.normal(ks[1], (B, L, K, H), dtype)
        v = jax.random.normal(ks[2], (B, L, K, H), dtype)
        mask = jnp.arange(L)[None, :] >= jnp.arange(B)[:, None] * 7
        k_pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
        q_pos = k_pos[:, L - S:]  # the window is the last S positions
        # fp32 reference (the XLA path on fp32 copies of the same bf16 inputs, full-precision dots)
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(lambda q, k, v, m, bsz=block_size: attention(
                q, k, v, m, q_pos_BS=q_pos, k_pos_BL=k_pos, block_size=bsz, impl="xla"))(
                *(a.astype(jnp.float32) for a in (q, k, v)), mask).astype(jnp.float32)
        for impl in impls:
            tiles = dataclasses.replace(block_sizes, kv_splits=1) if impl == "pallas_nosplit" else block_sizes
            f = jax.jit(lambda q, k, v, m, impl=impl.removesuffix("_nosplit"), bsz=block_size, tiles=tiles:
                        attention(q, k, v, m, q_pos_BS=q_pos, k_pos_BL=k_pos, block_size=bsz, impl=impl,
                                  block_sizes=tiles, interpret=None if on_accel else True))
            try:
                t0 = time.perf_counter()
                out = jax.block_until_ready(f(q, k, v, mask))
                first_s = time.perf_counter() - t0
                ms = median_ms(f, q, k, v, mask, repeats=repeats)
            except Exception as e:  # a backend that cannot run here: record why, keep going
                rows.append(dict(op="attention", impl=impl, B=B, S=S, L=L, N=N, K=K, H=H, bs=block_size,
                                 error=str(e)[:200]))
                continue
            out32 = out.astype(jnp.float32)
            err = float(jnp.linalg.norm(out32 - ref) / jnp.linalg.norm(ref))
            finite = bool(jnp.all(jnp.isfinite(out32)))
            bytes_moved = 2 * (q.size + 2 * k.size + q.size)
            split = ({"kv_split": kv_split if impl == "pallas" else 1} if on_gpu and impl.startswith("pallas")
                     else {})
            rows.append(dict(op="attention", impl=impl, B=B, S=S, L=L, N=N, K=K, H=H, bs=block_size, ms=round(ms, 4),
                             GBps=round(bytes_moved / ms / 1e6, 1), rel_err_vs_fp32=round(err, 5), finite=finite,
                             compile_s=round(first_s, 2), **split))
    return rows


def moe_rows(tiny: bool, repeats: int):
    from dinfer_jax.models.moe import experts_dense, experts_pallas, experts_ragged, experts_tiled, route
    T, D, F, E, X = (64, 64, 32, 8, 2) if tiny else (512, 2048, 1024, 64, 8)  # 7B-A1B: 8 x 64-token blocks
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    ks = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(ks[0], (T, D), dtype)
    wr = jax.random.normal(ks[1], (D, E), dtype) * 0.1
    wg, wu = (jax.random.normal(k, (E, D, F), dtype) * 0.02 for k in ks[2:4])
    wd = jax.random.normal(ks[4], (E, F, D), dtype) * 0.02
    rows = Rows()
    impls = (("ragged_dot", experts_ragged), ("tiled", experts_tiled), ("dense", experts_dense))
    if jax.default_backend() == "tpu":  # the Pallas GMM kernel only compiles (Mosaic) on TPU
        impls += (("pallas_gmm", experts_pallas),)
    from dinfer_jax.models.quant import quantize
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda x: experts_dense(x.astype(jnp.float32), *route(x, wr, X, False),
                                              *(w.astype(jnp.float32) for w in (wg, wu, wd))))(x)
    variants = [(name, fn, None) for name, fn in impls]
    # Quantized expert stacks (per-channel int8; fp8 e4m3 with 128x128 block scales), dequantized
    # inside the expert matmul; weights quantized once on the host.
    qw = {kind: tuple(jax.device_put(quantize(w, kind, 1, 1)) for w in (wg, wu, wd)) for kind in ("int8", "fp8")}
    variants += [(f"{name}+{kind}", fn, kind) for kind in ("int8", "fp8")
                 for name, fn in impls if name in ("ragged_dot", "tiled")]
    for name, fn, kind in variants:
        ws = (wg, wu, wd) if kind is None else qw[kind]
        f = jax.jit(lambda x, ws, fn=fn: fn(x, *route(x, wr, X, False), *ws))
        try:
            out = f(x, ws)
            ms = median_ms(f, x, ws, repeats=repeats)
        except Exception as e:  # record why, keep going
            rows.append(dict(op="moe", impl=name, T=T, D=D, F=F, E=E, X=X, error=str(e)[:200]))
            continue
        err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        flops = 2 * T * X * 3 * D * F
        wbytes = sum(int(getattr(w, "q", w).nbytes) for w in ws)
        rows.append(dict(op="moe", impl=name, T=T, D=D, F=F, E=E, X=X, ms=round(ms, 4),
                         useful_TFLOPs=round(flops / ms / 1e9, 3), weight_GBps=round(wbytes / ms / 1e6, 1),
                         rel_err_vs_fp32=round(err, 5)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--all-shapes", action="store_true", help="attention at every B x L (default: 6 shapes)")
    a = ap.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    rows = attention_rows(a.tiny, a.repeats, a.all_shapes) + moe_rows(a.tiny, a.repeats)
    print("\n| op | impl | shape | ms | note |\n|---|---|---|---|---|")
    for r in rows:
        shape = (f"B{r['B']} S{r['S']} L{r['L']} N{r['N']} K{r['K']} H{r['H']} blk{r['bs']}" if r["op"] == "attention"
                 else f"T{r['T']} D{r['D']} F{r['F']} E{r['E']} X{r['X']}")
        note = r.get("error") or (f"{r['GBps']} GB/s, rel err vs fp32 {r['rel_err_vs_fp32']}"
                                  + (f", kv split {r['kv_split']}" if "kv_split" in r else "")
                                  + ("" if r["finite"] else " NON-FINITE") if r["op"] == "attention"
                                  else f"{r['useful_TFLOPs']} useful TFLOP/s, weights {r['weight_GBps']} GB/s, "
                                       f"rel err vs fp32 {r['rel_err_vs_fp32']}")
        print(f"| {r['op']} | {r['impl']} | {shape} | {r.get('ms', '-')} | {note} |")


if __name__ == "__main__":
    main()
