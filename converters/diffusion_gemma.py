"""DiffusionGemma's `convert` (HF folder -> dinfer-jax checkpoint) and `export` (back to HF
safetensors), text part only, one conversion group (the globals, then one layer) in memory at a
time; the names and layouts are families/diffusion_gemma.py's group_from_hf / group_to_hf."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
from tqdm.auto import tqdm

from converters.safetensors_io import write_sharded
from converters.sources import open_source
from dinfer_jax import checkpoint as ckpt
from dinfer_jax.atomic import atomic_folder, sigint_deferred
from dinfer_jax.families import diffusion_gemma as dg
from dinfer_jax.models import flatten, unflatten


def convert(src: str, dst: str, dtype=None, progress: bool = True, overwrite: bool = False) -> dict:
    """HF DiffusionGemma folder -> dinfer-jax checkpoint (params in `dtype`, default as stored; the
    vision tower is left out). Returns {path: shape} of the written params."""
    with open(os.path.join(src, "config.json")) as f:
        hf_config = json.load(f)
    cfg, _ = dg.config_from_hf(hf_config)
    source = open_source(src)
    get = dg.tensor_getter(src, source)
    try:
        with atomic_folder(dst, overwrite) as tmp:
            writer = ckpt.CheckpointWriter(tmp)
            for group in tqdm(dg.groups(cfg), desc="convert", unit="group", disable=not progress):
                tree = dg.group_from_hf(get, cfg, group, dtype)
                for path, arr in flatten(tree).items():
                    with sigint_deferred():  # Ctrl-C between slabs, never inside orbax's threaded save
                        writer.add(path, None, np.asarray(arr))
                del tree
            writer.finish(hf_config, src)
    finally:
        source.close()
    return {p: s["shape"] for p, s in writer.specs.items()}


def export(src: str, dst: str, progress: bool, overwrite: bool, max_bytes: int) -> list[str]:
    """dinfer-jax DiffusionGemma checkpoint -> HF safetensors folder (the text weights under the
    names save_pretrained writes, stored dtypes: a bit-exact round trip), sharded at `max_bytes`.
    Returns the weight file names."""
    with open(os.path.join(src, "config.json")) as f:
        hf_config = json.load(f)
    cfg, _ = dg.config_from_hf(hf_config)
    man = ckpt.read_manifest(src)
    stored = {p: jax.ShapeDtypeStruct(tuple(s["shape"]), np.dtype(s["dtype"])) for p, s in man["params"].items()}
    paths = {g: [p for p in stored if p.split("/")[0] in dg.group_keys(g)] for g in dg.groups(cfg)}
    specs, group_of = {}, {}
    for group in dg.groups(cfg):
        abstract = unflatten({p: stored[p] for p in paths[group]})
        for name, sds in jax.eval_shape(lambda t, g=group: dg.group_to_hf(t, cfg, g), abstract).items():
            specs[name], group_of[name] = (sds.dtype, sds.shape), group
    current: dict = {}
    bar = tqdm(total=len(specs), desc="export", unit="tensor", disable=not progress)

    def produce(name):  # a group's tensors are built when its first one is written
        group = group_of[name]
        if group not in current:
            current.clear()
            with sigint_deferred():
                tree = unflatten({p: ckpt.read_param(src, p, None, None, man) for p in paths[group]})
            current[group] = {k: np.asarray(v) for k, v in dg.group_to_hf(tree, cfg, group).items()}
        bar.update()
        return current[group].pop(name)

    with atomic_folder(dst, overwrite) as tmp:
        files = write_sharded(tmp, specs, produce, max_bytes)
        bar.close()
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        ckpt.copy_side_files(src, tmp)
    return files

