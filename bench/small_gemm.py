"""The CPU GEMMs behind the forward's gap to eager PyTorch, alone: small-M expert matmuls and the
LM head, jax (XLA:CPU) vs torch (MKL / oneDNN) vs numpy, fp32, in one process, alternating.

  python bench/small_gemm.py                 # ~2 min on 2 cores; --out bench/small_gemm.json
  python bench/small_gemm.py --tiny          # seconds (tests)

Rows (M x K x N, weight stored (K, N) = "in-first" unless marked (N, K) = "out-first"):
  expert   M = 4 / 8 / 32 rows of one expert's gate (2048 x 1024, LLaDA-MoE-7B-A1B): the window
           forward gives ~4 rows per expert (32 tokens x top-8 over 64 experts)
  lm head  M = 32 rows x 2048 x 157184 (the window's logits at 7B-A1B's vocab), stored (D, V) as
           checkpoint format v1 did and (V, D) as v2 does
`jax 1 core` runs the same jax call pinned to one CPU (os.sched_setaffinity), which shows whether
XLA:CPU spreads that dot over both cores. Medians of --repeats calls, per round; the table gives the
median over --rounds rounds, [min, max].
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def _time(f, repeats: int) -> float:
    f()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tiny", action="store_true", help="small shapes, 1 round (tests)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    torch = None
    if not a.no_torch:
        try:
            import torch
            torch.set_num_threads(2)
        except ImportError:
            torch = None
    D, F, V = (64, 32, 1000) if a.tiny else (2048, 1024, 157184)
    rounds, repeats = (1, 3) if a.tiny else (a.rounds, a.repeats)
    rng = np.random.default_rng(0)
    cases = [(f"expert M={m}", m, D, F) for m in (4, 8, 32)] + [("lm head M=32", 32, D, V)]
    in_first = jax.jit(lambda x, w: x @ w)
    out_first = jax.jit(lambda x, w: x @ w.T)
    all_cpus = sorted(os.sched_getaffinity(0))
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, M, K, N in cases:
            x = rng.standard_normal((M, K), dtype=np.float32)
            w = (rng.standard_normal((K, N), dtype=np.float32) * 0.02)
            wt = np.ascontiguousarray(w.T)
            jx, jw, jwt = jnp.asarray(x), jnp.asarray(w), jnp.asarray(wt)
            calls = {"jax (K, N)": lambda: in_first(jx, jw).block_until_ready(),
                     "jax (N, K)": lambda: out_first(jx, jwt).block_until_ready(),
                     "numpy (K, N)": lambda: x @ w}
            if torch is not None:
                tx, tw, twt = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(wt)
                calls["torch (K, N)"] = lambda: tx @ tw
                calls["torch (N, K)"] = lambda: torch.nn.functional.linear(tx, twt)
            order = list(calls) if r % 2 == 0 else list(calls)[::-1]
            for impl in order:
                times.setdefault(f"{name} | {impl}", []).append(_time(calls[impl], repeats))
            os.sched_setaffinity(0, all_cpus[:1])
            try:
                times.setdefault(f"{name} | jax (K, N) 1 core", []).append(_time(calls["jax (K, N)"], repeats))
            finally:
                os.sched_setaffinity(0, all_cpus)
    print(f"fp32, {len(all_cpus)} CPUs, {rounds} rounds x {repeats} calls (median ms per call)")
    print("| GEMM | impl | ms median [min, max] | weight GB/s |")
    print("|---|---|---|---|")
    rows = {}
    for key, ts in times.items():
        name, impl = key.split(" | ")
        M, K, N = next((m, k, n) for c, m, k, n in cases if c == name)
        med = statistics.median(ts)
        rows[key] = {"ms": med, "min": min(ts), "max": max(ts), "weight_GBps": K * N * 4 / med / 1e6}
        print(f"| {name} ({M}x{K}x{N}) | {impl} | {med:.3f} [{min(ts):.3f}, {max(ts):.3f}] | "
              f"{rows[key]['weight_GBps']:.1f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"jax": jax.__version__, "torch": getattr(torch, "__version__", None), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
