"""Continuous batching: the one-jit loop run in bounded segments, rows swapped in between.
`RunningBatch` holds a paused loop state (loop_state.py) for one (DecodeSpec, gen_start, B) and the
host's row context: `step(n)` runs at most n iterations (ends early when a row finishes), `admit`
builds new rows with the loop's own init and merges them in, `take_rows` moves rows between batch
sizes; a row decodes exactly as alone. Details: docs/internals/decoding_loops.md."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax.cache import cache_shape
from dinfer_jax.decoding.loop import loop_functions
from dinfer_jax.decoding.spec import ROW_KNOBS, DecodeSpec, RowKnobs, same_program
from dinfer_jax.decoding.row_state import record_region
from dinfer_jax.decoding.rows import knob_value, place_row, row_output, row_record
from dinfer_jax.sharding import to_host

def abstract_state(state):
    """The shapes and dtypes of a loop state, with the shardings of committed (mesh-placed) leaves
    only (None stays None): what a row mover compiles for (docs/internals/decoding_loops.md)."""
    if state is None:
        return None
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, **({"sharding": a.sharding} if a.committed else {})), state)


def segment_program(module, spec: DecodeSpec, gen_start: int, Lc: int, refresh_rows: tuple[int, ...] = ()):
    """-> (init(params, canvas, pad, plen, active, knobs[, cached_kv, width]) -> state,
           segment(params, state, pad, plen, knobs, max_iters) -> state) as plain functions (jit them;
    `width` static; refresh_rows: loop.loop_functions). With cached_kv (block diffusion only), the prefill computes only the last
    `width` prompt positions over the cached prompt K/V (decoding/prefix_cache.py)."""

    def init(params, canvas_BL, pad_B, plen_B, active_B, knobs, cached_kv=None, width=None):
        fn, _ = loop_functions(module, params, spec, pad_B, plen_B, gen_start, Lc, knobs)
        if cached_kv is None:
            return fn(canvas_BL, active_B)
        return fn(canvas_BL, active_B, prefix=(cached_kv, width))

    def segment(params, state, pad_B, plen_B, knobs, max_iters):
        _, body = loop_functions(module, params, spec, pad_B, plen_B, gen_start, Lc, knobs,
                                    refresh_rows=refresh_rows)
        done0 = state.done
        bound_B = (spec.row_max_iterations(knobs.gen_length) if knobs.gen_length is not None
                   else jnp.full(done0.shape, spec.max_iterations, jnp.int32))

        def cond(c):
            s, n = c
            return jnp.any(~s.done) & (n < max_iters) & ~jnp.any(s.done & ~done0)

        def step(c):
            s, n = c
            s = body(s)
            return s.replace(done=s.done | (s.it >= bound_B)), n + 1  # the row's own bound

        with jax.named_scope("denoise_segment"):
            final, _ = jax.lax.while_loop(cond, step, (state, jnp.zeros((), jnp.int32)))
        return final

    return init, segment


@dataclasses.dataclass
class RowResult:
    """One finished row: generated ids (cut at the first stop id), the raw generation region, its
    forwards, tokens per forward, edits, whether masks were left (hit its iteration bound), and the
    commit record over all of raw_ids (rows.row_record; callers cut it where they cut the ids)."""
    tag: Any
    token_ids: list[int]
    raw_ids: np.ndarray
    nfe: int
    tpf: float
    steps_per_block: np.ndarray
    edits: int | None
    capped: bool
    commit_steps: list[int] | None = None
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class RunningBatch:
    """B slots decoding under one DecodeSpec and prompt bucket (module doc). Not thread safe: one
    scheduler thread drives it."""

    def __init__(self, generator, spec: DecodeSpec, gen_start: int, batch: int, use_prefix_cache: bool = True,
                 background=None):
        self.gen, self.spec, self.gen_start, self.B = generator, spec, gen_start, batch
        cfg = generator.model.config
        self.cfg = cfg
        self.Lc = gen_start + spec.gen_length + spec.tail_room
        self.slots: list[Any] = [None] * batch  # request tag per slot (None: free)
        self.pad = np.full((batch,), gen_start, np.int32)
        self.plen = np.zeros((batch,), np.int32)
        self.knobs = RowKnobs.build(lambda k, dt: np.zeros((batch,), dt), ROW_KNOBS)
        self.knobs.threshold[:] = 1.0
        self.glen = np.full((batch,), spec.gen_length, np.int32)  # each slot's own gen_length
        self.top_n: list[int | None] = [None] * batch  # each slot's SamplingParams.logprobs
        self._init, self._segment, self._merge, self._init_prefix = generator.segment_programs(spec, gen_start, batch)
        pc = getattr(generator, "prefix_cache", None)
        self.prefix_cache = pc if use_prefix_cache and pc is not None and pc.enabled and spec.cache == "block" else None
        # The server's compile thread: when given, a prefix prefill width not yet compiled is compiled
        # there (background(spec, gen_start, B, width)) and this admission prefills in full instead.
        self.background = background
        self._keys: dict[int, list] = {}
        self.state = None
        self.segments = 0
        self._ctx = None  # device copies of (pad, plen, knobs): uploaded by each admission, read by every segment

    @property
    def free(self) -> list[int]:
        return [b for b, t in enumerate(self.slots) if t is None]

    @property
    def running(self) -> int:
        return sum(t is not None for t in self.slots)

    def fits(self, prompt_len: int) -> bool:
        return prompt_len + self.spec.head_room <= self.gen_start

    def accepts(self, spec: DecodeSpec) -> bool:
        """Whether a row decoded with `spec` (its own gen_length) can join this batch: the same
        settings and a gen_length within the program's region."""
        return same_program(spec, self.spec)

    def admit(self, items, check: bool = True) -> list[int]:
        """items: [(tag, prompt ids (1-D int array), SamplingParams)] with the batch's spec, at most
        len(self.free) of them, each fitting the prompt bucket. -> the slots they took.
        check=False: the SamplingParams only give knobs (warm-up rows)."""
        free = self.free
        if len(items) > len(free):
            raise ValueError(f"{len(items)} rows for {len(free)} free slots")
        cfg, spec = self.cfg, self.spec
        canvas = np.full((self.B, self.Lc), cfg.pad_id, np.int32)
        take = np.zeros((self.B,), bool)
        used = []
        items = [(tag, np.asarray(ids, np.int32), sp) for tag, ids, sp in items]
        for tag, ids, sp in items:  # all checked before any slot changes
            if check and not self.accepts(sp.spec_for(cfg)):
                raise ValueError("a row's SamplingParams select a different compiled program than this batch's")
            if not self.fits(len(ids)):
                raise ValueError(f"prompt of {len(ids)} tokens does not fit the batch's bucket ({self.gen_start})")
        for (tag, ids, sp), b in zip(items, free):
            glen = min(sp.gen_length, spec.gen_length)
            place_row(canvas, self.pad, self.plen, b, ids, self.gen_start, glen, cfg.mask_token_id)
            self.glen[b] = glen
            for k in ROW_KNOBS:
                getattr(self.knobs, k)[b] = knob_value(sp, k)
            self.knobs.gen_length[b] = glen
            self.top_n[b] = sp.logprobs
            self.slots[b] = tag
            take[b] = True
            used.append(b)
        put = self.gen.model.place_batch
        args = self._ctx = (put(self.pad), put(self.plen), jax.tree_util.tree_map(put, self.knobs))
        pc = self.prefix_cache
        hits = self._lookup(items, used) if pc is not None else None
        if hits is not None and hits[1] < self.gen_start:  # prefill only the uncached prompt tails
            cached, width = hits
            fresh = self._init_prefix(self.gen.model.params, put(canvas), args[0], args[1], put(take), args[2],
                                      cached, width)
        else:
            width = self.gen_start
            fresh = self._init(self.gen.model.params, put(canvas), args[0], args[1], put(take), args[2])
        if pc is not None:
            self._store(items, used, fresh.kv, width)
        self.state = fresh if self.state is None else self._merge(self.state, fresh, put(take))
        return used

    def move_key(self, src: "RunningBatch") -> tuple:
        """The Generator's key of the program that moves src's rows into this batch."""
        return self.gen.move_key(self.spec, self.gen_start, src.B, self.B, self.state is None)

    def take_rows(self, src: "RunningBatch", slots: list[int]) -> list[int]:
        """Move src's running rows `slots` into free slots of this batch (same settings and prompt
        bucket, any batch size); each row goes on exactly as in src. All or nothing. -> the slots
        they took here (the move program: docs/internals/decoding_loops.md)."""
        if (src.spec, src.gen_start) != (self.spec, self.gen_start):
            raise ValueError("rows move only between batches of the same program settings and prompt bucket")
        slots = list(slots)
        if any(src.slots[b] is None for b in slots):
            raise ValueError("only running rows move")
        free = self.free
        if len(slots) > len(free):
            raise ValueError(f"{len(slots)} rows for {len(free)} free slots")
        used = free[:len(slots)]
        if not slots:
            return used
        src_of = np.zeros((self.B,), np.int32)
        take = np.zeros((self.B,), bool)
        src_of[used], take[used] = slots, True
        # everything that can fail first (the mover, the uploads); then the host side, all at once
        pad, plen, glen = self.pad.copy(), self.plen.copy(), self.glen.copy()
        knobs = jax.tree_util.tree_map(np.copy, self.knobs)
        pad[used], plen[used], glen[used] = src.pad[slots], src.plen[slots], src.glen[slots]
        for k in ROW_KNOBS:
            getattr(knobs, k)[used] = getattr(src.knobs, k)[slots]
        put = self.gen.model.place_batch  # the gathered rows land sharded as this batch's
        state = self.gen.move_program(self.move_key(src))(self.state, src.state, put(src_of), put(take))
        ctx = (put(pad), put(plen), jax.tree_util.tree_map(put, knobs))
        gone = np.zeros((src.B,), bool)
        gone[slots] = True
        src_done = src.state.done | put(gone)
        self.state, self._ctx, self.pad, self.plen, self.glen, self.knobs = state, ctx, pad, plen, glen, knobs
        for d, b in zip(used, slots):
            self.top_n[d], self.slots[d] = src.top_n[b], src.slots[b]
            src.slots[b] = None
        src.state = src.state.replace(done=src_done)
        return used

    # ---- prompt prefix cache (block-causal models; decoding/prefix_cache.py)

    def _lookup(self, items, slots):
        """Cached prompt blocks of the admitted rows -> (cached K/V on the canvas, prefill width W) or
        None when nothing is cached. W (a multiple of the block, power-of-two blocks, at most
        gen_start) covers every row's uncached prompt tail."""
        from dinfer_jax.decoding.prefix_cache import chain_keys
        Bk = self.spec.block_length
        need, hit, rows, starts = Bk, [], [], []
        self._keys = {}
        for (tag, ids, sp), b in zip(items, slots):
            keys = chain_keys(ids, Bk)
            self._keys[b] = keys
            got = self.prefix_cache.lookup(keys)
            hit += got
            rows += [b] * len(got)
            starts += [int(self.pad[b]) + k * Bk for k in range(len(got))]
            need = max(need, len(ids) - len(got) * Bk)
        width = Bk
        while width < need:
            width *= 2
        width = min(width, self.gen_start)
        if hit and width < self.gen_start and self.background is not None and \
                not self.gen.segment_programs_ready(self.spec, self.gen_start, self.B, width):
            self.background(self.spec, self.gen_start, self.B, width)  # compiled off this thread; full prefill now
            width = self.gen_start
        self.prefix_cache.count_prefill(width * len(items), self.gen_start * len(items))
        if not hit or width >= self.gen_start:
            return None
        return self.prefix_cache.place(hit, rows, starts, self.B, self.gen_start), width

    def compile_prefix_prefill(self, width: int):
        """Compile (by running on zeros) the prefill over cached prompt K/V of this `width`."""
        cfg, put = self.cfg, self.gen.model.place_batch
        shape = cache_shape(cfg.num_layers, self.B, self.gen_start, cfg.num_kv_heads, cfg.head_dim)
        zeros = jnp.zeros(shape, self.gen.model.module.dtype)
        canvas = np.full((self.B, self.Lc), cfg.pad_id, np.int32)
        out = self._init_prefix(self.gen.model.params, put(canvas), put(self.pad), put(self.plen),
                                put(np.zeros((self.B,), bool)), jax.tree_util.tree_map(put, self.knobs),
                                (zeros, zeros), width)
        jax.block_until_ready(out)

    def _store(self, items, slots, kv, width):
        """Insert the admitted rows' full prompt blocks that the prefill just computed."""
        Bk = self.spec.block_length
        keys, rows, starts = [], [], []
        for (tag, ids, sp), b in zip(items, slots):
            for k, key in enumerate(self._keys.get(b, [])):
                start = int(self.pad[b]) + k * Bk
                if start >= self.gen_start - width:  # computed by this prefill (earlier ones came from the cache)
                    keys.append(key)
                    rows.append(b)
                    starts.append(start)
        if keys:
            self.prefix_cache.insert(keys, kv, rows, starts, Bk)

    def step(self, max_iters: int) -> list[RowResult]:
        """Run one segment (at most max_iters iterations; it ends early when a row finishes) and
        return the rows that finished (their slots are freed)."""
        if self.state is None or not self.running:
            return []
        pad, plen, knobs = self._ctx  # set by the admission that made self.state
        self.state = self._segment(self.gen.model.params, self.state, pad, plen, knobs, np.int32(max_iters))
        self.segments += 1
        done = np.asarray(jax.device_get(self.state.done))
        finished = [b for b in range(self.B) if self.slots[b] is not None and done[b]]
        return self._read(finished) if finished else []

    def finish(self, slots: list[int]) -> list[RowResult]:
        """End the rows in `slots` now (e.g. a stop string is committed): their results as decoded
        so far (positions not yet decoded hold the mask id); the slots are freed."""
        out = self._read(list(slots))
        self.evict(slots)
        return out

    def abandon(self) -> list:
        """Drop every row and the state (after a failed program or admission: the state is not
        trusted) -> the slots' tags as they were (None for free slots)."""
        tags, self.slots, self.state = self.slots, [None] * self.B, None
        return tags

    def evict(self, slots: list[int]):
        """Stop decoding the rows in `slots` (their requests were cancelled or timed out): they are
        marked done, so the next segments skip them, and the slots are free for new rows."""
        if not slots or self.state is None:
            return
        sel = np.zeros((self.B,), bool)
        sel[list(slots)] = True
        self.state = self.state.replace(done=self.state.done | self.gen.model.place_batch(sel))
        for b in slots:
            self.slots[b] = None

    def progress(self):
        """Host copies of the running canvas' generation region (B, G), block index (B,) and done (B,)."""
        s = self.state
        return (to_host(s.x)[:, self.gen_start:self.gen_start + self.spec.gen_length], to_host(s.blk),
                to_host(s.done))

    def progress_steps(self) -> np.ndarray:
        """Host copy of each row's decoder steps since its admission (B,) int32 (the state's `it`)."""
        return to_host(self.state.it)

    def progress_record(self):
        """Host copies of the running commit record over the generation region (row_state.record_region:
        commit_it (B, G), and with logprobs commit_lp (B, G), top_ids / top_lp (B, G, N))."""
        return jax.tree_util.tree_map(to_host, record_region(self.state, self.gen_start, self.spec.gen_length))

    def _read(self, rows: list[int]) -> list[RowResult]:
        spec, cfg = self.spec, self.cfg
        s = self.state
        canvas = to_host(s.x)
        st = s.stats()
        stats = jax.tree_util.tree_map(to_host, (st.row_nfe, st.steps_per_block, st.edits))
        row_nfe, steps_per_block, edits = stats
        rec = jax.tree_util.tree_map(to_host, record_region(s, self.gen_start, spec.gen_length))
        out = []
        for b in rows:
            raw = canvas[b, self.gen_start:self.gen_start + int(self.glen[b])]
            nfe = int(row_nfe[b])
            ids, tpf = row_output(raw, nfe, cfg, bool(self.knobs.ignore_eos[b]))
            out.append(RowResult(self.slots[b], ids, raw, nfe, tpf,
                                 steps_per_block[b], None if edits is None else int(edits[b]),
                                 bool((raw == cfg.mask_token_id).any()),
                                 *row_record(rec, b, len(raw), self.top_n[b])))
            self.slots[b] = None
        return out

