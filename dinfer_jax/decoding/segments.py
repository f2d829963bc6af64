"""Continuous batching: the one-jit loop run in bounded segments, rows swapped in between.

A `RunningBatch` owns one compiled program family, (DecodeSpec, gen_start, B): a paused loop
state on the device plus the host's copy of the row context (pads, prompt lengths, knobs).
  step(n)  runs at most n loop iterations, returning early as soon as some row finishes (one
           host sync per segment: the `done` flags); finished rows are read out and their slots
           freed.
  admit()  puts new prompts into free slots: their rows are built by the loop's own init (the
           prefill, for block diffusion) and merged into the state row by row. Every per-row
           leaf (canvas, cache, counters, block/step position, RNG position) is replaced whole,
           so a freed slot's old contents can never leak into the new row, and a prompt decodes
           exactly as it would alone (same tokens, same forwards: tests/test_segments.py).
Rows never mix inside the loop body (every per-row quantity is derived from that row's state
and context), which is what makes a row's trajectory independent of its neighbours. Batch-wide
counters (nfe_full / nfe_window / iters) keep accumulating; per-row counters restart at admission.
A row's iteration bound is its own (`it` < spec.max_iterations), not the batch's.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.decoding.loop import KNOBS, DecodeSpec, loop_functions, loop_stats

BATCH_AXIS = {"kv": 1}  # state leaves whose batch axis is not the first ((layers, B, L, K, H) caches)


def merge_rows(state: dict, fresh: dict, take_B) -> dict:
    """state with the rows where take_B is True replaced by fresh's (every per-row leaf; scalars,
    the batch-wide counters, keep state's)."""
    out = {}
    for k, v in state.items():
        axis = BATCH_AXIS.get(k, 0)

        def pick(a, b, axis=axis):
            if a.ndim == 0:
                return a
            shape = [1] * a.ndim
            shape[axis] = a.shape[axis]
            return jnp.where(take_B.reshape(shape), b, a)
        out[k] = jax.tree_util.tree_map(pick, v, fresh[k])
    return out


def segment_program(module, spec: DecodeSpec, gen_start: int, Lc: int):
    """-> (init(params, canvas, pad, plen, active, knobs) -> state,
           segment(params, state, pad, plen, knobs, max_iters) -> state) as plain functions (jit them)."""

    def init(params, canvas_BL, pad_B, plen_B, active_B, knobs):
        fn, _, _ = loop_functions(module, params, spec, pad_B, plen_B, gen_start, Lc, knobs)
        return fn(canvas_BL, active_B)

    def segment(params, state, pad_B, plen_B, knobs, max_iters):
        _, body, _ = loop_functions(module, params, spec, pad_B, plen_B, gen_start, Lc, knobs)
        done0 = state["done"]

        def cond(c):
            s, n = c
            return jnp.any(~s["done"]) & (n < max_iters) & ~jnp.any(s["done"] & ~done0)

        def step(c):
            s, n = c
            s = body(s)
            s["done"] = s["done"] | (s["it"] >= spec.max_iterations)  # the row's own bound
            return s, n + 1

        with jax.named_scope("denoise_segment"):
            final, _ = jax.lax.while_loop(cond, step, (state, jnp.zeros((), jnp.int32)))
        return final

    return init, segment


@dataclasses.dataclass
class RowResult:
    """One finished row: generated ids (cut at the first stop id), the raw generation region, its
    forwards, tokens per forward, edits (block diffusion), whether it hit the iteration bound with
    masks left (only with non-finite logits)."""
    tag: Any
    token_ids: list[int]
    raw_ids: np.ndarray
    nfe: int
    tpf: float
    steps_per_block: np.ndarray
    edits: int | None
    capped: bool


