"""A slow host-loop reference of Dream's `diffusion_generate` sampler, written from the facts in
docs/facts/llada2_and_dream.md §13.5 without using dinfer_jax.decoding.

One prompt at a time (batch 1, where Dream's batch-mean k is the row's own count), no padding:
canvas = prompt + gen_length masks, positions arange. Each step: one forward, the logits shifted
by one position (row i decodes position i + 1), then the rule of `alg`. The schedule is Dream's
own: t = torch.linspace(1, eps, steps + 1) in float32, k = int(n_masked * (1 - s/t)) in float32
(all at the last step). Deviations, each on purpose:
- ties in the top-k go to the lower position (torch.topk leaves their order unspecified);
- `origin`'s random draws use dinfer-jax's key derivation (uniform(fold_in(fold_in(key(seed),
  step), 2))) instead of torch.rand, so the token-for-token comparison holds; only T = 0.
- blocks: with block_length < gen_length each block runs the schedule with steps // num_blocks
  steps (Dream itself has one block = the whole generation region).
- caches: the K/V of the whole canvas come from a full forward at each block's first step (and,
  vicinity, while fewer than warmup_steps forwards ran); the other steps run a window over that
  cache whose output rows [block start - 1, block end - 1) decode the block (the shift):
  dual [block start - 1, block end), the extra left position a query only (its K/V stay the
  cached ones); prefix [block start - 1, end of canvas), fresh K/V written from the block start
  on; vicinity [block start - prefix_look, block end + after_look), all fresh.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

_APPLY = {}


def _apply(module):
    if id(module) not in _APPLY:
        def f(params, tokens, positions, kv, start, write):
            return module.apply({"params": params}, tokens_BS=tokens, positions_BS=positions, kv=kv,
                                window_start=start, kv_write_BS=write)
        _APPLY[id(module)] = (module, jax.jit(f))
    return _APPLY[id(module)][1]


def softmax(l):
    l = np.asarray(l, np.float64)
    e = np.exp(l - l.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def filtered_probs(logits, top_p, top_k):
    """Dream's nucleus / top-k filters (temperature 0: no division), then softmax; per position."""
    l = np.array(logits, np.float64)
    fmin = np.finfo(np.float32).min
    for r in range(l.shape[0]):
        if top_p < 1.0:
            order = sorted(range(l.shape[1]), key=lambda v: (-l[r, v], v))
            p = softmax(l[r, order])
            mass = 0.0
            drop = []
            for j, v in enumerate(order):
                if j > 0 and mass > top_p:  # the mass BEFORE this token already exceeds top_p
                    drop.append(v)
                mass += p[j]
            l[r, drop] = fmin
        if top_k > 0:
            kth = sorted(l[r], reverse=True)[min(top_k, l.shape[1]) - 1]
            l[r, l[r] < kth] = fmin
    return softmax(l)


def reference_dream(model, prompt, p):
    """-> generation region tokens (list). p: SamplingParams with strategy 'dream', temperature 0."""
    assert p.temperature == 0 and p.cache in ("none", "dual", "prefix", "vicinity")
    cfg, module, params = model.config, model.module, model.params
    M = cfg.mask_token_id
    alg = p.alg or "origin"
    P, G, Bk = len(prompt), p.gen_length, p.block_length
    x = np.array(list(prompt) + [M] * G, np.int64)
    Lx = len(x)
    pos = np.arange(Lx)
    nb = G // Bk
    S = (p.steps or G) // nb
    ts = torch.linspace(1, p.eps, S + 1)  # float32, as Dream
    it = 0
    kv = None
    for b in range(nb):
        s0, e = P + b * Bk, P + (b + 1) * Bk
        for i in range(S):
            if p.cache == "none" or i == 0 or (p.cache == "vicinity" and it < p.warmup_steps):
                raw, kv = _apply(module)(params, jnp.asarray(x[None], jnp.int32), jnp.asarray(pos[None]), None, None,
                                         None)
                raw = np.asarray(raw[0])
                shifted = np.concatenate([raw[:1], raw[:-1]])  # §13.4
                logits = shifted[s0:e]
            else:
                if p.cache == "vicinity":
                    lo, hi = max(0, s0 - p.prefix_look), min(Lx, e + p.after_look)
                else:
                    lo, hi = s0 - 1, (e if p.cache == "dual" else Lx)
                write = np.arange(lo, hi) >= (s0 if p.cache != "vicinity" else lo)
                win, _ = _apply(module)(params, jnp.asarray(x[None, lo:hi], jnp.int32), jnp.asarray(pos[None, lo:hi]),
                                        kv, jnp.asarray(lo, jnp.int32), jnp.asarray(write[None]))
                # rows s0-1 .. e-2 = the shifted logits of s0 .. e-1
                logits = np.asarray(win[0])[s0 - 1 - lo:s0 - 1 - lo + Bk]
            blk = x[s0:e]
            masked = blk == M
            t, s = ts[i], ts[i + 1]
            probs = filtered_probs(logits, p.top_p, p.top_k)
            cand = probs.argmax(-1)
            if alg == "origin":
                p_transfer = float(1 - s / t) if i < S - 1 else 1.0
                key = jax.random.fold_in(jax.random.fold_in(jax.random.key(np.uint32(p.seed)), it), 2)
                u = np.asarray(jax.random.uniform(key, (Bk,)))
                for j in range(Bk):
                    if masked[j] and u[j] < p_transfer:
                        blk[j] = cand[j]
            else:
                if alg == "maskgit_plus":
                    conf = probs.max(-1)
                elif alg == "topk_margin":
                    srt = -np.sort(-probs, -1)
                    conf = srt[:, 0] - srt[:, 1]
                elif alg == "entropy":
                    conf = np.sum(probs * np.log(probs + 1e-10), -1)
                else:
                    raise ValueError(alg)
                n = int(masked.sum())
                k = int(torch.tensor(float(n)) * (1 - s / t)) if i < S - 1 else n
                order = sorted((j for j in range(Bk) if masked[j]), key=lambda j: (-conf[j], j))
                for j in order[:k]:
                    blk[j] = cand[j]
            x[s0:e] = blk
            it += 1
    return x[P:].tolist()
