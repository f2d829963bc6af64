"""Per-row pieces both decoding loops (loop.py, block_loop.py) share: each row's generation end and
the commit record (which step wrote each token, its log-probability and top alternatives)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dinfer_jax.cache import window_slice, window_write
from dinfer_jax.decoding.loop_state import CommitRecord


def row_gen_end(knobs, gen_start: int, spec):
    """Per-row end of the generation region (B,): gen_start + the row's gen_length (spec.gen_length
    when the knob is absent)."""
    if knobs.gen_length is None:
        return jnp.full(knobs.seed.shape, gen_start + spec.gen_length, jnp.int32)
    return gen_start + jnp.minimum(knobs.gen_length.astype(jnp.int32), spec.gen_length)


def commit_record_init(B: int, Lc: int, spec) -> CommitRecord:
    """The per-row commit record of the loop state (batch on axis 0, canvas positions L):
    commit_it (B, L) int32: the row's iteration (its own `it`) that wrote the token now at each
    position, -1 where the decoder never wrote (prompt, pads, undecoded masks, early-stop fill);
    with spec.logprobs = N >= 0 also commit_lp (B, L) fp32, the written token's log-probability,
    and with N > 0 top_ids (B, L, N) int32 / top_lp (B, L, N) fp32, the N most probable tokens
    there (descending; ties: lower id) and their log-probabilities (`commit_record` defines them)."""
    rec = CommitRecord(jnp.full((B, Lc), -1, jnp.int32))
    if spec.logprobs >= 0:
        rec = rec.replace(commit_lp=jnp.zeros((B, Lc), jnp.float32))
    if spec.logprobs > 0:
        rec = rec.replace(top_ids=jnp.zeros((B, Lc, spec.logprobs), jnp.int32),
                          top_lp=jnp.zeros((B, Lc, spec.logprobs), jnp.float32))
    return rec


def commit_record(s, wrote_BS, tok_BS, logits_BSV, start_B, spec) -> CommitRecord:
    """The loop state s's commit record (`commit_record_init`) after a step that wrote tok_BS where wrote_BS
    into each row's window [start_b, start_b + S) of the canvas; a rewritten position (editing)
    takes the values of its last write. The log-probability is log_softmax(logits_BSV) in fp32:
    the logits the strategy received for that position at this step (the model's output, with the
    EOS ban of ignore_eos / min_tokens applied), before any temperature, top-k / top-p, credit or
    Dream filter -- the distribution of the committing step, not a left-to-right likelihood."""
    S = wrote_BS.shape[1]
    r = s.record
    old = window_slice(r.commit_it, start_B, S)
    r = r.replace(commit_it=window_write(r.commit_it, jnp.where(wrote_BS, s.it[:, None], old), start_B))
    if spec.logprobs < 0:
        return r
    lp = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(lp, tok_BS[..., None], axis=-1)[..., 0]
    r = r.replace(commit_lp=window_write(r.commit_lp, picked, start_B, wrote_BS))
    if spec.logprobs > 0:
        vals, ids = jax.lax.top_k(lp, spec.logprobs)
        r = r.replace(top_lp=window_write(r.top_lp, vals, start_B, wrote_BS),
                      top_ids=window_write(r.top_ids, ids.astype(jnp.int32), start_B, wrote_BS))
    return r


def record_region(state, gen_start: int, gen_length: int):
    """A loop state's CommitRecord cut to the generation region [gen_start, gen_start + gen_length)
    of the canvas: commit_it (B, G), commit_lp (B, G), top_ids / top_lp (B, G, N), those present."""
    return jax.tree_util.tree_map(lambda v: v[:, gen_start:gen_start + gen_length], state.record)
