"""The decoding loops' carried state as typed pytrees: one class per mode (full canvas: loop.py;
block diffusion: block_loop.py), the commit record both share, and the row operations the
continuous scheduler applies between segments (merge fresh rows in, move rows between batch
sizes). Letters: B rows, L canvas, S block, V vocab, D model, NB blocks, N top log-probs."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

Array = Any


@flax.struct.dataclass
class CommitRecord:
    """Which step wrote each canvas token and its log-probabilities (row_state.commit_record).
    commit_it (B, L) int32, -1 where never written; commit_lp (B, L) fp32 with logprobs >= 0;
    top_ids (B, L, N) int32 and top_lp (B, L, N) fp32 with logprobs = N > 0."""
    commit_it: Array
    commit_lp: Optional[Array] = None
    top_ids: Optional[Array] = None
    top_lp: Optional[Array] = None


@flax.struct.dataclass
class LoopStats:
    """What a finished or paused loop reports. Per row (B,): done, row_nfe; steps_per_block (B, NB);
    batch-wide (): iters, nfe_full, nfe_window. Mode-specific (None elsewhere): nfe_partial () (cached
    full-canvas loop), edits (B,) / nfe_commit () (block diffusion), inserts / deletes (B,) (indel),
    row_sub (B,) (sub-block cache). record: the commit record, over the generation region once
    `generate_loop` returns."""
    done: Array
    row_nfe: Array
    steps_per_block: Array
    iters: Array
    nfe_full: Array
    nfe_window: Array
    record: Optional[CommitRecord] = None
    nfe_partial: Optional[Array] = None
    edits: Optional[Array] = None
    nfe_commit: Optional[Array] = None
    inserts: Optional[Array] = None
    deletes: Optional[Array] = None
    row_sub: Optional[Array] = None


@flax.struct.dataclass
class CanvasLoopState:
    """The full-canvas loop (cache none / prefix / dual / vicinity). Per row (B,): blk (block
    index), stp (step within the block), it (steps since admission), done, n_entry (masks when the
    block started), row_nfe; steps_per_block (B, NB); batch-wide counters (): nfe_full,
    nfe_window, nfe_partial, iters. Optional: kv ((layers, B, L, K*H) x 2, cached modes), credit
    (B, S, V) fp32 (strategy credit), soft (B, L, D) (smoothing)."""
    x: Array
    blk: Array
    stp: Array
    it: Array
    done: Array
    n_entry: Array
    row_nfe: Array
    steps_per_block: Array
    nfe_full: Array
    nfe_window: Array
    nfe_partial: Array
    iters: Array
    record: CommitRecord
    kv: Optional[tuple] = None
    credit: Optional[Array] = None
    soft: Optional[Array] = None

    def stats(self) -> LoopStats:
        """The counters a finished or paused loop reports (generate_loop's; GenerationResult's counters)."""
        return LoopStats(done=self.done, row_nfe=self.row_nfe, steps_per_block=self.steps_per_block, iters=self.iters,
                         nfe_full=self.nfe_full, nfe_window=self.nfe_window, record=self.record,
                         nfe_partial=self.nfe_partial)


@flax.struct.dataclass
class IndelState:
    """LLaDA2.2 insert / delete editing, per row: orig (B, S) bool (the block's original
    positions), seen / hist (B, H, S) int32 (the tokens each update step saw; H steps)."""
    orig: Array
    seen: Array
    hist: Array


@flax.struct.dataclass
class BlockLoopState:
    """The block-diffusion loop (cache "block"). Per row (B,): blk, stp, post (post-fill steps),
    it, done, row_nfe, edits; steps_per_block (B, NB); batch-wide (): nfe_window, nfe_commit
    (forwards that commit a finished block's K/V), iters; kv (layers, B, L, K*H) x 2. Optional:
    row_sub (B,) / nfe_sub () (sub-block cache forwards), ind / inserts / deletes (indel)."""
    x: Array
    kv: tuple
    blk: Array
    stp: Array
    post: Array
    it: Array
    done: Array
    row_nfe: Array
    edits: Array
    steps_per_block: Array
    nfe_window: Array
    nfe_commit: Array
    iters: Array
    record: CommitRecord
    row_sub: Optional[Array] = None
    nfe_sub: Optional[Array] = None
    ind: Optional[IndelState] = None
    inserts: Optional[Array] = None
    deletes: Optional[Array] = None

    def stats(self) -> LoopStats:
        """As CanvasLoopState.stats: every forward here is a window (none covers the whole canvas)."""
        return LoopStats(done=self.done, row_nfe=self.row_nfe, steps_per_block=self.steps_per_block, iters=self.iters,
                         nfe_full=jnp.zeros((), jnp.int32), record=self.record,
                         nfe_window=self.nfe_window + self.nfe_commit + (0 if self.nfe_sub is None else self.nfe_sub),
                         edits=self.edits, nfe_commit=self.nfe_commit, inserts=self.inserts, deletes=self.deletes,
                         row_sub=self.row_sub)


LoopState = CanvasLoopState | BlockLoopState
BATCH_AXIS = {"kv": 1}  # fields whose batch axis is not the first ((layers, B, L, K*H) caches)


def _per_field(fn, *states):
    """fn(leaf_axis) applied field by field over states of one class -> a state of that class."""
    out = {}
    for f in dataclasses.fields(states[0]):
        vals = [getattr(s, f.name) for s in states]
        if vals[0] is None:
            out[f.name] = None
            continue
        axis = BATCH_AXIS.get(f.name, 0)
        out[f.name] = jax.tree_util.tree_map(lambda *leaves, axis=axis: fn(axis, *leaves), *vals)
    return type(states[0])(**out)


def merge_rows(state: LoopState, fresh: LoopState, take_B) -> LoopState:
    """state with the rows where take_B (B,) holds replaced by fresh's (every per-row leaf;
    scalars, the batch-wide counters, keep state's)."""
    def pick(axis, a, b):
        if a.ndim == 0:
            return a
        shape = [1] * a.ndim
        shape[axis] = a.shape[axis]
        return jnp.where(take_B.reshape(shape), b, a)
    return _per_field(pick, state, fresh)


def move_rows(dst: LoopState | None, src: LoopState, src_of_D, take_D) -> LoopState:
    """A D-row state whose rows where take_D (D,) holds are src's rows src_of_D (D,) (a gather along
    each leaf's batch axis); the other rows keep dst's (dst None: they are src's row src_of_D,
    marked done, so they never step and an admission replaces them whole). Scalars (batch-wide
    counters) keep dst's (src's when dst is None)."""
    if dst is None:
        out = _per_field(lambda axis, a: a if a.ndim == 0 else jnp.take(a, src_of_D, axis=axis), src)
        return out.replace(done=out.done | ~take_D)

    def move(axis, a, b):
        if a.ndim == 0:
            return b
        shape = [1] * a.ndim
        shape[axis] = take_D.shape[0]
        return jnp.where(take_D.reshape(shape), jnp.take(a, src_of_D, axis=axis), b)
    return _per_field(move, src, dst)
