"""The dinfer-jax checkpoint folder.

  config.json            the model's Hugging Face config (ModelConfig is derived from it)
  dinfer_jax.json        {"format": "dinfer-jax", "version": 1, "params": {path: {shape, dtype}}}
  params/<path>/         one orbax-checkpoint per parameter ('/' in the path -> '.')
  tokenizer files        copied from the source folder when present

One orbax checkpoint per parameter lets conversion and export stream (host memory holds one
stacked parameter at a time) and lets a loader restore each tensor directly into its target
sharding.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np

from dinfer_jax.config import ConfigError, ModelConfig, load_hf_config

FORMAT, VERSION = "dinfer-jax", 1
MANIFEST = "dinfer_jax.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
                   "chat_template.json")


def is_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST))


def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer()


def _tensor_dir(folder: str, path: str) -> str:
    return os.path.join(os.path.abspath(folder), "params", path.replace("/", "."))


def copy_side_files(src: str, dst: str):
    for name in TOKENIZER_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst, name))


class CheckpointWriter:
    """Write params one tensor at a time: `add(path, array)` ..., then `finish(hf_config)`."""

    def __init__(self, folder: str):
        if os.path.exists(folder) and os.listdir(folder):
            raise FileExistsError(f"{folder}: destination exists and is not empty")
        os.makedirs(os.path.join(folder, "params"), exist_ok=True)
        self.folder, self.specs, self.ckptr = folder, {}, _checkpointer()

    def add(self, path: str, arr: np.ndarray):
        self.ckptr.save(_tensor_dir(self.folder, path), {"w": arr})
        self.ckptr.wait_until_finished()
        self.specs[path] = {"shape": list(arr.shape), "dtype": np.dtype(arr.dtype).name}

    def finish(self, hf_config: dict, source_folder: str | None = None):
        with open(os.path.join(self.folder, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        with open(os.path.join(self.folder, MANIFEST), "w") as f:
            json.dump({"format": FORMAT, "version": VERSION, "params": self.specs}, f, indent=1)
        if source_folder:
            copy_side_files(source_folder, self.folder)


def read_manifest(folder: str) -> dict:
    with open(os.path.join(folder, MANIFEST)) as f:
        man = json.load(f)
    if man.get("format") != FORMAT or man.get("version") != VERSION:
        raise ConfigError(f"{folder}: {MANIFEST} is not a dinfer-jax v{VERSION} manifest")
    return man


def read_config(folder: str) -> ModelConfig:
    return load_hf_config(folder)


def read_param(folder: str, path: str, sharding=None, dtype=None):
    """One parameter: numpy (sharding None) or a jax.Array placed with `sharding`."""
    spec = read_manifest(folder)["params"][path] if sharding is not None else None
    ckptr = _checkpointer()
    d = _tensor_dir(folder, path)
    if sharding is None:
        arr = ckptr.restore(d)["w"]
        return np.asarray(arr) if dtype is None else np.asarray(arr).astype(dtype)
    target = jax.ShapeDtypeStruct(tuple(spec["shape"]), np.dtype(spec["dtype"]), sharding=sharding)
    arr = ckptr.restore(d, {"w": target})["w"]
    return arr if dtype is None else arr.astype(dtype)


def read_params(folder: str, dtype=None, shardings: dict | None = None) -> dict:
    """Flat {path: array} of every parameter; `shardings` {path: Sharding} places each directly."""
    man = read_manifest(folder)
    out = {}
    for path in man["params"]:
        sh = (shardings or {}).get(path)
        out[path] = read_param(folder, path, sharding=sh, dtype=dtype)
    return out
