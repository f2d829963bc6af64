"""Pure-functional Flax Linen models."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dinfer_jax.config import ModelConfig
from dinfer_jax.models.transformer import Transformer

__all__ = ["Transformer", "abstract_params", "flatten", "unflatten", "init_params"]


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """{'/'-joined path: ShapeDtypeStruct} of the model's params (no memory allocated)."""
    tree = jax.eval_shape(lambda: nn.meta.unbox(
        Transformer(cfg, dtype=dtype).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]))
    return flatten(tree)


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """Random params (normal 0.02, norms 1) as a nested dict."""
    return nn.meta.unbox(Transformer(cfg, dtype=dtype).init(
        jax.random.key(seed), jnp.zeros((1, 1), jnp.int32))["params"])


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        p = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, p))
        else:
            out[p] = v
    return out


def unflatten(flat: dict) -> dict:
    out: dict = {}
    for p, v in flat.items():
        node = out
        *parents, leaf = p.split("/")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = v
    return out
