"""A slow, obviously-correct host-loop reference of the decoding algorithms (temperature 0).

One prompt at a time, plain Python/numpy, written from docs/facts/decoding.md without
using dinfer_jax.decoding. Each step runs a forward through the model's public apply():
- cache "none": a full forward over prompt + generation region (no padding at all);
- "dual" / "prefix" / "vicinity": the cached window forward, with K/V refreshed by a full forward
  on block entry (and every `refresh_every` steps / during vicinity warmup), as dInfer does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


_APPLY = {}


def _apply(module):
    """jit(module.apply) for the reference's forwards (jit only batches the ops; same math)."""
    if id(module) not in _APPLY:
        def f(params, inputs, positions, kv, start):
            return module.apply({"params": params}, positions_BS=positions, kv=kv, window_start=start, **inputs)
        _APPLY[id(module)] = (module, jax.jit(f))
    return _APPLY[id(module)][1]


def softmax(l):
    l = np.asarray(l, np.float64)
    e = np.exp(l - l.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def transfer_counts(n, steps):
    """LLaDA get_num_transfer_tokens for one row."""
    return [n // steps + (1 if i < n % steps else 0) for i in range(steps)]


def choose(kind, logits, x_blk, mask_id, p, step, quota, tau, credit):
    """-> (positions to unmask: list of int, candidates: array). Loops, not vector tricks."""
    S = len(x_blk)
    masked = [x_blk[i] == mask_id for i in range(S)]
    if kind == "credit":
        if step > 0:
            credit *= p.credit_beta
        else:
            credit[:] = 0.0
        prob = softmax(logits)
        for i in range(S):
            if masked[i]:
                k = int(np.argmax(prob[i]))
                credit[i, k] += prob[i, k] ** p.credit_gamma
        logits = logits + p.credit_alpha * np.log1p(credit)
    prob = softmax(logits)
    cand = np.argmax(logits, -1)
    conf = [float(prob[i, cand[i]]) for i in range(S)]
    if kind == "fixed":
        order = sorted([i for i in range(S) if masked[i]], key=lambda i: (-conf[i], i))
        return order[:quota], cand
    elig = [masked[i] and cand[i] != mask_id for i in range(S)]
    if not any(elig):
        if not any(masked):
            return [], cand
        no_mask = logits.copy()
        no_mask[:, mask_id] = -np.inf
        alt = np.argmax(no_mask, -1)
        best = max((i for i in range(S) if masked[i]), key=lambda i: (prob[i, alt[i]], -i))
        cand = cand.copy()
        cand[best] = alt[best]
        return [best], cand
    c = [conf[i] if elig[i] else -np.inf for i in range(S)]
    top = max(range(S), key=lambda i: (c[i], -i))
    if kind in ("threshold", "credit"):
        t = max(min(max(c) - 1e-5, tau), -1000.0)
        return [i for i in range(S) if elig[i] and c[i] >= t], cand
    if kind == "factor":
        order = sorted([i for i in range(S) if elig[i]], key=lambda i: (-c[i], i))
        take = 1
        while take < len(order) and c[order[take]] >= 1 - p.factor / (take + 2):
            take += 1
        return order[:take], cand
    if kind == "hierarchy":
        chosen = {top}
        i = 0
        while i < S:  # walk maximal runs of masked positions
            if not masked[i]:
                i += 1
                continue
            j = i
            while j < S and masked[j]:
                j += 1
            best = max(range(i, j), key=lambda k: (c[k], -k))
            if elig[best] and c[best] > p.low_threshold:
                chosen.add(best)
            i = j
        chosen |= {k for k in range(S) if elig[k] and c[k] > tau}
        return sorted(chosen), cand
    raise ValueError(kind)


def log_softmax(l):
    """float64 log_softmax over the last axis (numpy; independent of the loop's jax.nn.log_softmax)."""
    l = np.asarray(l, np.float64)
    m = l.max(-1, keepdims=True)
    return l - m - np.log(np.exp(l - m).sum(-1, keepdims=True))


def reference_generate(model, prompt, p, record=None):
    """-> (generation region tokens (list), number of forwards). Temperature 0 only.
    record: a dict to fill with the commit record over the generation region: "steps" (the
    forward, 0-based, that wrote each position; -1: never written), "logprobs" (float64
    log_softmax of the logits that step decoded from, at the written token; NaN: never written)
    and "top" (per position, the (token, logprob) pairs by descending logprob, ties: lower id)."""
    assert p.temperature == 0
    cfg, module, params = model.config, model.module, model.params
    M, eos = cfg.mask_token_id, cfg.eos_token_id
    P, G, Bk = len(prompt), p.gen_length, p.block_length
    x = np.array(list(prompt) + [M] * G, np.int64)
    L = len(x)
    pos = np.arange(L)
    nb = G // Bk
    S_fixed = (p.steps if p.steps else G) // nb
    first = (P // Bk) * Bk if p.start_block_align else P
    table = np.asarray(params["embed"]["embedding"], np.float64)
    soft = np.zeros((L, cfg.hidden_size))
    nfe, it = 0, 0
    kv = None
    steps, lps, tops = [-1] * G, [float("nan")] * G, [[] for _ in range(G)]

    def forward(lo, hi, cache):
        """Logits for positions [lo, hi); cache None -> full forward (returns fresh K/V too)."""
        toks = x[None, lo:hi] if cache is not None else x[None]
        if p.smoothing:
            w = min(0.15 + 0.02 * it, p.cont_weight)
            emb = table[x].copy()
            m = x == M
            emb[m] = table[M] + w * soft[m]
            kw = dict(embeds_BSD=jnp.asarray(emb[None, lo:hi] if cache is not None else emb[None], jnp.float32))
        else:
            kw = dict(tokens_BS=jnp.asarray(toks, jnp.int32))
        if cache is None:
            logits, new_kv = _apply(module)(params, kw, jnp.asarray(pos[None]), None, None)
            return np.asarray(logits[0], np.float64), new_kv
        logits, _ = _apply(module)(params, kw, jnp.asarray(pos[None, lo:hi]), cache, jnp.asarray(lo, jnp.int32))
        return np.asarray(logits[0], np.float64), None

    for s in range(first, P + G, Bk):
        e = min(s + Bk, P + G)
        credit = np.zeros((e - s, cfg.vocab_size))
        n_entry = int(np.sum(x[s:e] == M))
        quotas = transfer_counts(n_entry, S_fixed)
        step = 0
        while True:
            full = (p.cache == "none" or step == 0 or (p.refresh_every and step % p.refresh_every == 0)
                    or (p.cache == "vicinity" and it < p.warmup_steps))
            if full:
                all_logits, fresh = forward(0, L, None)
                if p.cache != "none":
                    kv = fresh
                logits = all_logits[s:e]
                if p.smoothing:
                    soft = softmax(all_logits) @ table
            else:
                lo, hi = {"dual": (s, e), "prefix": (s, L),
                          "vicinity": (max(0, s - p.prefix_look), min(L, e + p.after_look))}[p.cache]
                win_logits, _ = forward(lo, hi, kv)
                logits = win_logits[s - lo:e - lo]
                if p.smoothing:
                    soft[lo:hi] = softmax(win_logits) @ table
            tau = max(1 - 0.02 * it, p.threshold) if p.smoothing else p.threshold
            quota = quotas[step] if p.strategy == "fixed" else 0
            picks, cand = choose(p.strategy, logits, x[s:e], M, p, step, quota, tau, credit)
            for i in picks:
                x[s + i] = cand[i]
                lsm = log_softmax(logits[i])
                steps[s + i - P], lps[s + i - P] = it, float(lsm[cand[i]])
                tops[s + i - P] = [(int(t), float(lsm[t])) for t in np.argsort(-lsm, kind="stable")]
            nfe += 1
            it += 1
            step += 1
            if (step >= S_fixed) if p.strategy == "fixed" else not np.any(x[s:e] == M):
                break
        if p.early_stop and np.any(x[max(s, P):e] == eos):  # EOS generated in this block (not prompt EOS)
            x[e:] = eos
            break
    if record is not None:
        record.update(steps=steps, logprobs=lps, top=tops)
    return x[P:].tolist(), nfe
