"""The dinfer-jax checkpoint folder: config.json, the manifest dinfer_jax.json (version 2), one orbax
checkpoint per layer slab under params/, tokenizer files; `upgrade` rewrites a v1 folder as v2.
Layout and rationale: docs/internals/checkpoint.md.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np

from dinfer_jax.config import ConfigError, ModelConfig, read_json
from dinfer_jax.families import load_hf_config

FORMAT, VERSION = "dinfer-jax", 2
# v2 path -> its v1 path; the v1 arrays are the transposes (last two dims) of the v2 ones.
V1_TRANSPOSED = {"lm_head/unembedding": "lm_head/kernel", "lm_head/unembedding@scale": "lm_head/kernel@scale"}
MANIFEST = "dinfer_jax.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
                   "chat_template.json")


# The built-in demo model (trained by `python -m dinfer_jax.train`, docs/user_guide.md) ships inside the package.
DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")
# The block-diffusion demo model (LLaDA2 architecture, block 4; `python -m dinfer_jax.train --block-size 4`).
DEMO_BLOCK_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_block_model")
# Names that stand for the built-in demo models wherever a model folder is accepted (CLI --model,
# load_model, lm-eval's pretrained=); a folder of that name is passed as ./demo.
MODEL_ALIASES = {"demo": DEMO_MODEL_DIR, "demo-block": DEMO_BLOCK_MODEL_DIR}


def model_path(path):
    """A model-folder argument as a path: an alias of MODEL_ALIASES -> its folder; else `path` as given."""
    return MODEL_ALIASES.get(path, path) if isinstance(path, str) else path


def is_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST))


def is_incomplete(folder: str) -> bool:
    """A checkpoint whose writing stopped before the manifest (the last file written)."""
    return os.path.isdir(os.path.join(folder, "params")) and not is_checkpoint(folder)


def check_model_folder(path, what: str = "model folder") -> str:
    """`path` (or the folder of a MODEL_ALIASES name) as a str, or a clear error: not a path,
    missing, a file, an incomplete checkpoint."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{what} must be a path (str or os.PathLike), got {type(path).__name__}")
    path = os.fspath(model_path(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path!r} does not exist (the built-in demo models are "
                                f"{' and '.join(map(repr, MODEL_ALIASES))})")
    if not os.path.isdir(path):
        raise ConfigError(f"{what} {path!r} is a file, not a folder (pass the folder holding config.json)")
    if is_incomplete(path):
        raise ConfigError(f"{path}: incomplete dinfer-jax checkpoint (conversion did not finish): params/ but no "
                          f"{MANIFEST}; delete the folder and convert again")
    return path


def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer()


def copy_side_files(src: str, dst: str):
    for name in TOKENIZER_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst, name))


