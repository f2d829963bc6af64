"""Block diffusion's per-block decisions (cache="block"; the loop is block_loop.py): sampling with
top-k / top-p, SDAR's remasking orders (sequential, entropy_bounded), LLaDA2.0's transfer schedule,
Fast-dLLM v2's sub-blocks, the LLaDA2 decoder with LLaDA2.1 edits, and LLaDA2.2 insert/delete
editing. Rules and sources: docs/block_diffusion.md, docs/internals/decoding_loops.md."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dinfer_jax.decoding.loop_state import IndelState
from dinfer_jax.decoding.strategies import rank_desc


def sample_tokens(logits_BSV, knobs, keys_B, with_entropy: bool = False):
    """-> (v_BS int32, p_BS fp32): LLaDA2's sampler (argmax at temperature 0, else T / top_k / top_p
    and one Gumbel-max draw; rules: docs/internals/decoding_loops.md). with_entropy: also the
    entropy h_BS (nats, fp32) of the distribution p is read from -> (v, p, h_BS)."""
    l = logits_BSV.astype(jnp.float32)
    T = knobs.temperature[:, None, None]
    greedy = T <= 0
    V = l.shape[-1]
    k = knobs.top_k.astype(jnp.int32)[:, None, None]
    top_p = knobs.top_p[:, None, None]

    def filtered(_):  # logits / T, then top-k and top-p (only traced work when some row samples)
        lt = l / jnp.where(greedy, 1.0, T)
        srt = -jnp.sort(-lt, axis=-1)  # descending
        kth = jnp.take_along_axis(srt, jnp.clip(k - 1, 0, V - 1), axis=-1)
        lt = jnp.where((k > 0) & (lt < kth), -jnp.inf, lt)
        srt = -jnp.sort(-lt, axis=-1)
        probs_sorted = jax.nn.softmax(srt, axis=-1)
        cum = jnp.cumsum(probs_sorted, axis=-1)
        keep_n = jnp.sum((cum - probs_sorted) < top_p, axis=-1, keepdims=True)  # smallest prefix with cum > top_p
        cut = jnp.take_along_axis(srt, jnp.clip(keep_n - 1, 0, V - 1), axis=-1)
        lt = jnp.where((top_p < 1.0) & (lt < cut), -jnp.inf, lt)
        g = jax.vmap(lambda key: jax.random.gumbel(key, l.shape[1:], jnp.float32))(keys_B)
        return jnp.where(greedy, l, lt), jnp.where(greedy, l, lt + g), l / jnp.where(greedy, 1.0, T)

    lt, scores, raw = jax.lax.cond(jnp.any(~greedy), filtered, lambda _: (l, l, l), None)
    v = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    prob = lambda a: jnp.exp(jnp.take_along_axis(a, v[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(a, axis=-1))
    p = prob(lt)
    before = None
    if knobs.confidence_before_filter is not None:
        before = (knobs.confidence_before_filter > 0)[:, None]
        p = jnp.where(before, prob(raw), p)
    if not with_entropy:
        return v, p
    h = entropy(lt)
    if before is not None:
        h = jnp.where(before, entropy(raw), h)
    return v, p, h


def entropy(logits_BSV):
    """-sum q log q of q = softmax(logits) over the vocabulary, fp32; -inf logits (filtered out by
    top-k / top-p) contribute exactly 0."""
    logq = jax.nn.log_softmax(logits_BSV, axis=-1)
    return -jnp.sum(jnp.where(jnp.isfinite(logits_BSV), jnp.exp(logq) * logq, 0.0), axis=-1)


def rank_asc(score_BS):
    """0-based rank of each position by ascending score (ties: lower position first)."""
    order = jnp.argsort(score_BS, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def sequential_transfer(masked_BS, n_B):
    """SDAR `sequential`: the leftmost min(n, #masked) masked positions."""
    return masked_BS & (jnp.cumsum(masked_BS, axis=-1) <= n_B[:, None])


def entropy_bounded_transfer(h_BS, masked_BS, bound_B, n_B):
    """SDAR `entropy_bounded`: the masked positions by increasing entropy h (ties: lower position
    first), as many k as have a running sum of the sorted entropies strictly below the bound, then
    k = min(max(k, n), #masked) (n = 1: SDAR's at-least-one rule)."""
    h = jnp.where(masked_BS, h_BS, jnp.inf)
    cum = jnp.cumsum(jnp.sort(h, axis=-1), axis=-1)
    k = jnp.sum(cum < bound_B[:, None], axis=-1).astype(jnp.int32)
    k = jnp.minimum(jnp.maximum(k, n_B), jnp.sum(masked_BS, axis=-1))
    return masked_BS & (rank_asc(h) < k[:, None])


def transfer_schedule(step_B, block: int, steps: int):
    """LLaDA2.0's per-block transfer count at each row's step: block // steps tokens, one more on the
    first block % steps steps (docs/facts/llada2_and_dream.md §5.1). steps > block: one per step."""
    return block // steps + (step_B < block % steps).astype(jnp.int32)


def sub_block_candidates(masked_BS, sub: int, shift: int):
    """Fast-dLLM v2's sub-block schedule -> (B, S) bool, the positions this step may commit: the
    masks of the first sub-block holding one; with shift = 1, a masked first position alone."""
    B, S = masked_BS.shape
    has = jnp.any(masked_BS.reshape(B, S // sub, sub), axis=-1)
    cur = jnp.argmax(has, axis=-1)  # the first sub-block holding a mask
    cand = masked_BS & ((jnp.arange(S) // sub)[None, :] == cur[:, None])
    if shift:
        head = masked_BS[:, :1]
        cand = jnp.where(head, jnp.arange(S)[None, :] == 0, cand)
    return cand


def sub_block_refresh(masked_BS, gen_BS, sub: int, shift: int):
    """The sub-block DualCache's schedule -> (sub_B, refresh_B): the current sub-block (the first
    holding a mask) and whether this step refreshes the whole block (rule: docs/block_diffusion.md)."""
    B, S = masked_BS.shape
    pos = jnp.arange(S)[None, :]
    sub_B = jnp.argmax(jnp.any(masked_BS.reshape(B, S // sub, sub), axis=-1), axis=-1).astype(jnp.int32)
    in_sub = (pos // sub) == sub_B[:, None]
    first_masked = jnp.any(masked_BS & (pos == sub_B[:, None] * sub), axis=-1)
    decoded = in_sub & gen_BS & ~masked_BS & (pos >= shift)
    return sub_B, first_masked | ~jnp.any(decoded, axis=-1)


def block_decide(logits_BSV, x_BS, editable_BS, mask_id: int, knobs, keys_B, editing: bool, n_B=None,
                 cand_BS=None, strategy: str = "threshold"):
    """One decoder step on each row's block -> (new x_BS, m2t_BS, t2t_BS) (module doc).
    editable_BS: generated (non-prompt) positions of the block; n_B: the M2T count (default
    knobs.num_to_transfer); cand_BS: the masked positions M2T may pick (default: every mask);
    strategy (static): the M2T rule, "threshold" (LLaDA2's), "sequential" or "entropy_bounded"
    (SDAR's; knob eb_threshold is the entropy bound)."""
    eb = strategy == "entropy_bounded"
    v, p, *h = sample_tokens(logits_BSV, knobs, keys_B, with_entropy=eb)
    masked = x_BS == mask_id if cand_BS is None else cand_BS
    n = knobs.num_to_transfer.astype(jnp.int32) if n_B is None else n_B
    if strategy == "sequential":
        m2t = sequential_transfer(masked, n)
    elif eb:
        m2t = entropy_bounded_transfer(h[0], masked, knobs.eb_threshold, n)
    elif strategy == "threshold":
        c = jnp.where(masked, p, -jnp.inf)
        high = masked & (c > knobs.threshold[:, None])
        enough = jnp.sum(high, axis=-1) >= n
        top = masked & (rank_desc(c) < jnp.minimum(n, jnp.sum(masked, axis=-1))[:, None])
        m2t = jnp.where(enough[:, None], high, top)
    else:
        raise ValueError(f"unknown block-diffusion strategy {strategy!r}")
    t2t = jnp.zeros_like(m2t)
    if editing:
        t2t = editable_BS & ~masked & (p > knobs.editing_threshold[:, None]) & (v != x_BS)
    return jnp.where(m2t | t2t, v, x_BS), m2t, t2t


def indel_rebuild(y_BS, x_BS, orig_BS, gen_BS, mask_id: int, delete_id: int, split_id: int):
    """LLaDA2.2's block rebuild after DELETE/SPLIT writes, a per-row gather -> (tokens_BS, orig_BS).
    y: the block after this step's writes, x: at the step's start, orig: "original mask" flags,
    gen: generated slots (emission rule: docs/internals/decoding_loops.md)."""
    S = y_BS.shape[-1]
    cnt = jnp.where(gen_BS & (y_BS == delete_id), 0, jnp.where(gen_BS & (y_BS == split_id), 2, 1))
    end = jnp.cumsum(cnt, axis=-1)  # slots emitted up to and including source i
    j = jnp.arange(S, dtype=end.dtype)
    src = jnp.sum(end[:, None, :] <= j[None, :, None], axis=-1)  # output slot j comes from source src
    pad = src >= S
    srcc = jnp.minimum(src, S - 1)
    take = lambda a: jnp.take_along_axis(a, srcc, axis=-1)
    c = take(cnt)
    new_mask = pad | ((c == 2) & (j[None, :] == take(end) - 2))  # padding, or SPLIT's first (inserted) slot
    tok = jnp.where(new_mask, mask_id, jnp.where(c == 2, take(x_BS), take(y_BS)))
    return tok, ~new_mask & take(orig_BS)


def indel_step(logits_BSV, x_BS, gen_BS, stp_B, post_B, st, knobs, spec, delete_id: int, split_id: int):
    """One LLaDA2.2 insert/delete step on each row's block (SGLang JointThresholdInDel; module doc).
    st: per-row loop_state.IndelState (H = update steps a block can take); stp_B: the
    block's steps so far; post_B: its post-edit rounds so far.
    -> (new block, finished_B, post_B, st, t2t_BS, inserts_B, deletes_B)."""
    M, D, SP = spec.mask_id, delete_id, split_id
    B, S, V = logits_BSV.shape
    H = st.seen.shape[1]
    maxpost = spec.max_post_steps
    l = logits_BSV.astype(jnp.float32)
    lse = jax.nn.logsumexp(l, axis=-1)
    vid = jnp.arange(V)
    prob = lambda t: jnp.exp(jnp.take_along_axis(l, t[..., None], axis=-1)[..., 0] - lse)
    best = lambda excl: jnp.argmax(jnp.where(excl, -jnp.inf, l), axis=-1).astype(jnp.int32)
    v = best(jnp.zeros((V,), bool))
    p = prob(v)
    orig = jnp.where((stp_B == 0)[:, None], gen_BS & (x_BS == M), st.orig)  # a block's first step: its masks
    mask = gen_BS & (x_BS == M)
    omask = orig & mask
    n_orig, n_mask = jnp.sum(omask, axis=-1), jnp.sum(mask, axis=-1)
    post = post_B + (n_orig == 0)
    cleanup = (n_orig == 0) if maxpost == 0 else (post >= maxpost)
    cleanup |= stp_B + 1 > S + maxpost
    # Unresolved original masks never take the mask id: re-argmax without it (p under the full softmax).
    fb = ~cleanup[:, None] & omask & (v == M)
    v_nm = best(vid == M)
    v, p = jnp.where(fb, v_nm, v), jnp.where(fb, prob(v_nm), p)
    # M2T: (num_to_transfer + introduced masks) while original masks remain, else every mask.
    conf = jnp.where(mask, p, -jnp.inf)
    need = knobs.num_to_transfer.astype(jnp.int32) + n_mask - n_orig
    high = mask & (conf > knobs.threshold[:, None])
    top = mask & (rank_desc(conf) < jnp.minimum(need, n_mask)[:, None])
    part = jnp.where((jnp.sum(high, axis=-1) >= need)[:, None], high, top)
    m2t = jnp.where((cleanup | (n_orig == 0))[:, None], mask, part)
    if maxpost == 0:  # no post-edit rounds: the step that picks the last original masks is the cleanup
        last = (n_orig > 0) & ~jnp.any(omask & ~m2t, axis=-1)
        cleanup |= last
        m2t = jnp.where(last[:, None], mask, m2t)
    t2t = gen_BS & ~mask & (p > knobs.editing_threshold[:, None]) & (v != x_BS)
    tr = m2t | t2t
    empty = ~jnp.any(tr, axis=-1)
    # The cleanup writes no MASK / DELETE / SPLIT.
    ctl = (vid == M) | (vid == D) | (vid == SP)
    bad = cleanup[:, None] & tr & ((v == M) | (v == D) | (v == SP))
    v = jnp.where(bad, best(ctl), v)
    # Anti-loop: a block state seen before at this block's steps -> the lowest-p changing position
    # takes its best token not yet written there (nor the mask id at an original mask).
    h_valid = jnp.arange(H)[None, :] < stp_B[:, None]
    seen = jnp.any(h_valid & jnp.all(st.seen == x_BS[:, None, :], axis=-1), axis=-1)
    changing = tr & (v != x_BS)
    anti = seen & ~cleanup & jnp.any(changing, axis=-1)
    c = jnp.argmin(jnp.where(changing, p, jnp.inf), axis=-1)
    lc = jnp.take_along_axis(l, c[:, None, None], axis=1)[:, 0]  # (B, V)
    tried = jnp.where(h_valid, jnp.take_along_axis(st.hist, c[:, None, None], axis=2)[..., 0], V)
    lc = jax.vmap(lambda r, t: r.at[t].set(-jnp.inf, mode="drop"))(lc, tried)
    lc = jnp.where(jnp.take_along_axis(omask, c[:, None], axis=-1) & (vid == M)[None, :], -jnp.inf, lc)
    v_c = jnp.argmax(lc, axis=-1).astype(jnp.int32)
    v = jnp.where(anti[:, None] & (jnp.arange(S)[None, :] == c[:, None]), v_c[:, None], v)
    at = (jnp.arange(H) == stp_B[:, None])[:, :, None]
    seen_new = jnp.where(at, x_BS[:, None, :], st.seen)
    hist_new = jnp.where(at, jnp.where(tr, v, -1)[:, None, :], st.hist)
    y = jnp.where(tr, v, x_BS)
    ins, dels = tr & (v == SP), tr & (v == D)
    rebuilt, orig_new = indel_rebuild(y, x_BS, orig, gen_BS, M, D, SP)
    has = jnp.any(ins | dels, axis=-1)[:, None]
    st = IndelState(orig=jnp.where(has, orig_new, orig), seen=seen_new, hist=hist_new)
    new = jnp.where(empty[:, None], x_BS, jnp.where(has, rebuilt, y))
    return (new, empty | cleanup, post, st, t2t, jnp.sum(ins, axis=-1).astype(jnp.int32),
            jnp.sum(dels, axis=-1).astype(jnp.int32))
