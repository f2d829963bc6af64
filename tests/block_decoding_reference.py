"""A slow host-loop reference of LLaDA2's block-diffusion generate() (temperature 0), written from
shared/reference/llada2_and_dream.md §4-6 without using dinfer_jax.decoding: one prompt, no
padding, NO cache: every step runs a full block-causal forward over the whole window [0, (b+1)B)
(the prompt and every earlier block recomputed), exactly as the HF generate() does.

Returns (generated tokens cut after the first EOS (inclusive), forwards, edits)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _softmax64(l):
    l = np.asarray(l, np.float64)
    e = np.exp(l - l.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


_FWD = {}


def _forward(model, block: int):
    """jit of the full block-causal forward (one per model and block size; jit only batches the ops)."""
    key = (id(model), block)
    if key not in _FWD:
        module = model.module.clone(attention_block=block)
        _FWD[key] = (model, jax.jit(lambda params, ids: module.apply({"params": params}, ids)[0]))
    return _FWD[key][1]


def reference_block_generate(model, prompt, p):
    cfg = model.config
    M, E, Bk, G = cfg.mask_token_id, cfg.eos_token_id, p.block_length, p.gen_length
    fwd = _forward(model, Bk)
    P = len(prompt)
    nb = -(-(P + G) // Bk)
    x = list(prompt) + [M] * (nb * Bk - P)
    editing = p.editing_threshold is not None
    nfe = edits = 0
    for b in range(P // Bk, nb):
        s, e = b * Bk, (b + 1) * Bk
        post = step = 0
        while True:
            active = [i for i in range(s, e) if x[i] == M]
            if not active:
                if not editing:
                    break
                post += 1
                if post > p.max_post_steps:
                    break
            logits = np.asarray(fwd(model.params, jnp.asarray([x[:e]], jnp.int32)))[0, s:e]
            nfe += 1
            prob = _softmax64(logits)
            v = [int(np.argmax(logits[i - s])) for i in range(s, e)]
            pv = [float(prob[i - s, v[i - s]]) for i in range(s, e)]
            n = p.num_to_transfer
            if p.steps:  # LLaDA2.0 schedule (§5.1): step `step` of the block gets B // steps (+1 early)
                n = max(n, Bk // p.steps + (1 if step < Bk % p.steps else 0))
            high = [i for i in active if pv[i - s] > p.threshold]
            if len(high) >= n:
                m2t = high
            else:
                m2t = sorted(active, key=lambda i: (-pv[i - s], i))[:min(n, len(active))]
            t2t = []
            if editing:
                t2t = [i for i in range(s, e) if i not in active and i >= P
                       and pv[i - s] > p.editing_threshold and v[i - s] != x[i]]
            for i in m2t + t2t:
                x[i] = v[i - s]
            step += 1
            edits += len(t2t)
            if editing and not active and not t2t:
                break
        if p.early_stop and E in x[P:e]:
            break
    gen = x[P:P + G]
    if E in gen:
        gen = gen[:gen.index(E) + 1]
    return gen, nfe, edits
