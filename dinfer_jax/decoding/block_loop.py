"""Block diffusion (LLaDA2.x, SDAR, Fast-dLLM v2) in the one jitted `lax.while_loop`: a prefill,
then per step one window forward per active row over its block (S = B, or 2B on a block's first
step) and the LLaDA2 decoder on the block. Details: docs/block_diffusion.md ("The block loop in detail")."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dinfer_jax.cache import empty_cache, window_slice, window_write
from dinfer_jax.decoding.constraint import constrain_logits
from dinfer_jax.decoding.observe import emit
from dinfer_jax.decoding.loop_state import BlockLoopState, IndelState
from dinfer_jax.decoding.row_state import commit_record, commit_record_init, row_gen_end
from dinfer_jax.decoding.strategies import forbid_eos, rank_desc


def sample_tokens(logits_BSV, knobs, keys_B, with_entropy: bool = False):
    """-> (v_BS int32, p_BS fp32): LLaDA2's sampler (argmax at temperature 0, else T / top_k / top_p
    and one Gumbel-max draw; rules: docs/internals/decoding_loops.md). with_entropy: also the
    entropy h_BS (nats, fp32) of the distribution p is read from -> (v, p, h_BS)."""
    l = logits_BSV.astype(jnp.float32)
    T = knobs["temperature"][:, None, None]
    greedy = T <= 0
    V = l.shape[-1]
    k = knobs["top_k"].astype(jnp.int32)[:, None, None]
    top_p = knobs["top_p"][:, None, None]

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
    if knobs.get("confidence_before_filter") is not None:
        before = (knobs["confidence_before_filter"] > 0)[:, None]
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
    """LLaDA2.0's per-block transfer count at each row's step: block // steps tokens, one more on
    the first block % steps steps (reference §5.1). steps > block: one per step for `block` steps."""
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
    knobs["num_to_transfer"]); cand_BS: the masked positions M2T may pick (default: every mask);
    strategy (static): the M2T rule, "threshold" (LLaDA2's), "sequential" or "entropy_bounded"
    (SDAR's; knob eb_threshold is the entropy bound)."""
    eb = strategy == "entropy_bounded"
    v, p, *h = sample_tokens(logits_BSV, knobs, keys_B, with_entropy=eb)
    masked = x_BS == mask_id if cand_BS is None else cand_BS
    n = knobs["num_to_transfer"].astype(jnp.int32) if n_B is None else n_B
    if strategy == "sequential":
        m2t = sequential_transfer(masked, n)
    elif eb:
        m2t = entropy_bounded_transfer(h[0], masked, knobs["eb_threshold"], n)
    elif strategy == "threshold":
        c = jnp.where(masked, p, -jnp.inf)
        high = masked & (c > knobs["threshold"][:, None])
        enough = jnp.sum(high, axis=-1) >= n
        top = masked & (rank_desc(c) < jnp.minimum(n, jnp.sum(masked, axis=-1))[:, None])
        m2t = jnp.where(enough[:, None], high, top)
    else:
        raise ValueError(f"unknown block-diffusion strategy {strategy!r}")
    t2t = jnp.zeros_like(m2t)
    if editing:
        t2t = editable_BS & ~masked & (p > knobs["editing_threshold"][:, None]) & (v != x_BS)
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
    need = knobs["num_to_transfer"].astype(jnp.int32) + n_mask - n_orig
    high = mask & (conf > knobs["threshold"][:, None])
    top = mask & (rank_desc(conf) < jnp.minimum(need, n_mask)[:, None])
    part = jnp.where((jnp.sum(high, axis=-1) >= need)[:, None], high, top)
    m2t = jnp.where((cleanup | (n_orig == 0))[:, None], mask, part)
    if maxpost == 0:  # no post-edit rounds: the step that picks the last original masks is the cleanup
        last = (n_orig > 0) & ~jnp.any(omask & ~m2t, axis=-1)
        cleanup |= last
        m2t = jnp.where(last[:, None], mask, m2t)
    t2t = gen_BS & ~mask & (p > knobs["editing_threshold"][:, None]) & (v != x_BS)
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


