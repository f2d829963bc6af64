"""The pieces of uniform-noise canvas denoising with an entropy-bound sampler (DiffusionGemma's
`EntropyBoundSampler` and `StableAndConfidentStoppingCriteria`; docs/diffusion_gemma.md §5).

Shapes: B rows, C canvas positions, V vocabulary; logits are the temperature-scaled ("processed")
fp32 logits of one denoising step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def temperature(step, max_steps, t_min, t_span):
    """Linear schedule over the steps REMAINING (step = N, N-1, ..., 1): t_min + t_span * step / N in
    fp32, t_span = t_max - t_min (step N -> t_max; t_min itself is never reached)."""
    frac = jnp.asarray(step, jnp.float32) / jnp.asarray(max_steps, jnp.float32)
    return jnp.asarray(t_min, jnp.float32) + jnp.asarray(t_span, jnp.float32) * frac


def entropy(logits_BCV):
    """(B, C) entropy of Categorical(logits) in fp32."""
    logp = jax.nn.log_softmax(logits_BCV.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def accept_mask(entropy_BC, bound: float):
    """(B, C) positions accepted: in ascending entropy order, position k is kept iff the sum of the
    entropies strictly before it is <= bound (the lowest-entropy position is always kept)."""
    order = jnp.argsort(entropy_BC, axis=-1)
    sorted_h = jnp.take_along_axis(entropy_BC, order, axis=-1)
    keep_sorted = jnp.cumsum(sorted_h, axis=-1) - sorted_h <= bound
    rows = jnp.arange(entropy_BC.shape[0])[:, None]
    return jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)


def stable_and_confident(history_HBC, argmax_BC, entropy_BC, confidence_threshold: float):
    """-> (stop_B, new history). stable: argmax equals each of the H previous argmax canvases
    (history starts at -1; H = 0 is always stable); confident: mean entropy < threshold."""
    if history_HBC.shape[0] == 0:
        stable = jnp.ones(argmax_BC.shape[:1], bool)
        new_history = history_HBC
    else:
        stable = jnp.all(history_HBC == argmax_BC[None], axis=(0, 2))
        new_history = jnp.concatenate([history_HBC[1:], argmax_BC[None]], axis=0)
    confident = jnp.mean(entropy_BC, axis=-1) < confidence_threshold
    return stable & confident, new_history


def pad_after_eos(canvas_BC, eos_ids_E, pad_id, finished_before_B):
    """The committed canvas with rows finished on an earlier canvas all `pad_id` and every token
    after a row's first EOS `pad_id` (the EOS kept) -> (canvas, has_eos_B). eos_ids_E: -1 = none."""
    eos = jnp.asarray(eos_ids_E, canvas_BC.dtype)
    is_eos = jnp.any((canvas_BC[..., None] == eos) & (eos >= 0), axis=-1)
    seen = jnp.cumsum(is_eos, axis=-1)
    after = (seen > 0) & ~((seen == 1) & is_eos)
    out = jnp.where(finished_before_B[:, None] | after, pad_id, canvas_BC)
    return out, jnp.any(is_eos, axis=-1)
