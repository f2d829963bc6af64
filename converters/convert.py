"""`dinfer-jax convert SRC_HF_DIR DST_DIR` and `dinfer-jax export DIR HF_DIR`, both written atomically
(a non-empty destination is refused unless `overwrite=True`; docs/internals/converters.md).
"""
from __future__ import annotations

import json
import os

import numpy as np
from tqdm.auto import tqdm

from converters import diffusion_gemma
from converters.hf_import import iter_params, open_checkpoint
from converters.mappings import fused_groups, table
from converters.safetensors_io import parse_size, write_sharded
from dinfer_jax import checkpoint as ckpt
from dinfer_jax.atomic import atomic_folder, check_destination, sigint_deferred
from dinfer_jax.families import to_hf_dict
from dinfer_jax.families.diffusion_gemma import is_folder as is_diffusion_gemma
from dinfer_jax.models.quant import SCALE_SUFFIX, check_kind, is_out_first, metadata, quant_dims
from dinfer_jax.models.quant import quantize as quantize_weight


def _same_or_inside(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)


def convert(src: str, dst: str, dtype=None, progress: bool = True, overwrite: bool = False,
            quantize: str | None = None) -> dict:
    """HF folder -> dinfer-jax checkpoint, one layer slab in memory at a time, written atomically.
    quantize: None, "int8" or "fp8" (matmul weights and LM head; models/quant.py); other params are
    cast to `dtype`. Returns {path: shape} of the written params.
    """
    if quantize is not None:
        check_kind(quantize)
    src = ckpt.check_model_folder(src, "source folder")
    check_destination(dst, overwrite)
    if _same_or_inside(src, dst):
        raise ValueError(f"destination {dst!r} and source {src!r} overlap; pick another destination")
    if is_diffusion_gemma(src):
        if quantize is not None:
            raise ValueError(f"{src} is a DiffusionGemma model: --quantize is not built for it (convert without it)")
        return diffusion_gemma.convert(src, dst, dtype, progress, overwrite)
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


def export(src: str, dst: str, progress: bool = True, overwrite: bool = False,
           max_shard_size: int | str = "5GB") -> list[str]:
    """dinfer-jax checkpoint -> HF folder (per-expert names, stored dtypes: bit-exact round trip),
    written atomically and streamed. Sharded like save_pretrained: `max_shard_size` bytes or a string
    ("500MB", "5GB", "2GiB"; safetensors_io.parse_size). Returns the weight file names.
    """
    max_bytes = parse_size(max_shard_size)
    src = ckpt.check_model_folder(src, "checkpoint folder")
    if not ckpt.is_checkpoint(src):
        raise FileNotFoundError(f"{src}: not a dinfer-jax checkpoint (no {ckpt.MANIFEST})")
    check_destination(dst, overwrite)
    if _same_or_inside(src, dst):
        raise ValueError(f"destination {dst!r} and source {src!r} overlap; pick another destination")
    if is_diffusion_gemma(src):
        return diffusion_gemma.export(src, dst, progress, overwrite, max_bytes)
    cfg = ckpt.read_config(src)
    man = ckpt.read_manifest(src)
    if man.get("quantization"):
        raise ValueError(f"{src}: a quantized checkpoint cannot be exported to Hugging Face format; export the "
                         f"unquantized checkpoint")
    with atomic_folder(dst, overwrite) as tmp:
        return _export_into(src, tmp, cfg, man, progress, max_bytes)


class _HFTensors:
    """The HF tensors of a checkpoint: `specs` {name: (dtype, shape)} in table order, `read(name)` (one
    layer slab per param at a time), `release(name)` after a tensor is written."""

    def __init__(self, src: str, cfg, man: dict):
        self.src, self.specs, self.where, self.left, self.slabs = src, {}, {}, {}, {}
        for gi, group in enumerate(fused_groups(table(cfg))):
            parts = [(entry, dict((name, idx) for idx, name in entry.pieces(cfg)),
                      man["params"][entry.path]["layers"] is not None) for entry in group]
            first = man["params"][group[0].path]
            dt, piece = np.dtype(first["dtype"]), tuple(first["shape"])[len(group[0].stack):]
            for name in parts[0][1]:
                self.specs[name] = (dt, group[0].hf_shape(piece))
                self.where[name] = (gi, parts)
            self.left[gi] = len(parts[0][1])

    def read(self, name: str) -> np.ndarray:
        gi, parts = self.where[name]
        out = []
        for entry, pieces, layered in parts:  # a fused tensor: its row ranges in order
            idx = pieces[name]
            layer = idx[0] if layered else None
            slab = self.slabs.get(entry.path)
            if slab is None or slab[0] != layer:
                slab = self.slabs[entry.path] = None  # the old slab goes before the new one is read
                with sigint_deferred():  # not inside orbax's threaded restore
                    slab = self.slabs[entry.path] = (layer, ckpt.read_slab(self.src, entry.path, layer))
            out.append(entry.to_hf(slab[1][idx[1:] if layered else idx]))
        return out[0] if len(out) == 1 else np.concatenate(out, axis=0)

    def release(self, name: str):
        gi, parts = self.where[name]
        self.left[gi] -= 1
        if not self.left[gi]:
            for entry, _, _ in parts:
                self.slabs.pop(entry.path, None)


def _export_into(src: str, dst: str, cfg, man: dict, progress: bool, max_bytes: int) -> list[str]:
    with open(os.path.join(src, "config.json")) as f:
        hf_config = json.load(f)
    if hf_config.get("architectures", [None])[0] == "FusedLLaDAMoEModelLM":
        hf_config = {**hf_config, "architectures": to_hf_dict(cfg)["architectures"]}
        hf_config.pop("auto_map", None)
    tensors = _HFTensors(src, cfg, man)
    bar = tqdm(total=len(tensors.specs), desc="export", unit="tensor", disable=not progress)

    def produce(name):
        arr = tensors.read(name)
        tensors.release(name)
        bar.update()
        return arr

    files = write_sharded(dst, tensors.specs, produce, max_bytes)
    bar.close()
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    ckpt.copy_side_files(src, dst)
    return files