def block_loop_functions(module, params, spec, pad_B, prompt_len_B, gen_start: int, Lc: int, knobs,
                         observer_id=None):
    """Block-diffusion generation (module doc) as loop.loop_functions' (init, body); init
    runs the prefill. `module` must be block-causal with attention block == spec.block_length."""
    cfg = module.cfg
    B = pad_B.shape[0]
    Bk, M = spec.block_length, spec.mask_id
    sh, sb = spec.logit_shift, spec.sub_block_length
    sbc = spec.sub_block_cache
    gen_end = gen_start + spec.gen_length  # the program's generation region (static)
    gen_end_B = row_gen_end(knobs, gen_start, spec)  # each row's
    idx_L = jnp.arange(Lc, dtype=jnp.int32)
    positions_BL = jnp.maximum(idx_L[None, :] - pad_B[:, None], 0)
    first_B = pad_B + (prompt_len_B // Bk) * Bk  # canvas index of the first decoded block
    row_end_B = pad_B + -(-(prompt_len_B + gen_end_B - gen_start) // Bk) * Bk
    n_blocks_B = (row_end_B - first_B) // Bk
    key_mask_BL = (idx_L[None, :] >= pad_B[:, None]) & (idx_L[None, :] < row_end_B[:, None])
    base_keys = jax.vmap(lambda s: jax.random.key(s))(knobs["seed"].astype(jnp.uint32))

    if spec.indel:
        ids = dict(cfg.extra_token_ids)
        edit_ids = (ids["delete_token_id"], ids["split_token_id"])
        H = Bk + spec.max_post_steps + 1  # update steps a block can take

    def init(canvas_BL, active_B, prefix=None):
        """-> the loop state after the prefill. prefix = ((k, v) each (layers, B, gen_start, K, H), W):
        cached prompt K/V (decoding/prefix_cache.py), valid for every row before gen_start - W; only
        the last W prompt positions are then computed (a window forward over that cache)."""
        tail = (idx_L[None, :] >= gen_end_B[:, None]) & (idx_L[None, :] < row_end_B[:, None]) & active_B[:, None]
        x0 = jnp.where(tail, M, canvas_BL)
        kv = empty_cache(cfg.num_layers, B, Lc, cfg.num_kv_heads, cfg.head_dim, module.dtype)
        with jax.named_scope("prefill"):
            if prefix is None:
                _, kv_pre = module.apply({"params": params}, tokens_BS=x0[:, :gen_start],
                                         positions_BS=positions_BL[:, :gen_start],
                                         key_mask_BL=key_mask_BL[:, :gen_start],
                                         logits_window=(jnp.zeros((B,), jnp.int32), 1))
                kv = tuple(c.at[:, :, :gen_start].set(p.astype(c.dtype)) for c, p in zip(kv, kv_pre))
            else:
                cached, width = prefix
                ws = gen_start - width
                kv = tuple(c.at[:, :, :gen_start].set(p.astype(c.dtype)) for c, p in zip(kv, cached))
                _, kv = module.apply({"params": params}, tokens_BS=x0[:, ws:gen_start],
                                     positions_BS=positions_BL[:, ws:gen_start],
                                     key_mask_BL=key_mask_BL & (idx_L < gen_start)[None, :], kv=kv,
                                     window_start=jnp.full((B,), ws, jnp.int32), key_positions_BL=positions_BL,
                                     logits_window=(jnp.zeros((B,), jnp.int32), 1))
        zeros_B, zero = jnp.zeros((B,), jnp.int32), jnp.zeros((), jnp.int32)
        state = BlockLoopState(
            x=x0, kv=kv, blk=zeros_B, stp=zeros_B, post=zeros_B, it=zeros_B, done=~active_B, row_nfe=zeros_B,
            edits=zeros_B, steps_per_block=jnp.zeros((B, spec.num_blocks), jnp.int32),
            nfe_window=zero, nfe_commit=zero, iters=zero, record=commit_record_init(B, Lc, spec))
        if sbc:  # sub-block forwards: per row, and batch-wide (the block cache itself lives in `kv`)
            state = state.replace(row_sub=zeros_B, nfe_sub=zero)
        if spec.indel:  # LLaDA2.2 insert/delete editing: per-row block state (indel_step)
            state = state.replace(ind=IndelState(orig=jnp.zeros((B, Bk), bool), seen=jnp.zeros((B, H, Bk), jnp.int32),
                                                 hist=jnp.zeros((B, H, Bk), jnp.int32)),
                                  inserts=zeros_B, deletes=zeros_B)
        return state

    def body(s):
        active = ~s.done
        start_B = first_B + s.blk * Bk
        x, kv = s.x, s.kv
        commit = active & (s.stp == 0) & (s.blk > 0)
        plain = active & ~commit
        V = cfg.vocab_size
        x_blk = window_slice(x, start_B, Bk)
        blk_idx = start_B[:, None] + jnp.arange(Bk)[None, :]
        in_gen = blk_idx >= gen_start
        masked0 = x_blk == M
        if sbc:  # the sub-block DualCache (module doc): which plain steps run over the sub-block only
            sub_B, refresh = sub_block_refresh(masked0 & in_gen, in_gen, sb, sh)
            short = plain & ~refresh
            plain = plain & refresh

        def window(size, back, persist):
            # Shifted logits (sh = 1): the window starts one position earlier (a query only: its K/V
            # stay the cached ones) and the logits rows are read one row earlier (module doc).
            return forward(start_B - back - sh, size + sh, back, Bk, persist)

        def forward(ws, size, logits_at, n_logits, persist):
            write = None if not sh else jnp.broadcast_to(jnp.arange(size) >= sh, (B, size))
            write_kw = {"kv_write_BS": write}
            if persist is not None:
                # The commit window persists (its previous block is clean, so those K/V are final);
                # with the sub-block DualCache the whole-block window persists too (the block cache).
                # Only the persisting rows' logits of such a forward are used, so the other rows
                # may attend over their cached window K/V: the persisting rows' fresh K/V are written
                # into the carried cache layer by layer (kv_in_place), with no second stacked cache.
                keep = jnp.broadcast_to(persist[:, None], (B, size))
                write_kw = {"kv_write_BS": keep if write is None else keep & write, "kv_in_place": True}

            def run(kv_in):
                with jax.named_scope("forward_block"):
                    logits, kv_new = module.apply(
                        {"params": params}, tokens_BS=window_slice(x, ws, size),
                        positions_BS=window_slice(positions_BL, ws, size), key_mask_BL=key_mask_BL, kv=kv_in,
                        window_start=ws, key_positions_BL=positions_BL,
                        logits_window=(jnp.full((B,), logits_at, jnp.int32), n_logits),
                        **write_kw)
                return logits, (kv_in if persist is None else kv_new)
            return run

        def skip(kv_in):
            return jnp.zeros((B, Bk, V), jnp.float32), kv_in

        logits_c, kv = jax.lax.cond(jnp.any(commit), window(2 * Bk, Bk, commit), skip, kv)
        logits_p, kv = jax.lax.cond(jnp.any(plain), window(Bk, 0, plain if sbc else None), skip, kv)
        logits = jnp.where(commit[:, None, None], logits_c, logits_p)
        if sbc:
            # Sub-block forward: window [sub start - sh, sub end) over the cache (block cache for the
            # block's other positions); its b logits rows go to the sub-block's rows of the block.
            def short_run(kv_in):
                lg, _ = forward(start_B + sub_B * sb - sh, sb + sh, 0, sb, None)(kv_in)
                return window_write(jnp.zeros((B, Bk, V), jnp.float32), lg.astype(jnp.float32), sub_B * sb), kv_in

            logits_s, _ = jax.lax.cond(jnp.any(short), short_run, skip, kv)
            logits = jnp.where(short[:, None, None], logits_s, logits)

        with jax.named_scope("strategy"):
            keys = jax.vmap(jax.random.fold_in)(base_keys, s.it)
            logits = forbid_eos(logits, blk_idx - gen_start, spec.eos_id, knobs)  # ignore_eos / min_tokens
            if spec.constraint_classes:  # canvas templates (decoding/constraint.py)
                logits = constrain_logits(logits, window_slice(knobs["allow_class"], start_B, Bk), knobs["allowed"],
                                          x_blk)
            n_B = None
            if spec.steps_per_block:
                n_B = jnp.maximum(knobs["num_to_transfer"].astype(jnp.int32),
                                  transfer_schedule(s.stp, Bk, spec.steps_per_block))
            if spec.indel:
                new_blk, fin_ind, post_ind, ind, t2t, n_ins, n_del = indel_step(
                    logits, x_blk, in_gen, s.stp, s.post, s.ind, knobs, spec, *edit_ids)
            else:
                cand = sub_block_candidates(masked0 & in_gen, sb, sh) if sb else None
                new_blk, m2t, t2t = block_decide(logits, x_blk, in_gen, M, knobs, keys, spec.editing, n_B, cand,
                                                 spec.strategy)
            new_blk = jnp.where(active[:, None], new_blk, x_blk)
            t2t &= active[:, None]
            # indel: a slot's token may also change by a rebuild (tokens shift): its step is that change's
            wrote = (new_blk != x_blk) if spec.indel else (m2t | t2t) & active[:, None]
            rec = commit_record(s, wrote, new_blk, logits, start_B, spec)
            x = window_write(x, new_blk, start_B)

        any_mask_after = jnp.any(new_blk == M, axis=-1)
        if spec.indel:
            post, finished = post_ind, active & fin_ind
        elif spec.editing:
            post_fill = ~jnp.any(masked0, axis=-1)
            post = s.post + post_fill.astype(jnp.int32)
            finished = active & ((post_fill & ~jnp.any(t2t, axis=-1)) |
                                 (~any_mask_after & (post + 1 > spec.max_post_steps)))
        else:
            post = s.post
            finished = active & ~any_mask_after
        has_eos = (jnp.any((new_blk == spec.eos_id) & in_gen, axis=-1) if spec.early_stop
                   else jnp.zeros((B,), bool))
        if spec.early_stop and cfg.eot_token_id is not None and cfg.eot_token_id != spec.eos_id:
            # The model's end-of-turn id also ends a row (rows without ignore_eos): outputs are cut at
            # the first stop id anyway, and under block-causal attention later blocks never change
            # earlier ones, so this only saves forwards (SDAR stops on its EOS list the same way).
            has_eot = jnp.any((new_blk == cfg.eot_token_id) & in_gen, axis=-1)
            has_eos |= has_eot & (knobs["ignore_eos"] <= 0)
        stop_now = finished & has_eos
        fill = stop_now[:, None] & (idx_L[None, :] >= (start_B + Bk)[:, None]) & (idx_L[None, :] < gen_end_B[:, None])
        x = jnp.where(fill & (x == M), spec.eos_id, x)  # only masks: a template's fixed tokens stay
        last = s.blk + 1 >= n_blocks_B
        done = s.done | stop_now | (finished & last)
        spb = jnp.where(finished[:, None] & (jnp.arange(spec.num_blocks)[None, :] == s.blk[:, None]),
                        (s.stp + 1)[:, None], s.steps_per_block)
        new = s.replace(
            record=rec, x=x, kv=kv, done=done, steps_per_block=spb,
            blk=jnp.where(finished & ~done, s.blk + 1, s.blk),
            stp=jnp.where(finished, 0, jnp.where(active, s.stp + 1, s.stp)),
            post=jnp.where(finished, 0, post),
            it=s.it + active.astype(jnp.int32), row_nfe=s.row_nfe + active.astype(jnp.int32),
            edits=s.edits + jnp.sum(t2t, axis=-1).astype(jnp.int32),
            nfe_window=s.nfe_window + jnp.any(plain).astype(jnp.int32),
            nfe_commit=s.nfe_commit + jnp.any(commit).astype(jnp.int32),
            iters=s.iters + 1,
        )
        if sbc:
            new = new.replace(row_sub=s.row_sub + short.astype(jnp.int32),
                              nfe_sub=s.nfe_sub + jnp.any(short).astype(jnp.int32))
        if spec.indel:
            new = new.replace(ind=ind, inserts=s.inserts + jnp.where(active, n_ins, 0),
                              deletes=s.deletes + jnp.where(active, n_del, 0))
        if spec.observe:
            emit(observer_id, s.iters, x[:, gen_start:gen_end], new.blk, done, active)
        return new

    return init, body
