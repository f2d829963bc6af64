"""LLaDA2-mini at full widths on CPU, in bf16: parameter counts at the published sizes, and one
block-causal forward of a model with the real widths (D 2048, 16/4 heads of 128, 256 experts of
512 in 8 groups + 1 shared, dense first layer of 5120, vocab 157184) and fewer layers.

  python bench/llada2_full_width.py                  # 2 layers (the dense one + 1 MoE): ~3 GB of bf16
  python bench/llada2_full_width.py --layers 3 --tokens 64

Weights are RANDOM (a seeded normal block tiled over each tensor, see `random_weight`): the numbers
are counts, time and memory, not quality. All 20
layers do not fit this 24 GiB machine (16.26 B params = 32.5 GB in bf16), so a forward at full
depth is left to an accelerator; the per-layer cost here scales linearly with depth (one scan).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


PERIOD = 1_000_003  # a prime: no two experts (or rows) of a tiled weight are equal


def random_weight(seed: int, shape):
    """N(0, 0.02) bf16 weights, fast on CPU: one random block of PERIOD values tiled over the
    tensor (threefry over 1.5 B values takes minutes on 2 cores; a tiled copy takes seconds)."""
    import jax
    import jax.numpy as jnp
    n = int(np.prod(shape))
    base = 0.02 * jax.random.normal(jax.random.key(seed), (min(n, PERIOD),), jnp.float32)
    return jax.jit(lambda b: jnp.resize(b.astype(jnp.bfloat16), (n,)).reshape(shape))(base)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="layers (>= 2: the dense first layer + MoE layers)")
    ap.add_argument("--tokens", type=int, default=32, help="sequence length of the forward (a block is 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the result row as JSON here")
    a = ap.parse_args(argv)
    from bench.full_size import CPU_BF16_XLA_FLAGS, rss_gib
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_BF16_XLA_FLAGS).strip()
    import jax
    import jax.numpy as jnp
    from dinfer_jax.families import preset
    from dinfer_jax.model import Model
    from dinfer_jax.models import abstract_params, unflatten

    full = preset("llada2-mini")
    cfg = full.replace(num_layers=a.layers)
    row = dict(preset="llada2-mini", params_total=full.num_params, params_active=full.num_active_params,
               layers_run=a.layers, params_run=cfg.num_params, tokens=a.tokens, dtype="bfloat16")
    t = time.perf_counter()
    flat = {}
    for i, (path, s) in enumerate(sorted(abstract_params(cfg, jnp.bfloat16).items())):
        if "norm" in path:
            flat[path] = jnp.ones(s.shape, jnp.bfloat16)
        else:
            flat[path] = random_weight(i, s.shape)
        jax.block_until_ready(flat[path])
    row["init_s"] = round(time.perf_counter() - t, 1)
    model = Model(cfg, unflatten(flat))
    ids = np.random.default_rng(0).integers(0, 150000, (1, a.tokens))
    t = time.perf_counter()
    logits = model.logits(ids)
    row["first_call_s"] = round(time.perf_counter() - t, 1)  # compile + run
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        model.logits(ids)
        times.append(time.perf_counter() - t)
    row["forward_s_median"] = round(float(np.median(times)), 3)
    row["finite"] = bool(np.isfinite(logits).all())
    row["peak_rss_GiB"] = round(rss_gib(), 2)
    print(json.dumps(row))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(row, f, indent=1)
    return row


if __name__ == "__main__":
    main()
