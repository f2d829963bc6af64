"""Decoding strategies: pure functions from one block's logits to the tokens to unmask.
logits_BSV (fp32) for each row's S block positions, x_BS its current tokens (masked: x == mask_id);
every strategy returns (cand_BS, transfer_BS); per-row knobs are (B,) arrays. The definitions
(fixed, threshold, factor, credit, hierarchy, dream) and the progress guarantee:
docs/internals/decoding_loops.md, sourced in docs/facts/decoding.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dinfer_jax.decoding.spec import DREAM_ALGS, FIXED, STRATEGIES

NEG_INF = -jnp.inf


def num_transfer_tokens(n_masks_B, steps: int, step_B):
    """LLaDA get_num_transfer_tokens: step i of `steps` unmasks floor(n/steps) + [i < n mod steps]."""
    return n_masks_B // steps + (step_B < n_masks_B % steps).astype(n_masks_B.dtype)


def gumbel_candidates(logits_BSV, temperature_B, keys_B):
    """x^ = argmax(l + T*g) per row; rows with T == 0 take argmax l (no noise drawn if all are 0)."""
    def noisy(_):
        g = jax.vmap(lambda k: jax.random.gumbel(k, logits_BSV.shape[1:], jnp.float32))(keys_B)
        return logits_BSV + temperature_B[:, None, None] * g
    scores = jax.lax.cond(jnp.any(temperature_B > 0), noisy, lambda _: logits_BSV, None)
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def confidence(logits_BSV, cand_BS):
    """softmax(l)[cand] in fp32 (computed as exp(l[cand] - logsumexp l))."""
    l = logits_BSV.astype(jnp.float32)
    picked = jnp.take_along_axis(l, cand_BS[..., None], axis=-1)[..., 0]
    return jnp.exp(picked - jax.nn.logsumexp(l, axis=-1))


def rank_desc(score_BS):
    """0-based rank of each position by descending score (ties: lower position first)."""
    order = jnp.argsort(-score_BS, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def fixed_transfer(conf_BS, masked_BS, quota_B):
    """Top-`quota` masked positions by confidence."""
    c = jnp.where(masked_BS, conf_BS, NEG_INF)
    return masked_BS & (rank_desc(c) < quota_B[:, None])


def threshold_transfer(conf_BS, eligible_BS, tau_B):
    c = jnp.where(eligible_BS, conf_BS, NEG_INF)
    tau_eff = jnp.maximum(jnp.minimum(jnp.max(c, axis=-1) - 1e-5, tau_B), -1000.0)
    return eligible_BS & (c >= tau_eff[:, None])


def factor_transfer(conf_BS, eligible_BS, factor_B):
    c = jnp.where(eligible_BS, conf_BS, NEG_INF)
    S = c.shape[-1]
    srt = -jnp.sort(-c, axis=-1)  # descending
    n = jnp.arange(1, S + 1, dtype=jnp.float32)  # 1-based rank
    ok = (srt >= 1.0 - factor_B[:, None] / (n + 1.0)) | (n == 1)
    ok &= srt > NEG_INF
    n_accept = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
    return eligible_BS & (rank_desc(c) < n_accept[:, None])


def hierarchy_transfer(conf_BS, masked_BS, eligible_BS, tau_B, low_B):
    c = jnp.where(eligible_BS, conf_BS, NEG_INF)
    S = c.shape[-1]
    prev = jnp.pad(masked_BS[:, :-1], ((0, 0), (1, 0)))
    seg = jnp.cumsum(masked_BS & ~prev, axis=-1) * masked_BS  # run ids 1..; 0 = not masked
    pos = jnp.arange(S)

    def row(c_S, seg_S):
        best = jax.ops.segment_max(c_S, seg_S, num_segments=S + 1)
        is_best = c_S == best[seg_S]
        first = jax.ops.segment_min(jnp.where(is_best, pos, S), seg_S, num_segments=S + 1)
        return pos == first[seg_S]

    winners = jax.vmap(row)(c, seg) & masked_BS & eligible_BS & (c > low_B[:, None])
    top = (pos[None, :] == jnp.argmax(c, axis=-1)[:, None]) & jnp.any(eligible_BS, axis=-1, keepdims=True)
    return eligible_BS & (winners | (c > tau_B[:, None]) | top)


def credit_update(credit_BSV, logits_BSV, masked_BS, first_B, gamma_B, beta_B):
    """EMA evidence: decay (except on a block's first call), then add max(p)^gamma at argmax p."""
    credit = jnp.where(first_B[:, None, None], 0.0, credit_BSV * beta_B[:, None, None])
    p = jax.nn.softmax(logits_BSV.astype(jnp.float32), axis=-1)
    top = jnp.argmax(p, axis=-1)
    bonus = jnp.where(masked_BS, jnp.max(p, axis=-1) ** gamma_B[:, None], 0.0)
    return credit + jax.nn.one_hot(top, p.shape[-1], dtype=jnp.float32) * bonus[..., None]


def forbid_eos(logits_BSV, gen_pos_BS, eos_id: int, knobs):
    """EOS logit -> -inf (before sampling and confidence, as the peers' logits_eos_inf) where the
    row has ignore_eos, or the position's index in the generation region is < its min_tokens.
    gen_pos_BS: generated-position index of each block position (negative inside the prompt)."""
    if eos_id < 0:
        return logits_BSV
    forbid = (knobs.ignore_eos[:, None] > 0) | (gen_pos_BS < knobs.min_tokens[:, None])
    return logits_BSV.at[..., eos_id].set(jnp.where(forbid, NEG_INF, logits_BSV[..., eos_id]))


def decide(kind: str, logits_BSV, x_BS, mask_id: int, knobs, *, keys_B, step_B, quota_B, tau_B,
           credit_BSV=None):
    """One strategy step on one block per row -> (cand_BS, transfer_BS, new_credit_BSV | None).

    knobs: per-row arrays temperature, low_threshold, factor, credit_alpha/gamma/beta.
    tau_B: the threshold in force (the iteration-smoothing schedule may raise it).
    """
    masked = x_BS == mask_id
    logits = logits_BSV.astype(jnp.float32)
    new_credit = None
    if kind == "credit":
        new_credit = credit_update(credit_BSV, logits, masked, step_B == 0, knobs.credit_gamma,
                                   knobs.credit_beta)
        logits = logits + knobs.credit_alpha[:, None, None] * jnp.log1p(new_credit)
    cand = gumbel_candidates(logits, knobs.temperature, keys_B)
    conf = confidence(logits, cand)
    if kind in FIXED:
        if kind == "random":
            conf = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), x_BS.shape[1:]))(keys_B)
        return cand, fixed_transfer(conf, masked, quota_B), new_credit
    eligible = masked & (cand != mask_id)
    if kind in ("threshold", "credit"):
        transfer = threshold_transfer(conf, eligible, tau_B)
    elif kind == "factor":
        transfer = factor_transfer(conf, eligible, knobs.factor)
    elif kind == "hierarchy":
        transfer = hierarchy_transfer(conf, masked, eligible, tau_B, knobs.low_threshold)
    else:
        raise ValueError(f"unknown strategy {kind!r}; choose one of {STRATEGIES}")
    # Progress guarantee when every masked argmax is the mask token.
    stuck = ~jnp.any(eligible, axis=-1) & jnp.any(masked, axis=-1)
    no_mask = logits.at[..., mask_id].set(NEG_INF)
    alt = jnp.argmax(no_mask, axis=-1).astype(jnp.int32)
    alt_conf = jnp.where(masked, confidence(logits, alt), NEG_INF)
    alt_pick = jnp.arange(x_BS.shape[1])[None, :] == jnp.argmax(alt_conf, axis=-1)[:, None]
    transfer = jnp.where(stuck[:, None], alt_pick & masked, transfer)
    cand = jnp.where(stuck[:, None], alt, cand)
    return cand, transfer, new_credit


