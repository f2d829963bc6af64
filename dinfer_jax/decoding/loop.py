"""The whole generation as ONE jitted `lax.while_loop` (full-canvas modes: cache none / prefix /
dual / vicinity): all blocks, all steps, cache refreshes, early stop; no host sync until the
result. Canvas (B, Lc): [ pads | prompt | gen_length masks | tail pads ], prompts end at gen_start;
each row advances through its own blocks. Cache "block" dispatches to block_loop.py. Layout,
refresh rules, shifted logits and the commit record: docs/internals/decoding_loops.md."""
from __future__ import annotations

import functools
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

from dinfer_jax.cache import empty_cache, window_slice, window_write
from dinfer_jax.decoding import strategies as st
from dinfer_jax.decoding.block_loop import block_loop_functions
from dinfer_jax.decoding.constraint import constrain_logits
from dinfer_jax.decoding.observe import emit
from dinfer_jax.decoding.loop_state import CanvasLoopState
from dinfer_jax.decoding.row_state import commit_record, commit_record_init, record_region, row_gen_end
from dinfer_jax.decoding.spec import DREAM, FIXED, SCHEDULED, DecodeSpec, RowKnobs

def _forward(module, params, spec, x_BL, soft_BLD, it_B, knobs, **kw):
    """Model forward on tokens, or on smoothed embeddings when iteration smoothing is on."""
    if not spec.smoothing:
        return module.apply({"params": params}, tokens_BS=x_BL, **kw)
    emb = module.apply({"params": params}, x_BL, method="embed_tokens")
    w = jnp.minimum(0.15 + 0.02 * it_B.astype(jnp.float32), knobs.cont_weight)[:, None, None]
    emb = jnp.where((x_BL == spec.mask_id)[..., None], emb + w.astype(emb.dtype) * soft_BLD.astype(emb.dtype), emb)
    return module.apply({"params": params}, embeds_BSD=emb, **kw)


def _soft_embeddings(module, params, logits_BSV):
    """Expected embedding under softmax(l): (B, S, V) @ (V, D)."""
    table = params["embed"]["embedding"]
    p = jax.nn.softmax(logits_BSV, axis=-1).astype(table.dtype)
    return jnp.einsum("bsv,vd->bsd", p, table)


def generate_loop(module, params, spec: DecodeSpec, canvas_BL, pad_B, prompt_len_B, gen_start: int,
                  active_B, knobs: RowKnobs, observer_id=None, refresh_rows: tuple[int, ...] = ()):
    """Run the whole generation. Returns (canvas_BL, stats dict of arrays).

    canvas_BL: int32 tokens (layout above); pad_B: left pads per row; prompt_len_B: real prompt
    tokens per row; gen_start: static index where every row's generation region begins;
    active_B: False for bucket-filler rows; knobs: the rows' values (decoding/spec.RowKnobs).
    observer_id: int32 scalar naming a host observer (decoding/observe.py); used only when
    spec.observe, which adds one host callback per iteration with the generation region.
    refresh_rows: see loop_functions.
    """
    init, body = loop_functions(module, params, spec, pad_B, prompt_len_B, gen_start, canvas_BL.shape[1],
                                knobs, observer_id, refresh_rows)

    def cond(s):
        return jnp.any(~s.done) & (s.iters < spec.max_iterations)

    with jax.named_scope("denoise_loop"):
        final = jax.lax.while_loop(cond, body, init(canvas_BL, active_B))
    return final.x, final.stats().replace(record=record_region(final, gen_start, spec.gen_length))


