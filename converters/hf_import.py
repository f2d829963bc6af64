"""Hugging Face folder -> dinfer-jax params, streamed one layer slab at a time (peak host memory: one
slab or one unstacked tensor, plus its source tensor).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
from tqdm.auto import tqdm

from converters.errors import ConversionError
from converters.fused_experts import FusedExpertsView, has_fused_experts
from converters.mappings import IGNORED, Entry, table
from converters.sources import TensorSource, open_source
from dinfer_jax.config import ModelConfig
from dinfer_jax.families import load_hf_config
from dinfer_jax.models import abstract_params


def open_checkpoint(folder: str) -> tuple[ModelConfig, TensorSource]:
    cfg = load_hf_config(folder)
    src = open_source(folder)
    if has_fused_experts(src):
        src = FusedExpertsView(src)
    return cfg, src


def plan(cfg: ModelConfig, src: TensorSource) -> list[tuple[Entry, tuple[int, ...]]]:
    """Check every expected tensor against the headers; one error lists every problem."""
    shapes = {p: tuple(s.shape) for p, s in abstract_params(cfg).items()}
    entries = table(cfg)
    if set(shapes) != {e.path for e in entries}:  # a table/model mismatch is our bug, not the user's
        raise AssertionError(f"mapping table and model params differ: {set(shapes) ^ {e.path for e in entries}}")
    expected, missing, wrong = set(), [], []
    for e in entries:
        piece = shapes[e.path][len(e.stack):]
        want = e.hf_shape(piece)
        for _, name in e.pieces(cfg):
            if name in expected:  # a fused tensor shared by several entries: checked once
                continue
            expected.add(name)
            if name not in src.specs:
                missing.append(name)
            elif tuple(src.specs[name][0]) != want:
                wrong.append(f"{name}: expected shape {list(want)}, found {list(src.specs[name][0])}")
    unexpected = sorted(k for k in src.specs if k not in expected and not IGNORED.match(k))
    if missing or unexpected or wrong:
        parts = []
        for title, items in (("missing tensors", missing), ("unexpected tensors", unexpected),
                             ("wrong shapes", wrong)):
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                parts.append(f"{len(items)} {title}:\n  " + "\n  ".join(shown))
        raise ConversionError(f"checkpoint does not match the {cfg.family} config "
                              f"(layers={cfg.num_layers}, hidden={cfg.hidden_size}, experts={cfg.num_experts}):\n"
                              + "\n".join(parts))
    return [(e, shapes[e.path]) for e in entries]


def iter_params(cfg: ModelConfig, src: TensorSource, dtype=None, progress: bool = True
                ) -> Iterator[tuple[str, int | None, np.ndarray]]:
    """Yield (param path, layer, array) slab by slab: stacked params one layer at a time (layer 0..L_-1,
    no layer axis), others whole (layer None). dtype None keeps the checkpoint dtype, else casts.
    """
    steps = plan(cfg, src)
    total = sum(int(np.prod(s[0])) * s[1].itemsize for s in src.specs.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress) as bar:
        for entry, shape in steps:
            pieces = list(entry.pieces(cfg))
            dt = np.dtype(dtype) if dtype is not None else src.specs[pieces[0][1]][1]
            piece_shape = shape[len(entry.stack):]
            layered = bool(entry.stack) and entry.stack[0] == "l"
            slab_shape = shape[1:] if layered else shape
            per_slab = len(pieces) // shape[0] if layered else len(pieces)
            for first in range(0, len(pieces), per_slab):
                out = np.empty(slab_shape, dt)
                for idx, name in pieces[first:first + per_slab]:
                    arr = src.read(name)
                    out[idx[1:] if layered else idx] = entry.to_ours(arr, piece_shape).astype(dt, copy=False)
                    bar.update(arr.nbytes)
                    del arr
                yield entry.path, (pieces[first][0][0] if layered else None), out
                del out


def stack_slabs(items) -> dict:
    """(path, layer, array) items -> {path: array}, stacking layer slabs on a new axis 0."""
    out, layers = {}, {}
    for path, layer, arr in items:
        if layer is None:
            out[path] = arr
        else:
            layers.setdefault(path, []).append(arr)
    for path, slabs in layers.items():
        out[path] = np.stack(slabs)
    return out


def load_hf_params(folder: str, dtype=None, progress: bool = False) -> tuple[ModelConfig, dict]:
    """Whole params (flat dict path -> numpy) of an HF folder, in memory."""
    cfg, src = open_checkpoint(folder)
    try:
        return cfg, stack_slabs(iter_params(cfg, src, dtype, progress))
    finally:
        src.close()
