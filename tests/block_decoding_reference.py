"""A slow host-loop reference of LLaDA2's block-diffusion generate() (temperature 0), written from
docs/facts/llada2_and_dream.md §4-6 without using dinfer_jax.decoding: one prompt, no
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


def _cut(x, P: int, G: int, E: int) -> list:
    """The generated tokens x[P:P+G], cut after the first EOS (inclusive)."""
    gen = x[P:P + G]
    return gen[:gen.index(E) + 1] if E in gen else gen


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
            if any(v[i - s] == M for i in m2t):  # would never unmask: the test model must not predict it
                raise AssertionError(f"the test model predicts the mask id at block {b}; pick other weights")
            for i in m2t + t2t:
                x[i] = v[i - s]
            step += 1
            edits += len(t2t)
            if editing and not active and not t2t:
                break
        if p.early_stop and E in x[P:e]:
            break
    return _cut(x, P, G, E), nfe, edits


def reference_indel_generate(model, prompt, p, delete_id: int, split_id: int):
    """LLaDA2.2 insert/delete editing (SGLang `joint_threshold_indel.py`, greedy), written from the
    facts in docs/facts/llada2_and_dream.md §7.1 and that file, one prompt, NO cache (every
    step a full block-causal forward over [0, (b+1)B)). Blocks end at the cleanup step or at a step
    that writes nothing; the forward SGLang adds to persist a changed block's K/V is not counted
    (our loop commits it inside the next block's first forward).

    Returns (generated tokens cut after the first EOS (inclusive), forwards, counts) with counts =
    dict(edits, inserts, deletes, antiloop, cleanups)."""
    cfg = model.config
    M, E, Bk, G = cfg.mask_token_id, cfg.eos_token_id, p.block_length, p.gen_length
    D, SP = delete_id, split_id
    thr = p.threshold
    eth = 0.0 if p.editing_threshold is None else p.editing_threshold
    maxpost, base = p.max_post_steps, p.num_to_transfer
    fwd = _forward(model, Bk)
    P = len(prompt)
    nb = -(-(P + G) // Bk)
    x = list(prompt) + [M] * (nb * Bk - P)
    nfe = 0
    cnt = dict(edits=0, inserts=0, deletes=0, antiloop=0, cleanups=0)
    for b in range(P // Bk, nb):
        s, e = b * Bk, (b + 1) * Bk
        npr = max(0, P - s)  # the block's prompt prefix
        orig = [i >= npr and x[s + i] == M for i in range(Bk)]
        post = nup = 0
        seen, history = set(), {}
        while True:
            blk = x[s:e]
            logits = np.asarray(fwd(model.params, jnp.asarray([x[:e]], jnp.int32)))[0, s:e].astype(np.float64)
            nfe += 1
            prob = _softmax64(logits)
            v = [int(np.argmax(logits[i])) for i in range(Bk)]
            pv = [float(prob[i, v[i]]) for i in range(Bk)]
            masks = [i for i in range(npr, Bk) if blk[i] == M]
            omasks = [i for i in masks if orig[i]]
            nup += 1
            if not omasks:
                post += 1
            cleanup = (maxpost > 0 and post >= maxpost) or (maxpost == 0 and not omasks) or nup > Bk + maxpost

            def argmax_without(i, banned):
                row = logits[i].copy()
                row[list(banned)] = -np.inf
                return int(np.argmax(row))

            if not cleanup:
                for i in omasks:
                    if v[i] == M:
                        v[i] = argmax_without(i, {M})
                        pv[i] = float(prob[i, v[i]])
            if cleanup or not omasks:
                m2t = set(masks)
            else:
                need = base + len(masks) - len(omasks)
                high = [i for i in masks if pv[i] > thr]
                m2t = set(high) if len(high) >= need else set(
                    sorted(masks, key=lambda i: (-pv[i], i))[:min(need, len(masks))])
                if maxpost == 0 and set(omasks) <= m2t:
                    cleanup, m2t = True, set(masks)
            t2t = {i for i in range(npr, Bk) if blk[i] != M and pv[i] > eth and v[i] != blk[i]}
            writes = sorted(m2t | t2t)
            if not writes:
                break
            if cleanup:
                for i in writes:
                    if v[i] in (M, D, SP):
                        v[i] = argmax_without(i, {M, D, SP})
            key = tuple(blk)
            if key in seen and not cleanup:
                changing = [i for i in writes if v[i] != blk[i]]
                if changing:
                    c = min(changing, key=lambda i: (pv[i], i))
                    banned = set(history.get(c, ())) | ({M} if c in omasks else set())
                    v[c] = argmax_without(c, banned)
                    cnt["antiloop"] += 1
            seen.add(key)
            new = list(blk)
            for i in writes:
                history.setdefault(i, set()).add(v[i])
                new[i] = v[i]
            cnt["edits"] += len(t2t)
            if any(new[i] in (D, SP) for i in writes):
                cnt["inserts"] += sum(new[i] == SP for i in writes)
                cnt["deletes"] += sum(new[i] == D for i in writes)
                toks, flags = blk[:npr], orig[:npr]
                for i in range(npr, Bk):
                    if new[i] == D:
                        continue
                    if new[i] == SP:
                        toks, flags = toks + [M, blk[i]], flags + [False, orig[i]]
                    else:
                        toks, flags = toks + [new[i]], flags + [orig[i]]
                toks, flags = (toks + [M] * Bk)[:Bk], (flags + [False] * Bk)[:Bk]
                new, orig = toks, flags
            x[s:e] = new
            if cleanup:
                cnt["cleanups"] += 1
                break
        if p.early_stop and E in x[P:e]:
            break
    return _cut(x, P, G, E), nfe, cnt