def refresh_rows_for(batch: int, batch_shards: int = 1) -> tuple[int, ...]:
    """The row counts (increasing) the cached loop's partial full refresh may gather (empty: none).
    Rows reach a block start at different steps (continuous batching, threshold decoding); a step
    where n rows need the full-canvas forward runs it on the smallest gathered size >= n (B/4 from
    8 rows, B/2 from 4), on all B past the largest. Off when the batch is split over devices
    (batch_shards > 1: data, or expert, parallel; the gather and the in-place row write-back would
    cross devices) and below 4 rows (the saving would not pay the extra compile)."""
    if batch < 4 or batch_shards != 1:
        return ()
    return (batch // 4, batch // 2) if batch >= 8 else (batch // 2,)


def loop_functions(module, params, spec: DecodeSpec, pad_B, prompt_len_B, gen_start: int, Lc: int, knobs,
                   observer_id=None, refresh_rows: tuple[int, ...] = ()):
    """The loop's pieces -> (init(canvas_BL, active_B) -> state, body(state) -> state); the state is
    a loop_state.CanvasLoopState (BlockLoopState for cache "block").
    Row context (pads, prompt lengths, knobs) comes in as arrays, so a paused state can take new rows
    between segments (decoding/segments.py): every per-row quantity lives in the state or is derived
    from the row context; the body never mixes rows. refresh_rows = (R1 < R2 ...) (cached modes): a
    step where n >= 1 rows need the full-canvas forward gathers them into an Ri-row forward, the
    smallest Ri >= n (`refresh_rows_for`); more rows than every Ri run it on all B."""
    if spec.cache == "block":
        return block_loop_functions(module, params, spec, pad_B, prompt_len_B, gen_start, Lc, knobs, observer_id)
    cfg = module.cfg
    B = pad_B.shape[0]
    Bk, M, sh = spec.block_length, spec.mask_id, spec.logit_shift
    gen_end = gen_start + spec.gen_length  # the program's generation region (static)
    gen_end_B = row_gen_end(knobs, gen_start, spec)  # each row's
    idx_L = jnp.arange(Lc, dtype=jnp.int32)
    positions_BL = jnp.maximum(idx_L[None, :] - pad_B[:, None], 0)
    key_mask_BL = (idx_L[None, :] >= pad_B[:, None]) & (idx_L[None, :] < gen_end_B[:, None])
    if spec.start_block_align:
        first_B = pad_B + (prompt_len_B // Bk) * Bk
    else:
        first_B = jnp.full((B,), gen_start, jnp.int32)
    n_blocks_B = (gen_end_B - first_B + Bk - 1) // Bk
    base_keys = jax.vmap(lambda s: jax.random.key(s))(knobs.seed.astype(jnp.uint32))

    def block_start(blk_B):
        return first_B + blk_B * Bk

    def init(canvas_BL, active_B):
        zeros_B, zero = jnp.zeros((B,), jnp.int32), jnp.zeros((), jnp.int32)
        return CanvasLoopState(
            x=canvas_BL, blk=zeros_B, stp=zeros_B, it=zeros_B, done=~active_B, n_entry=zeros_B, row_nfe=zeros_B,
            steps_per_block=jnp.zeros((B, spec.num_blocks), jnp.int32),
            nfe_full=zero, nfe_window=zero, nfe_partial=zero, iters=zero,
            record=commit_record_init(B, Lc, spec),
            kv=(None if spec.cache == "none"
                else empty_cache(cfg.num_layers, B, Lc, cfg.num_kv_heads, cfg.head_dim, module.dtype)),
            credit=jnp.zeros((B, Bk, cfg.vocab_size), jnp.float32) if spec.strategy == "credit" else None,
            soft=jnp.zeros((B, Lc, cfg.hidden_size), module.dtype) if spec.smoothing else None)

    def body(s):
        active = ~s.done
        start_B = block_start(s.blk)
        x = s.x
        soft = s.soft
        if spec.cache == "none":
            need_full = active
        else:
            need_full = active & (s.stp == 0)
            if spec.refresh_every:
                need_full |= active & (s.stp % spec.refresh_every == 0)
            if spec.cache == "vicinity" and spec.warmup_steps:
                need_full |= active & (s.it < spec.warmup_steps)
        need_win = active & ~need_full
        V = cfg.vocab_size
        fwd = lambda **kw: _forward(module, params, spec, kw.pop("tokens"), kw.pop("soft"), s.it,  # noqa: E731
                                    knobs, **kw)

        # ---- full forward (whole canvas)
        def forward_full(rows):
            """The full-canvas forward of the rows `rows` ((R,) indices; None: all B)."""
            take = (lambda a: a) if rows is None else (lambda a: None if a is None else jnp.take(a, rows, axis=0))
            start_R = take(start_B)
            refresh = {}
            if spec.cache != "none":
                # the refreshing rows' fresh K/V go into the carried cache layer by layer (the others
                # keep theirs), in place: no second stacked cache (Transformer kv_in_place)
                write_R = take(need_full)
                refresh = dict(kv=s.kv, window_start=0, kv_in_place=True, kv_rows=rows,
                               kv_write_BS=jnp.broadcast_to(write_R[:, None], (write_R.shape[0], Lc)),
                               key_positions_BL=take(positions_BL))
            with jax.named_scope("forward_full"):
                lw = None if spec.smoothing else (start_R - sh, Bk)
                logits, kv = _forward(module, params, spec, take(x), take(soft), take(s.it),
                                      jax.tree_util.tree_map(take, knobs), positions_BS=take(positions_BL),
                                      key_mask_BL=take(key_mask_BL), logits_window=lw, **refresh)
            if spec.smoothing:
                soft_new = _soft_embeddings(module, params, logits)
                logits = window_slice(logits, start_R, Bk)
            else:
                soft_new = None
            return logits, kv, soft_new

        def full(_):  # refreshed rows take the new K/V; the others keep theirs (forward_full)
            return forward_full(None)

        def some_full(R, _):  # at most R rows need it: gather R rows (need_full rows first)
            rows = jnp.argsort(~need_full, stable=True)[:R]
            logits_R, kv, soft_R = forward_full(rows)  # kv: the whole cache, its rows refreshed
            logits = jnp.zeros((B, Bk, V), jnp.float32).at[rows].set(logits_R.astype(jnp.float32))
            soft_new = None if not spec.smoothing else jnp.zeros_like(soft).at[rows].set(soft_R.astype(soft.dtype))
            return logits, kv, soft_new

        def no_full(_):
            soft_new = None if not spec.smoothing else jnp.zeros_like(soft)
            return jnp.zeros((B, Bk, V), jnp.float32), s.kv, soft_new

        new_state = {}
        if spec.cache == "none":  # every active row runs a full forward; the loop only runs with some active
            logits_full, kv_full, soft_full = full(None)
        elif refresh_rows and max(refresh_rows) < B:
            sizes = tuple(sorted(set(refresh_rows)))
            n_full = jnp.sum(need_full)
            # 0: none; i in 1..len(sizes): gather sizes[i-1] rows (the smallest size >= n); last: all B
            branch = jnp.where(n_full == 0, 0, 1 + jnp.sum(n_full > jnp.asarray(sizes, jnp.int32)))
            branches = (no_full, *(functools.partial(some_full, R) for R in sizes), full)
            logits_full, kv_full, soft_full = jax.lax.switch(branch, branches, None)
            new_state["nfe_partial"] = s.nfe_partial + ((branch > 0) & (branch <= len(sizes))).astype(jnp.int32)
        else:
            logits_full, kv_full, soft_full = jax.lax.cond(jnp.any(need_full), full, no_full, None)
        logits = logits_full
        if spec.cache != "none":
            kv = kv_full
            new_state["kv"] = kv
            rows = WindowRows(x=x, soft=soft, kv=kv, start_B=start_B, blk_B=s.blk, need_win=need_win,
                              positions_BL=positions_BL, key_mask_BL=key_mask_BL)
            logits_win, soft_win, win_start = _window_forward(
                spec, fwd, functools.partial(_soft_embeddings, module, params), rows, gen_start, V)
            logits = jnp.where(need_full[:, None, None], logits_full, logits_win)
        if spec.smoothing:
            soft = jnp.where(need_full[:, None, None], soft_full, soft)
            if spec.cache != "none":
                soft = jnp.where(need_win[:, None, None],
                                 window_write(soft, soft_win, win_start), soft)
            new_state["soft"] = soft

        # ---- strategy on each row's block
        with jax.named_scope("strategy"):
            x_blk = window_slice(x, start_B, Bk)
            masked = x_blk == M
            n_entry = jnp.where(s.stp == 0, jnp.sum(masked, axis=-1), s.n_entry)
            quota = (st.num_transfer_tokens(n_entry, spec.steps_per_block, s.stp)
                     if spec.strategy in FIXED else n_entry)
            tau = knobs.threshold
            if spec.smoothing:
                tau = jnp.maximum(1.0 - 0.02 * s.it.astype(jnp.float32), tau)
            keys = jax.vmap(jax.random.fold_in)(base_keys, s.it)
            logits = st.forbid_eos(logits, start_B[:, None] + jnp.arange(Bk)[None, :] - gen_start, spec.eos_id, knobs)
            if spec.constraint_classes:
                logits = constrain_logits(logits, window_slice(knobs.allow_class, start_B, Bk), knobs.allowed,
                                          x_blk)
            if spec.strategy == DREAM:
                frac, k = st.dream_schedule(knobs.eps, spec.steps_per_block, s.stp, jnp.sum(masked, axis=-1))
                cand, transfer = st.dream_decide(spec.alg, logits, x_blk, M, knobs, keys_B=keys, frac_B=frac, k_B=k)
                credit = None
            else:
                cand, transfer, credit = st.decide(spec.strategy, logits, x_blk, M, knobs, keys_B=keys,
                                                   step_B=s.stp, quota_B=quota, tau_B=tau,
                                                   credit_BSV=s.credit)
            transfer &= active[:, None]
            new_state["record"] = commit_record(s, transfer, cand, logits, start_B, spec)
            x_blk = jnp.where(transfer, cand, x_blk)
            x = window_write(x, x_blk, start_B)
            if credit is not None:
                new_state["credit"] = jnp.where(active[:, None, None], credit, s.credit)

        # ---- block bookkeeping, early stop
        if spec.strategy in SCHEDULED:
            finished = active & (s.stp + 1 >= spec.steps_per_block)
        else:
            finished = active & ~jnp.any(x_blk == M, axis=-1)
        block_end = start_B + Bk
        in_gen = (start_B[:, None] + jnp.arange(Bk)[None, :]) >= gen_start  # aligned blocks may hold prompt
        has_eos = (jnp.any((x_blk == spec.eos_id) & in_gen, axis=-1) if spec.early_stop
                   else jnp.zeros((B,), bool))
        stop_now = finished & has_eos
        fill = stop_now[:, None] & (idx_L[None, :] >= block_end[:, None]) & (idx_L[None, :] < gen_end_B[:, None])
        x = jnp.where(fill & (x == M), spec.eos_id, x)  # only masks: a template's fixed tokens stay
        last = s.blk + 1 >= n_blocks_B
        done = s.done | stop_now | (finished & last)
        spb = jnp.where(finished[:, None] & (jnp.arange(spec.num_blocks)[None, :] == s.blk[:, None]),
                        (s.stp + 1)[:, None], s.steps_per_block)
        new_state.update(
            x=x, done=done, n_entry=n_entry, steps_per_block=spb,
            blk=jnp.where(finished & ~done, s.blk + 1, s.blk),
            stp=jnp.where(finished, 0, jnp.where(active, s.stp + 1, s.stp)),
            it=s.it + active.astype(jnp.int32),
            row_nfe=s.row_nfe + active.astype(jnp.int32),
            nfe_full=s.nfe_full + jnp.any(need_full).astype(jnp.int32),
            nfe_window=s.nfe_window + jnp.any(need_win).astype(jnp.int32),
            iters=s.iters + 1,
        )
        if spec.observe:
            emit(observer_id, s.iters, x[:, gen_start:gen_end], new_state["blk"], done, active)
        return s.replace(**new_state)

    return init, body


@flax.struct.dataclass
class WindowRows:
    """One step's rows as the window forward reads them (B rows, canvas Lc, D hidden)."""
    x: jax.Array  # (B, Lc) canvas
    soft: Optional[jax.Array]  # (B, Lc, D) soft embeddings (smoothing) | None
    kv: Any  # the carried cache
    start_B: jax.Array  # (B,) each row's block start
    blk_B: jax.Array  # (B,) each row's block index
    need_win: jax.Array  # (B,) rows that run the window forward this step
    positions_BL: jax.Array  # (B, Lc)
    key_mask_BL: jax.Array  # (B, Lc)


def _window_forward(spec, fwd, soft_embed, rows: WindowRows, gen_start: int, V: int):
    """Cached forward over each row's window -> (block logits (B, Bk, V), soft window | None, window
    starts). fwd: the model forward (keywords of `_forward`); soft_embed: logits -> soft embeddings."""
    Bk, sh = spec.block_length, spec.logit_shift
    x, soft, kv, start_B, blk_B, need_win = rows.x, rows.soft, rows.kv, rows.start_B, rows.blk_B, rows.need_win
    positions_BL, key_mask_BL = rows.positions_BL, rows.key_mask_BL
    B, Lc = x.shape

    def run(win_start, win_size, logits_offset, write):
        tokens = window_slice(x, win_start, win_size)
        soft_w = None if soft is None else window_slice(soft, win_start, win_size)
        lw = None if spec.smoothing else (logits_offset, Bk)
        with jax.named_scope("forward_window"):
            logits, _ = fwd(tokens=tokens, soft=soft_w, positions_BS=window_slice(positions_BL, win_start, win_size),
                            key_mask_BL=key_mask_BL, kv=kv, window_start=win_start, kv_write_BS=write,
                            logits_window=lw, key_positions_BL=positions_BL)
        soft_new = None
        if spec.smoothing:
            soft_new = soft_embed(logits)
            logits = window_slice(logits, logits_offset, Bk)
        return logits, soft_new

    zero = (jnp.zeros((B, Bk, V), jnp.float32),)

    if spec.cache in ("dual", "vicinity"):
        off = 0 if spec.cache == "dual" else spec.prefix_look
        size = Bk if spec.cache == "dual" else spec.prefix_look + Bk + spec.after_look
        ext = max(0, sh - off)  # shifted logits: the window must hold the row before the block
        win_start = start_B - off - ext
        size += ext
        # the extra left position is a query only: its K/V stay the cached ones
        write = None if not ext else jnp.broadcast_to(jnp.arange(size)[None, :] >= ext, (B, size))

        def go(_):
            return run(win_start, size, jnp.full((B,), off + ext - sh, jnp.int32), write)

        def skip(_):
            return zero + ((None if soft is None else jnp.zeros((B, size, soft.shape[-1]), soft.dtype)),)

        logits, soft_new = jax.lax.cond(jnp.any(need_win), go, skip, None)
        return logits, soft_new, win_start

    # prefix: one branch per possible (static) window [w_j, Lc), j = earliest block among window rows.
    # Row b writes fresh K/V only from its own block start, so rows further ahead are exact too.
    lead = Bk if spec.start_block_align else 0
    starts = [max(0, gen_start - lead + j * Bk - sh) for j in range(spec.num_blocks)]
    j_min = jnp.min(jnp.where(need_win, blk_B, spec.num_blocks - 1))
    def branch(j):
        w = starts[j]

        def f(_):
            ws = jnp.full((B,), w, jnp.int32)
            write = jnp.arange(w, Lc)[None, :] >= start_B[:, None]
            logits, _ = run(ws, Lc - w, start_B - sh - w, write)
            return logits
        return f

    def skip_prefix(_):
        return zero[0]

    branches = [branch(j) for j in range(spec.num_blocks)]
    logits = jax.lax.cond(jnp.any(need_win), lambda _: jax.lax.switch(j_min, branches, None), skip_prefix, None)
    return logits, None, None
