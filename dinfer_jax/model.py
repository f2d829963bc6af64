"""`load_model(path) -> Model`: a dinfer-jax checkpoint or a plain Hugging Face folder."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import checkpoint as ckpt
from dinfer_jax.config import ModelConfig
from dinfer_jax.models import Transformer, unflatten


def default_dtype():
    """fp32 on CPU, bf16 on accelerators (DESIGN.md numerics)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


@dataclass
class Model:
    """A config plus an explicit params pytree. `logits(ids)` runs the full bidirectional forward."""
    config: ModelConfig
    params: dict
    moe_impl: str = "auto"
    attention_impl: str = "auto"

    @property
    def dtype(self):
        return jax.tree_util.tree_leaves(self.params)[0].dtype

    @functools.cached_property
    def module(self) -> Transformer:
        return Transformer(self.config, moe_impl=self.moe_impl, dtype=self.dtype, attention_impl=self.attention_impl)

    @functools.cached_property
    def _forward(self):
        return jax.jit(lambda p, t, m: self.module.apply({"params": p}, t, key_mask_BL=m)[0])

    @functools.cached_property
    def generator(self):
        """The compiled-program cache used by `dinfer_jax.generate`."""
        from dinfer_jax.engine import Generator
        return Generator(self)

    def check_ids(self, ids) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
        if arr.ndim not in (1, 2) or arr.size == 0:
            raise ValueError(f"token ids must be a non-empty (L,) or (B, L) array, got shape {arr.shape}")
        bad = (arr < 0) | (arr >= self.config.vocab_size)
        if bad.any():
            raise ValueError(f"token id {int(arr[bad].flat[0])} is out of the vocabulary "
                             f"[0, {self.config.vocab_size}) ({int(bad.sum())} bad ids)")
        if arr.shape[-1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {arr.shape[-1]} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        return arr.astype(np.int32)

    def logits(self, ids, key_mask=None) -> np.ndarray:
        """ids (L,) or (B, L) ints -> fp32 logits (L, V) or (B, L, V). key_mask: True = attend."""
        arr = self.check_ids(ids)
        squeeze = arr.ndim == 1
        arr2 = arr[None] if squeeze else arr
        mask = None if key_mask is None else jnp.asarray(np.asarray(key_mask, bool).reshape(arr2.shape))
        out = np.asarray(self._forward(self.params, jnp.asarray(arr2), mask))
        return out[0] if squeeze else out


def load_model(path: str, dtype=None, moe_impl: str = "auto", attention_impl: str = "auto",
               progress: bool = False) -> Model:
    """Load a dinfer-jax checkpoint (converted by `dinfer-jax convert`) or a plain HF folder
    (converted on the fly, in memory). dtype: params dtype (default fp32 on CPU, bf16 elsewhere)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder {path!r} does not exist")
    dtype = default_dtype() if dtype is None else dtype
    if ckpt.is_checkpoint(path):
        cfg = ckpt.read_config(path)
        flat = ckpt.read_params(path)
    else:
        from converters.hf_import import load_hf_params
        cfg, flat = load_hf_params(path, progress=progress)
    params = unflatten({k: jnp.asarray(v, dtype=dtype) for k, v in flat.items()})
    return Model(cfg, params, moe_impl, attention_impl)
