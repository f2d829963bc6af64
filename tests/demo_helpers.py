"""Shared by the demo-model tests: the shipped model and tokenizer, loaded once per process."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def demo():
    from dinfer_jax import load_model
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    from dinfer_jax.tokenizer import load_tokenizer
    return load_model(DEMO_MODEL_DIR), load_tokenizer(DEMO_MODEL_DIR)