class CheckpointWriter:
    """Write params slab by slab: `add(path, layer, array)` (layer 0..L_-1 without the layer axis, or
    None for an unstacked param) ..., then `finish(hf_config)`."""

    def __init__(self, folder: str):
        if os.path.exists(folder) and os.listdir(folder):
            raise FileExistsError(f"{folder}: destination exists and is not empty")
        _sync_processes("dinfer_jax_checkpoint_writer_checked")  # every process checked before any writes
        os.makedirs(os.path.join(folder, "params"), exist_ok=True)
        self.folder, self.specs, self.ckptr = folder, {}, _checkpointer()

    def add(self, path: str, layer: int | None, arr: np.ndarray):
        self.ckptr.save(_slab_dir(self.folder, path, layer), {"w": arr})
        self.ckptr.wait_until_finished()
        spec = self.specs.setdefault(path, {"shape": list(arr.shape), "dtype": np.dtype(arr.dtype).name,
                                            "layers": None})
        if layer is not None:
            if spec["layers"] is None:
                spec["layers"], spec["shape"] = 0, [0] + list(arr.shape)
            if layer != spec["layers"]:
                raise ValueError(f"{path}: layer {layer} written out of order (expected {spec['layers']})")
            spec["layers"] += 1
            spec["shape"][0] = spec["layers"]

    def finish(self, hf_config: dict, source_folder: str | None = None, quantization: dict | None = None):
        """quantization: {path: {"kind", "n_in", "n_out"}} of the quantized params (models/quant.py)."""
        if jax.process_index() != 0:  # one writer of the small files on a shared filesystem
            return
        with open(os.path.join(self.folder, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        man = {"format": FORMAT, "version": VERSION, "params": self.specs}
        if quantization:
            man["quantization"] = quantization
        with open(os.path.join(self.folder, MANIFEST), "w") as f:
            json.dump(man, f, indent=1)
        if source_folder:
            copy_side_files(source_folder, self.folder)


def _sync_processes(name: str):
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def save_params(folder: str, params: dict, hf_config: dict, source_folder: str | None = None):
    """Write an in-memory params tree (nested or flat) as a dinfer-jax checkpoint, one layer slab at a
    time; sharded jax.Arrays are saved sharded, and every process must call this."""
    from dinfer_jax.models import flatten
    from dinfer_jax.models.quant import unpack_flat
    flat = flatten(params) if any(isinstance(v, dict) for v in params.values()) else params
    flat, quantization = unpack_flat(flat)
    w = CheckpointWriter(folder)
    for path, arr in flat.items():
        if not isinstance(arr, jax.Array):
            arr = np.asarray(arr)
        if path.startswith("layers/"):
            for i in range(arr.shape[0]):
                w.add(path, i, arr[i])
        else:
            w.add(path, None, arr)
    w.finish(hf_config, source_folder, quantization)


def _slab_dir(folder: str, path: str, layer: int | None) -> str:
    return os.path.join(os.path.abspath(folder), "params", path.replace("/", "."),
                        "all" if layer is None else f"layer_{layer:04d}")


def _v1_as_v2(man: dict) -> dict:
    """A v1 manifest as v2: the LM head entries renamed, their shapes transposed."""
    old = {v: k for k, v in V1_TRANSPOSED.items()}
    params = {}
    for p, spec in man.get("params", {}).items():
        if p in old and isinstance(spec, dict) and isinstance(spec.get("shape"), list) and len(spec["shape"]) == 2:
            spec = dict(spec, shape=spec["shape"][::-1])
        params[old.get(p, p)] = spec
    quant = {old.get(p, p): (dict(m, out_first=True) if p in old and isinstance(m, dict) else m)
             for p, m in (man.get("quantization") or {}).items()}
    return dict(man, version=VERSION, params=params, **({"quantization": quant} if quant else {}))


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    man = read_json(path, "; the checkpoint is damaged, convert it again")
    if isinstance(man, dict) and man.get("format") == FORMAT and man.get("version") == 1:
        man = _v1_as_v2(man)
    if not isinstance(man, dict) or man.get("format") != FORMAT or man.get("version") != VERSION:
        raise ConfigError(f"{path}: not a dinfer-jax v{VERSION} (or v1) manifest")
    if not isinstance(man.get("params"), dict) or not all(
            isinstance(v, dict) and {"shape", "dtype", "layers"} <= set(v) for v in man["params"].values()):
        raise ConfigError(f"{path}: its \"params\" entry is malformed; the checkpoint is damaged, convert it again")
    for p, m in (man.get("quantization") or {}).items():
        if (not isinstance(m, dict) or m.get("kind") not in ("int8", "fp8") or p not in man["params"]
                or p + "@scale" not in man["params"]):
            raise ConfigError(f"{path}: quantization entry {p!r} is malformed or its values / scale leaf is "
                              f"missing; the checkpoint is damaged, convert it again")
    return man


def _committed(slab_dir: str) -> bool:
    """orbax finished writing this slab (its commit marker; also written on local filesystems)."""
    return os.path.isfile(os.path.join(slab_dir, "commit_success.txt"))


def _reads_v1_slab(new_dir: str, old_dir: str) -> bool:
    """Read the v1 slab instead of the v2 one: the v2 slab is missing, or is a partial write of an
    interrupted `upgrade` while the v1 slab is intact."""
    if not os.path.isdir(old_dir):
        return False
    return not os.path.isdir(new_dir) or (not _committed(new_dir) and _committed(old_dir))


def upgrade(folder: str) -> bool:
    """Rewrite a v1 checkpoint folder as v2 in place; False when it is already v2. One process only
    (before a multi-host job, not inside one)."""
    if jax.process_count() > 1:
        raise RuntimeError("checkpoint.upgrade rewrites files in place: run it from one process, not a "
                           f"{jax.process_count()}-process job")
    path = os.path.join(folder, MANIFEST)
    raw = read_json(path, "; the checkpoint is damaged, convert it again")
    if isinstance(raw, dict) and raw.get("version") == VERSION:
        for new, old in V1_TRANSPOSED.items():
            if _committed(_slab_dir(folder, new, None)):
                shutil.rmtree(os.path.dirname(_slab_dir(folder, old, None)), ignore_errors=True)
        return False
    man = read_manifest(folder)
    for new, old in V1_TRANSPOSED.items():
        if new in man["params"] and os.path.isdir(_slab_dir(folder, old, None)):
            d = _slab_dir(folder, new, None)
            shutil.rmtree(d, ignore_errors=True)  # a half-done earlier upgrade
            ck = _checkpointer()
            ck.save(d, {"w": read_slab(folder, new, None)})
            ck.wait_until_finished()
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(man, f, indent=1)
    os.replace(tmp, path)
    for old in V1_TRANSPOSED.values():
        shutil.rmtree(os.path.dirname(_slab_dir(folder, old, None)), ignore_errors=True)
    return True


def read_config(folder: str) -> ModelConfig:
    return load_hf_config(folder)


def read_slab(folder: str, path: str, layer: int | None, sharding=None):
    """One stored slab: numpy, or a jax.Array restored directly into `sharding` (a v1 LM head slab:
    read, transposed, then placed)."""
    d = _slab_dir(folder, path, layer)
    v1 = V1_TRANSPOSED.get(path)
    if v1 and _reads_v1_slab(d, _slab_dir(folder, v1, layer)):
        arr = np.ascontiguousarray(np.swapaxes(read_slab(folder, v1, layer), -1, -2))
        if sharding is None:
            return arr
        from dinfer_jax.sharding import to_global  # each process places only its own shards
        return to_global(arr, sharding)
    if sharding is None:
        return np.asarray(_checkpointer().restore(d)["w"])
    meta = _checkpointer().metadata(d)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    m = tree["w"]
    target = jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding)
    return _checkpointer().restore(d, {"w": target})["w"]


def read_param(folder: str, path: str, sharding=None, dtype=None, manifest: dict | None = None):
    """One whole parameter (layer slabs stacked): numpy when sharding is None, else a jax.Array
    with that sharding (each slab restored directly into the matching sharding of its dims)."""
    spec = (manifest or read_manifest(folder))["params"][path]
    if spec["layers"] is None:
        arr = read_slab(folder, path, None, sharding)
    elif sharding is None:  # filled slab by slab: peak = the stacked array + one slab
        first = read_slab(folder, path, 0)
        arr = np.empty((spec["layers"],) + first.shape, first.dtype)
        arr[0] = first
        del first
        for i in range(1, spec["layers"]):
            arr[i] = read_slab(folder, path, i)
    else:
        from jax.sharding import NamedSharding, PartitionSpec
        slab_sh = (NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
                   if isinstance(sharding, NamedSharding) else sharding)
        slabs = [read_slab(folder, path, i, slab_sh) for i in range(spec["layers"])]
        arr = jax.jit(lambda *xs: jax.numpy.stack(xs), out_shardings=sharding)(*slabs)
    if dtype is not None:
        arr = arr.astype(dtype)
    return arr


def read_params(folder: str, dtype=None, shardings: dict | None = None) -> dict:
    """Flat {path: array | QuantizedWeight} of every parameter, each placed by `shardings` {path:
    Sharding} when given; `dtype` converts the float params (quantized leaves kept as stored)."""
    from dinfer_jax.models.quant import pack_flat
    man = read_manifest(folder)
    return pack_flat({p: read_param(folder, p, (shardings or {}).get(p), None if is_quantized_leaf(man, p) else dtype,
                                    man) for p in man["params"]}, man.get("quantization"))


def is_quantized_leaf(man: dict, path: str) -> bool:
    """Whether a stored leaf is a quantized param's values or scale (kept in its stored dtype)."""
    q = man.get("quantization") or {}
    return path in q or (path.endswith("@scale") and path[:-len("@scale")] in q)




def generation_defaults(folder: str) -> dict:
    """Decoding defaults a model folder recommends: its generation_config.json "dinfer_jax" entry, else
    a block-causal model's attention block as block_length; {} when nothing applies."""
    out = {}
    path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                d = json.load(f).get("dinfer_jax") or {}
            out = {k: d[k] for k in ("gen_length", "block_length") if isinstance(d.get(k), int)}
        except (json.JSONDecodeError, AttributeError):
            out = {}
    if "block_length" not in out:
        try:
            cfg = load_hf_config(folder)
        except (ConfigError, OSError, ValueError):
            return out
        if cfg.attention_mask == "block_causal":
            out["block_length"] = cfg.block_size
    return out
