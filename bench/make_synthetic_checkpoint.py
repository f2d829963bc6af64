"""Write a synthetic LLaDA-MoE Hugging Face checkpoint of any size (real names and shapes, bf16,
sharded safetensors), streamed: memory stays at one tensor. Values are not trained weights: by
default a cheap deterministic pattern (tensor k is filled with a value derived from k, fast to
write: enough for converter tests); with --random, seeded N(0, 0.02^2) per tensor (norm weights 1),
so forwards see realistic value ranges and routers spread tokens over experts (for timing).

  python bench/make_synthetic_checkpoint.py OUT_DIR --preset llada-moe-7b-a1b   # 14.7 GB
  python bench/make_synthetic_checkpoint.py OUT_DIR --layers 4 --hidden 512 ...  # small
"""
from __future__ import annotations

import argparse
import json
import os
import zlib

import ml_dtypes
import numpy as np

from converters.mappings import table
from converters.safetensors_io import write_file
from dinfer_jax.families import preset, to_hf_dict
from dinfer_jax.models import abstract_params


def pattern_value(name: str) -> float:
    return float(sum(name.encode()) % 97) / 97.0 - 0.5


def random_value(name: str, shape, std: float = 0.02) -> np.ndarray:
    """Seeded from the tensor name: N(0, std^2) in bf16; RMSNorm weights (names with 'norm') are 1."""
    if "norm" in name:
        return np.ones(shape, ml_dtypes.bfloat16)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return (rng.standard_normal(shape, np.float32) * std).astype(ml_dtypes.bfloat16)


def write_synthetic(out: str, cfg, shards: int = 4, random: bool = False):
    os.makedirs(out, exist_ok=True)
    shapes = {p: tuple(s.shape) for p, s in abstract_params(cfg).items()}
    specs = {}
    for e in table(cfg):
        piece = e.hf_shape(shapes[e.path][len(e.stack):])
        for _, name in e.pieces(cfg):
            specs[name] = (np.dtype(ml_dtypes.bfloat16), piece)
    names = sorted(specs)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: specs[n] for n in names[i::shards]}
        fill = ((lambda n: random_value(n, specs[n][1])) if random else
                (lambda n: np.full(specs[n][1], pattern_value(n), specs[n][0])))
        write_file(os.path.join(out, fname), fill,
                   metadata={"format": "pt"}, specs=part)
        weight_map.update({n: fname for n in part})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(to_hf_dict(cfg), f, indent=1)
    return sum(int(np.prod(s[1])) * 2 for s in specs.values())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--preset", default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--expert-ffn", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--random", action="store_true", help="seeded random normal values (see above)")
    a = p.parse_args()
    if a.preset:
        cfg = preset(a.preset)
    else:
        cfg = preset("tiny").replace(num_layers=a.layers, hidden_size=a.hidden, num_heads=a.hidden // 64,
                                     num_kv_heads=a.hidden // 64, head_dim=64, intermediate_size=a.expert_ffn,
                                     num_experts=a.experts, vocab_size=a.vocab, mask_token_id=a.vocab - 1,
                                     eos_token_id=a.vocab - 2, pad_token_id=a.vocab - 2)
    n = write_synthetic(a.out, cfg, a.shards, a.random)
    print(f"wrote {n / 2**30:.2f} GiB ({cfg.num_params:,} params) to {a.out}")


if __name__ == "__main__":
    main()
