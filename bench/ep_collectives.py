"""Which collectives one layer emits under each mesh, read from the HLO (8 fake CPU devices).

  python bench/ep_collectives.py [--config tiny|llada-moe-7b-a1b] [--seq 64]

For one MoE layer and one whole decoder layer (attention + MoE) of the config, on each mesh and
batch size, lowers the jitted layer and counts collective ops:
  lowered  = StableHLO as written (the expert-parallel shard_map's hand-written collectives)
  compiled = optimized HLO after SPMD partitioning (adds what GSPMD inserts for TP/DP)
Each op is listed with its result shape, so the bytes moved per layer can be read off. Shapes
only (abstract params): the 7B-A1B config needs no memory.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dinfer_jax import sharding as shd  # noqa: E402
from dinfer_jax.families import preset  # noqa: E402
from dinfer_jax.kernels import KernelConfig  # noqa: E402
from dinfer_jax.models.forward_inputs import ForwardInputs  # noqa: E402
from dinfer_jax.models.moe import MoE  # noqa: E402
from dinfer_jax.models.transformer import DecoderLayer  # noqa: E402

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
CASES = [("expert=8", 1), ("expert=8", 8), ("data=2,expert=4", 8), ("expert=4,model=2", 1),
         ("expert=4,model=2", 4), ("data=2,expert=2,model=2", 4)]


def count(text: str, compiled: bool):
    out = {}
    for k in KINDS:
        pat = (r"= (\S+) " + k + r"(?:-start)?\(") if compiled else (r"stablehlo\." + k.replace("-", "_") + r"\"?")
        hits = re.findall(pat, text)
        if hits:
            out[k] = hits if compiled else len(hits)
    return out


def fmt(c: dict, compiled: bool) -> str:
    if not c:
        return "none"
    if not compiled:
        return ", ".join(f"{k} x{v}" for k, v in c.items())
    return ", ".join(f"{k} x{len(v)} [{'; '.join(sorted(set(v)))}]" for k, v in c.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    cfg = preset(a.config)
    print(f"# {a.config}: D={cfg.hidden_size} F={cfg.intermediate_size} E={cfg.num_experts} top-{cfg.num_experts_per_tok}"
          f" N={cfg.num_heads} K={cfg.num_kv_heads}; S={a.seq}; jax {jax.__version__}")
    print("| layer | mesh | B | batch split over | lowered (hand-written) | compiled (after SPMD) |")
    print("|---|---|---|---|---|---|")
    for spec, B in CASES:
        mesh = shd.make_mesh(spec)
        x = jax.ShapeDtypeStruct((B, a.seq, cfg.hidden_size), jnp.float32)
        pos = jax.ShapeDtypeStruct((B, a.seq), jnp.int32)
        for name, module, args in [
            ("MoE", MoE(cfg, jnp.float32, KernelConfig(mesh=mesh)), (x,)),
            ("decoder", DecoderLayer(cfg, jnp.float32, KernelConfig(attention="xla", mesh=mesh)),
             (x, ForwardInputs(pos), None)),
        ]:
            abstract = jax.eval_shape(lambda *a, m=module: m.init(jax.random.key(0), *a), *args)
            import flax.linen as nn
            specs = nn.get_partition_spec(abstract)
            shardings = jax.tree_util.tree_map(
                lambda s, v: jax.sharding.NamedSharding(mesh, shd.logical_spec(tuple(s), v.shape, mesh, strict=True)),
                specs, nn.meta.unbox(abstract), is_leaf=lambda t: isinstance(t, jax.sharding.PartitionSpec))
            params = jax.tree_util.tree_map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                                            nn.meta.unbox(abstract), shardings)
            axes = shd.batch_axes(B, mesh)
            act = jax.sharding.NamedSharding(mesh, shd.P(axes if axes else None, None, None))
            xs = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=act)
            rest = args[1:]
            fn = jax.jit(lambda p, x, *r, m=module: m.apply(p, x, *r))
            low = fn.lower(params, xs, *rest)
            lowered = count(low.as_text(), False)
            compiled = count(low.compile().as_text(), True)
            print(f"| {name} | {spec} | {B} | {','.join(axes) or 'replicated'} | {fmt(lowered, False)} | "
                  f"{fmt(compiled, True)} |")


if __name__ == "__main__":
    main()
