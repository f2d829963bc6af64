"""`dinfer-jax convert SRC_HF_DIR DST_DIR` and `dinfer-jax export DIR HF_DIR`."""
from __future__ import annotations

import json
import os

import numpy as np
from tqdm.auto import tqdm

from converters.hf_import import iter_params, open_checkpoint
from converters.mappings import fused_groups, table
from converters.safetensors_io import write_file
from dinfer_jax import checkpoint as ckpt
from dinfer_jax.config import to_hf_dict


def convert(src: str, dst: str, dtype=None, progress: bool = True) -> dict:
    """HF folder -> dinfer-jax checkpoint, one layer slab in memory at a time.

    Returns {path: shape} of the written params.
    """
    cfg, source = open_checkpoint(src)
    with open(os.path.join(src, "config.json")) as f:
        hf_config = json.load(f)
    writer = ckpt.CheckpointWriter(dst)
    try:
        for path, layer, arr in iter_params(cfg, source, dtype, progress):
            writer.add(path, layer, arr)
            del arr
    finally:
        source.close()
    writer.finish(hf_config, src)
    return {p: s["shape"] for p, s in writer.specs.items()}


def export(src: str, dst: str, progress: bool = True):
    """dinfer-jax checkpoint -> HF folder (per-expert names; one safetensors shard per parameter).

    Tensors keep their stored dtype, so HF -> dinfer-jax -> HF is bit-exact.
    """
    if not ckpt.is_checkpoint(src):
        raise FileNotFoundError(f"{src}: not a dinfer-jax checkpoint (no {ckpt.MANIFEST})")
    cfg = ckpt.read_config(src)
    man = ckpt.read_manifest(src)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        hf_config = json.load(f)
    if hf_config.get("architectures", [None])[0] == "FusedLLaDAMoEModelLM":
        hf_config = {**hf_config, "architectures": to_hf_dict(cfg)["architectures"]}
        hf_config.pop("auto_map", None)
    groups = fused_groups(table(cfg))
    n = len(groups)
    weight_map = {}
    for i, group in enumerate(tqdm(groups, desc="export", disable=not progress)):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        parts = []  # per entry of the group: (entry, {name: index}, layered, slab cache)
        for entry in group:
            spec = man["params"][entry.path]
            parts.append((entry, {name: idx for idx, name in entry.pieces(cfg)}, spec["layers"] is not None,
                          {"layer": None, "arr": None}))
        first = man["params"][group[0].path]
        dt, piece = np.dtype(first["dtype"]), tuple(first["shape"])[len(group[0].stack):]
        specs = {name: (dt, group[0].hf_shape(piece)) for name in parts[0][1]}

        def produce(name, parts=parts):
            out = []
            for entry, pieces, layered, slab in parts:  # a fused tensor: its row ranges in order
                idx = pieces[name]
                layer = idx[0] if layered else None
                if slab["arr"] is None or slab["layer"] != layer:  # names sort by layer: one slab at a time
                    slab["layer"], slab["arr"] = layer, ckpt.read_slab(src, entry.path, layer)
                out.append(entry.to_hf(slab["arr"][idx[1:] if layered else idx]))
            return out[0] if len(out) == 1 else np.concatenate(out, axis=0)

        write_file(os.path.join(dst, fname), produce, metadata={"format": "pt"}, specs=specs)
        weight_map.update({name: fname for name in parts[0][1]})
    total = sum(int(np.prod(s["shape"])) * np.dtype(s["dtype"]).itemsize for s in man["params"].values())
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    ckpt.copy_side_files(src, dst)
