"""Shared by the demo-model tests: the shipped model and tokenizer, loaded once per process."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def demo():
    from dinfer_jax import load_model
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    from dinfer_jax.tokenizer import load_tokenizer
    return load_model(DEMO_MODEL_DIR), load_tokenizer(DEMO_MODEL_DIR)


def peaky_random_params(cfg, seed: int = 11):
    """Random params peaky enough for threshold decoding to commit several tokens a step: norm
    scales 1 + N(0, 0.1), every other weight N(0, 0.15) (numpy-seeded, the same on every jax)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dinfer_jax.models import init_params
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(cfg, seed=seed))

    def draw(path, a):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(a.shape), a.dtype)
        if "unembedding" in name:  # drawn as the (D, V) LM head of checkpoint format v1: the same model as before
            return jnp.asarray(0.15 * rng.standard_normal(a.shape[::-1]).T, a.dtype)
        return jnp.asarray(0.15 * rng.standard_normal(a.shape), a.dtype)
    return jax.tree_util.tree_map_with_path(draw, shapes)
