"""`dinfer-jax convert SRC_HF_DIR DST_DIR` and `dinfer-jax export DIR HF_DIR`.

Both write into a temporary sibling of the destination and rename it into place when complete
(dinfer_jax/atomic.py): a failed or killed run leaves no destination, or the old one untouched; a
non-empty destination is refused unless `overwrite=True`, which replaces it whole.
"""
from __future__ import annotations

import json
import os

import numpy as np
from tqdm.auto import tqdm

from converters.hf_import import iter_params, open_checkpoint
from converters.mappings import fused_groups, table
from converters.safetensors_io import write_file
from dinfer_jax import checkpoint as ckpt
from dinfer_jax.atomic import atomic_folder, check_destination, sigint_deferred
from dinfer_jax.config import to_hf_dict
from dinfer_jax.models.quant import SCALE_SUFFIX, check_kind, is_out_first, metadata, quant_dims
from dinfer_jax.models.quant import quantize as quantize_weight


def _same_or_inside(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)


def convert(src: str, dst: str, dtype=None, progress: bool = True, overwrite: bool = False,
            quantize: str | None = None) -> dict:
    """HF folder -> dinfer-jax checkpoint, one layer slab in memory at a time, written atomically.

    quantize: None, "int8" or "fp8": the attention projections, dense / shared / expert MLP weights
    and the LM head are stored quantized (models/quant.py; values + `path@scale` leaves, metadata
    in the manifest), quantized slab by slab from the source's precision; the other params are
    cast to `dtype`. Returns {path: shape} of the written params.
    """
    if quantize is not None:
        check_kind(quantize)
    src = ckpt.check_model_folder(src, "source folder")
    check_destination(dst, overwrite)
    if _same_or_inside(src, dst):
        raise ValueError(f"destination {dst!r} and source {src!r} overlap; pick another destination")
    cfg, source = open_checkpoint(src)
    try:
        with open(os.path.join(src, "config.json")) as f:
            hf_config = json.load(f)
        with atomic_folder(dst, overwrite) as tmp:
            writer = ckpt.CheckpointWriter(tmp)
            quantization = {}
            for path, layer, arr in iter_params(cfg, source, None if quantize else dtype, progress):
                dims = quant_dims(path) if quantize else None
                if quantize and dims is None and dtype is not None:
                    arr = arr.astype(dtype)
                with sigint_deferred():  # Ctrl-C between slabs, never inside orbax's threaded save
                    if dims is None:
                        writer.add(path, layer, arr)
                    else:
                        qw = quantize_weight(arr, quantize, *dims, out_first=is_out_first(path))
                        writer.add(path, layer, qw.q)
                        writer.add(path + SCALE_SUFFIX, layer, qw.scale)
                        quantization[path] = metadata(qw)
                del arr
            writer.finish(hf_config, src, quantization)
    finally:
        source.close()
    return {p: s["shape"] for p, s in writer.specs.items()}


def export(src: str, dst: str, progress: bool = True, overwrite: bool = False):
    """dinfer-jax checkpoint -> HF folder (per-expert names; one safetensors shard per parameter),
    written atomically. Tensors keep their stored dtype, so HF -> dinfer-jax -> HF is bit-exact.
    """
    src = ckpt.check_model_folder(src, "checkpoint folder")
    if not ckpt.is_checkpoint(src):
        raise FileNotFoundError(f"{src}: not a dinfer-jax checkpoint (no {ckpt.MANIFEST})")
    check_destination(dst, overwrite)
    if _same_or_inside(src, dst):
        raise ValueError(f"destination {dst!r} and source {src!r} overlap; pick another destination")
    cfg = ckpt.read_config(src)
    man = ckpt.read_manifest(src)
    if man.get("quantization"):
        raise ValueError(f"{src}: a quantized checkpoint cannot be exported to Hugging Face format; export the "
                         f"unquantized checkpoint")
    with atomic_folder(dst, overwrite) as tmp:
        _export_into(src, tmp, cfg, man, progress)


def _export_into(src: str, dst: str, cfg, man: dict, progress: bool):
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
                    with sigint_deferred():  # not inside orbax's threaded restore
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