# ---------------------------------------------------------------------------------------------
# Dream (docs/facts/llada2_and_dream.md §13.5)


def torch_linspace_f32(start, end, num: int, i):
    """Element i of torch.linspace(start, end, num) in float32 by torch's scalar formula (first half
    up from start, second half down from end; vs torch's kernels: docs/internals/decoding_loops.md)."""
    start = jnp.asarray(start, jnp.float32)
    end = jnp.asarray(end, jnp.float32)
    step = (end - start) / jnp.float32(num - 1)
    i = jnp.asarray(i, jnp.int32)
    up = start + step * i.astype(jnp.float32)
    down = end - step * (num - 1 - i).astype(jnp.float32)
    return jnp.where(i < num // 2, up, down)


def dream_schedule(eps_B, steps: int, step_B, n_masked_B):
    """Dream's schedule at step i of `steps` -> (fraction_B fp32 = 1 - s/t, k_B int32 = int(n * fraction),
    n the row's own masked count; all n at the last step). Formula: docs/internals/decoding_loops.md."""
    t = torch_linspace_f32(1.0, eps_B, steps + 1, step_B)
    s = torch_linspace_f32(1.0, eps_B, steps + 1, step_B + 1)
    last = step_B >= steps - 1
    frac = jnp.where(last, 1.0, 1.0 - s / t).astype(jnp.float32)
    k = jnp.floor(n_masked_B.astype(jnp.float32) * frac).astype(jnp.int32)
    return frac, jnp.where(last, n_masked_B, k)


def dream_filter(logits_BSV, temperature_B, top_p_B, top_k_B):
    """Dream's logits processing: / T (T > 0), nucleus top_p (< 1), top_k (> 0); dropped logits become
    float32 min, also at T = 0 (rules: docs/internals/decoding_loops.md)."""
    l = logits_BSV.astype(jnp.float32)
    T = temperature_B[:, None, None]
    l = jnp.where(T > 0, l / jnp.where(T > 0, T, 1.0), l)
    fmin = jnp.finfo(jnp.float32).min
    V = l.shape[-1]

    def nucleus(l):
        order = jnp.argsort(-l, axis=-1, stable=True)
        srt = jnp.take_along_axis(l, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
        drop_sorted = jnp.concatenate([jnp.zeros_like(cum[..., :1], bool),
                                       cum[..., :-1] > top_p_B[:, None, None]], axis=-1)
        inv = jnp.argsort(order, axis=-1)
        drop = jnp.take_along_axis(drop_sorted, inv, axis=-1) & (top_p_B[:, None, None] < 1.0)
        return jnp.where(drop, fmin, l)

    def top_k(l):
        k = jnp.clip(top_k_B.astype(jnp.int32), 1, V)[:, None, None]
        kth = jnp.take_along_axis(-jnp.sort(-l, axis=-1), jnp.broadcast_to(k - 1, l.shape[:-1] + (1,)), axis=-1)
        return jnp.where((top_k_B[:, None, None] > 0) & (l < kth), fmin, l)

    l = jax.lax.cond(jnp.any(top_p_B < 1.0), nucleus, lambda l: l, l)
    return jax.lax.cond(jnp.any(top_k_B > 0), top_k, lambda l: l, l)


def dream_decide(alg: str, logits_BSV, x_BS, mask_id: int, knobs, *, keys_B, frac_B, k_B):
    """One step of Dream's sampler on one block per row -> (cand_BS, transfer_BS); alg origin /
    maskgit_plus / topk_margin / entropy (rules: docs/internals/decoding_loops.md, "Dream's sampler")."""
    masked = x_BS == mask_id
    T = knobs.temperature
    l = dream_filter(logits_BSV, T, knobs.top_p, knobs.top_k)
    logp = jax.nn.log_softmax(l, axis=-1)
    p = jnp.exp(logp)
    cand = gumbel_candidates(logp, (T > 0).astype(jnp.float32), keys_B)
    if alg == "origin":
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 2), x_BS.shape[1:]))(keys_B)
        return cand, masked & (u < frac_B[:, None])
    if alg == "maskgit_plus":
        conf = jnp.take_along_axis(p, cand[..., None], axis=-1)[..., 0]
    elif alg == "topk_margin":
        top2 = jax.lax.top_k(p, 2)[0]
        conf = top2[..., 0] - top2[..., 1]
    elif alg == "entropy":
        conf = jnp.sum(p * jnp.log(p + 1e-10), axis=-1)
    else:
        raise ValueError(f"unknown Dream alg {alg!r}; choose one of {DREAM_ALGS}")
    c = jnp.where(masked, conf, NEG_INF)
    a = knobs.alg_temp[:, None]

    def noisy(_):
        g = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, 3), x_BS.shape[1:]))(keys_B)
        return jnp.where(a > 0, c / jnp.where(a > 0, a, 1.0) + g, c)
    score = jax.lax.cond(jnp.any(a > 0), noisy, lambda _: c, None)
    return cand, masked & (rank_desc(score) < k_B[:, None])