class RunningBatch:
    """B slots decoding under one DecodeSpec and prompt bucket (module doc). Not thread safe: one
    scheduler thread drives it."""

    def __init__(self, generator, spec: DecodeSpec, gen_start: int, batch: int):
        self.gen, self.spec, self.gen_start, self.B = generator, spec, gen_start, batch
        cfg = generator.model.config
        self.cfg = cfg
        self.Lc = gen_start + spec.gen_length + spec.tail_room
        self.slots: list[Any] = [None] * batch  # request tag per slot (None: free)
        self.pad = np.full((batch,), gen_start, np.int32)
        self.plen = np.zeros((batch,), np.int32)
        self.knobs = {k: np.zeros((batch,), np.uint32 if k == "seed" else np.float32) for k in KNOBS}
        self.knobs["threshold"][:] = 1.0
        self._init, self._segment, self._merge = generator.segment_programs(spec, gen_start, batch)
        self.state = None
        self.segments = 0

    @property
    def free(self) -> list[int]:
        return [b for b, t in enumerate(self.slots) if t is None]

    @property
    def running(self) -> int:
        return sum(t is not None for t in self.slots)

    def fits(self, prompt_len: int) -> bool:
        return prompt_len + self.spec.head_room <= self.gen_start

    def admit(self, items) -> list[int]:
        """items: [(tag, prompt ids (1-D int array), SamplingParams)] with the batch's spec, at most
        len(self.free) of them, each fitting the prompt bucket. -> the slots they took."""
        free = self.free
        if len(items) > len(free):
            raise ValueError(f"{len(items)} rows for {len(free)} free slots")
        cfg, spec = self.cfg, self.spec
        canvas = np.full((self.B, self.Lc), cfg.pad_id, np.int32)
        take = np.zeros((self.B,), bool)
        used = []
        items = [(tag, np.asarray(ids, np.int32), sp) for tag, ids, sp in items]
        for tag, ids, sp in items:  # all checked before any slot changes
            if sp.spec_for(cfg) != spec:
                raise ValueError("a row's SamplingParams select a different compiled program than this batch's")
            if not self.fits(len(ids)):
                raise ValueError(f"prompt of {len(ids)} tokens does not fit the batch's bucket ({self.gen_start})")
        for (tag, ids, sp), b in zip(items, free):
            canvas[b, self.gen_start - len(ids):self.gen_start] = ids
            canvas[b, self.gen_start:self.gen_start + spec.gen_length] = cfg.mask_token_id
            self.pad[b], self.plen[b] = self.gen_start - len(ids), len(ids)
            for k in KNOBS:
                v = getattr(sp, k)
                self.knobs[k][b] = 1.0 if v is None else v
            self.slots[b] = tag
            take[b] = True
            used.append(b)
        put = self.gen.model.place_batch
        args = (put(self.pad), put(self.plen), {k: put(v) for k, v in self.knobs.items()})
        fresh = self._init(self.gen.model.params, put(canvas), args[0], args[1], put(take), args[2])
        self.state = fresh if self.state is None else self._merge(self.state, fresh, put(take))
        return used

    def step(self, max_iters: int) -> list[RowResult]:
        """Run one segment (at most max_iters iterations; it ends early when a row finishes) and
        return the rows that finished (their slots are freed)."""
        if self.state is None or not self.running:
            return []
        put = self.gen.model.place_batch
        self.state = self._segment(self.gen.model.params, self.state, put(self.pad), put(self.plen),
                                   {k: put(v) for k, v in self.knobs.items()}, np.int32(max_iters))
        self.segments += 1
        done = np.asarray(jax.device_get(self.state["done"]))
        finished = [b for b in range(self.B) if self.slots[b] is not None and done[b]]
        return self._read(finished) if finished else []

    def evict(self, slots: list[int]):
        """Stop decoding the rows in `slots` (their requests were cancelled or timed out): they are
        marked done, so the next segments skip them, and the slots are free for new rows."""
        if not slots or self.state is None:
            return
        sel = np.zeros((self.B,), bool)
        sel[list(slots)] = True
        self.state = {**self.state, "done": self.state["done"] | self.gen.model.place_batch(sel)}
        for b in slots:
            self.slots[b] = None

    def progress(self):
        """Host copies of the running canvas' generation region (B, G), block index (B,) and done (B,)."""
        from dinfer_jax.engine import to_host
        s = self.state
        return (to_host(s["x"])[:, self.gen_start:self.gen_start + self.spec.gen_length], to_host(s["blk"]),
                to_host(s["done"]))

    def _read(self, rows: list[int]) -> list[RowResult]:
        from dinfer_jax.engine import row_output, to_host
        spec, cfg = self.spec, self.cfg
        s = self.state
        canvas, it = to_host(s["x"]), to_host(s["it"])
        stats = jax.tree_util.tree_map(to_host, loop_stats(s, self._stat_keys()))
        out = []
        for b in rows:
            raw = canvas[b, self.gen_start:self.gen_start + spec.gen_length]
            nfe = int(stats["row_nfe"][b])
            ids, tpf = row_output(raw, nfe, cfg, bool(self.knobs["ignore_eos"][b]))
            out.append(RowResult(self.slots[b], ids, raw, nfe, tpf,
                                 stats["steps_per_block"][b], int(stats["edits"][b]) if "edits" in stats else None,
                                 bool(int(it[b]) >= spec.max_iterations and (raw == cfg.mask_token_id).any())))
            self.slots[b] = None
        return out

    def _stat_keys(self):
        keys = ("row_nfe", "steps_per_block", "done")
        return keys + (("edits",) if "edits" in self.state else ())
