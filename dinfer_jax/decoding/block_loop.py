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
from dinfer_jax.decoding.block_strategies import (block_decide, indel_step, sub_block_candidates,
                                                  sub_block_refresh, transfer_schedule)
from dinfer_jax.decoding.strategies import forbid_eos


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
    base_keys = jax.vmap(lambda s: jax.random.key(s))(knobs.seed.astype(jnp.uint32))

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
                logits = constrain_logits(logits, window_slice(knobs.allow_class, start_B, Bk), knobs.allowed,
                                          x_blk)
            n_B = None
            if spec.steps_per_block:
                n_B = jnp.maximum(knobs.num_to_transfer.astype(jnp.int32),
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
            has_eos |= has_eot & (knobs.ignore_eos <= 0)
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
