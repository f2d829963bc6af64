"""The continuous-batching scheduler (first done, first out): `ContinuousBatcher` decodes with
decoding/segments.RunningBatches stepped round robin in segments of at most `segment` iterations;
between segments finished rows are answered, waiting jobs take free slots, draining batches are
repacked, and new programs compile on a separate thread while the others keep stepping.
Placement, repacking, compilation, streaming and templated jobs: docs/serving.md."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Optional

import numpy as np

from dinfer_jax.decoding.segments import RunningBatch, abstract_state
from dinfer_jax.decoding.rows import row_record
from dinfer_jax.decoding.spec import InvalidParam, bucket_gen_length, program_spec, same_program
from dinfer_jax.engine import PROMPT_BUCKET
from dinfer_jax.serving.scheduler import Cancelled, Scheduler, log

DEFAULT_SEGMENT = 8  # iterations per segment (bench/segment_cost.py measures the boundary cost)
LINEAR_PROMPT_BUCKETS = 4  # prompt buckets: PROMPT_BUCKET multiples up to 4 of them, then powers of two


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prompt_bucket(n: int) -> int:
    """The prompt length a batch is built for (rows of up to it join): 32, 64, 96, 128, then 256,
    512, ... (fewer programs than the engine's multiples of 32; at most 2x padding past 128)."""
    linear = -(-max(1, n) // PROMPT_BUCKET) * PROMPT_BUCKET
    return linear if linear <= LINEAR_PROMPT_BUCKETS * PROMPT_BUCKET else _pow2(n)


def repack_size(rows: int, queued: int, slots: list[int], max_batch: int) -> int | None:
    """The batch size the batches of one program (`slots`: their sizes), holding `rows` running rows
    with `queued` jobs of that program waiting, should be repacked into, or None to leave them: the
    power of two covering rows + queued (at most max_batch), when their slots add up to at least
    twice it (shrink), or when there are several of them and their slots add up to at least it
    (merge: one forward per step instead of one per batch, no more rows computed)."""
    size = min(max_batch, _pow2(rows + queued))
    if not rows or size < rows:
        return None
    return size if sum(slots) >= 2 * size or (len(slots) > 1 and sum(slots) >= size) else None


@dataclasses.dataclass(eq=False)
class Booking:
    """The scheduler's bookkeeping of one RunningBatch: jobs assigned to it while its programs
    compile, the Future of that compile (None: ready), and whether it failed (then dropped)."""
    waiting: list = dataclasses.field(default_factory=list)
    compiling: Optional[concurrent.futures.Future] = None
    failed: bool = False

    def ready(self) -> bool:
        return self.compiling is None or self.compiling.done()


class ContinuousBatcher(Scheduler):
    """Continuous batching over RunningBatches (module doc). One scheduler thread."""
    EXTRA_STATS = ("segments", "admitted", "background_compiles", "waiting_for_compile", "evicted", "stopped_early",
                   "repacked")

    def __init__(self, generator, tokenizer, cfg, segment: int = DEFAULT_SEGMENT, max_programs: int = 4):
        self.segment, self.max_programs = segment, max_programs
        block_causal = generator.model.config.attention_mask == "block_causal"  # the only exact reuse
        generator.set_prefix_cache(int(cfg.prefix_cache_mb * 2 ** 20) if block_causal else 0)
        self.batches: list = []
        self._books: dict = {}  # RunningBatch -> Booking (the scheduler's, not the batch's)
        self.templated: list = []  # jobs with a canvas template: decoded as whole static batches (module doc)
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dinfer-compile")
        self._compiling: dict = {}  # program key -> Future (background compiles)
        self._compile_started: dict = {}  # program key -> monotonic start (the watchdog reads it)
        self._move_failed: set = set()  # row mover keys that failed to compile or run (not retried)
        super().__init__(generator, tokenizer, cfg)  # starts the scheduler thread (it idles until a submit)

    def _book(self, rb) -> Booking:
        """rb's Booking (made on first use)."""
        b = self._books.get(rb)
        if b is None:
            b = self._books[rb] = Booking()
        return b

    # ---- background compilation (the compile thread)

    def _compile_async(self, spec, gen_start, batch, width=None):
        """Future of compiling a batch's programs (width: a prefix prefill variant) off the scheduler
        thread; one per key. Completion wakes the scheduler."""
        key = (spec, gen_start, batch, width)
        with self.cond:
            fut = self._compiling.get(key)
            if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None and \
                    not self.gen.segment_programs_ready(spec, gen_start, batch, width):
                fut = None  # compiled once, dropped from the program cache since: compile again
            if fut is None:
                widths = () if width is None else (width,)

                def compile_():
                    self._compile_started[key] = time.monotonic()
                    try:
                        t = time.perf_counter()
                        self.gen.warm_segment_programs(spec, gen_start, batch, widths)
                        log.info("compiled a continuous batch program (B=%d, prompt bucket %d, gen %d%s) in "
                                 "%.1fs", batch, gen_start, spec.gen_length, f", prefix width {width}" if width
                                 else "", time.perf_counter() - t)
                    finally:
                        self._compile_started.pop(key, None)
                fut = self._compiler.submit(compile_)
                self._compiling[key] = fut
                self.stats["background_compiles"] += 1

                def wake(_):
                    with self.cond:
                        self.cond.notify_all()
                fut.add_done_callback(wake)
        return fut

    def _watch_more(self, now: float):
        """The watchdog's compile check: jobs waiting beside a compile that runs past
        cfg.compile_watchdog_s get 504 (the compile goes on; later jobs of its kind wait for it)."""
        late = {k for k, t0 in list(self._compile_started.items()) if now - t0 > self.cfg.compile_watchdog_s}
        for rb in list(self.batches):
            key = (rb.spec, rb.gen_start, rb.B, None)
            waiting = [j for j in list(self._book(rb).waiting) if not j.answered]
            if key in late and waiting:
                with self.cond:
                    self.stats["compile_timeouts"] += 1
                log.warning("watchdog: the compile of a B=%d program has run past %gs: %d waiting request(s) "
                            "get 504", rb.B, self.cfg.compile_watchdog_s, len(waiting))
                self._give_up(waiting, f"compiling this request's program exceeded the server's compile "
                                       f"watchdog bound of {self.cfg.compile_watchdog_s:g}s")

    def close(self, compile_wait_s: float = 120.0):
        """Stop the scheduler (Scheduler.close), then wait up to compile_wait_s for a background
        compile still running: nothing of this server compiles after it is closed."""
        super().close()
        self._compiler.shutdown(wait=False, cancel_futures=True)
        with self.cond:
            running = [f for f in self._compiling.values() if not f.done()]
        concurrent.futures.wait(running, timeout=compile_wait_s)

    def idle(self) -> bool:
        with self.cond:
            return not self.pending and not any(rb.running or self._book(rb).waiting for rb in self.batches) \
                and self.busy is None

    def _running_batch(self, params, size, max_prompt_len, gen_length=None):
        """An empty RunningBatch for prompts up to max_prompt_len, built for their prompt bucket."""
        return self.gen.running_batch(params, size, *self._bucketed(params, max_prompt_len, gen_length),
                                      background=self._compile_async)

    def _bucketed(self, params, max_prompt_len, gen_length):
        head_room = params.spec_for(self.gen.model.config).head_room
        return prompt_bucket(max_prompt_len + head_room) - head_room, gen_length

    def _ready_new(self, params, size, max_prompt_len, gen_length) -> bool:
        """Whether a new batch of these would run at once (its programs compiled; builds nothing)."""
        key = self.gen.running_batch_key(params, size, *self._bucketed(params, max_prompt_len, gen_length))
        return self.gen.segment_programs_ready(*key)

    def _new_batch(self, params, size, max_prompt_len, gen_length=None):
        return self._adopt(self._running_batch(params, size, max_prompt_len, gen_length))

    def _adopt(self, rb):
        """A new RunningBatch made ready for the scheduler (its programs compiled in the background)."""
        if not self.gen.segment_programs_ready(rb.spec, rb.gen_start, rb.B):
            self._book(rb).compiling = self._compile_async(rb.spec, rb.gen_start, rb.B)
        return rb

    # ---- --warmup (Scheduler._main calls these before the first job)

    def _warmup_sizes(self) -> list[int]:
        """The batch sizes `_pick` creates: powers of two up to max_batch, and max_batch."""
        sizes, b = [], 1
        while b < self.cfg.max_batch:
            sizes.append(b)
            b *= 2
        return sizes + [self.cfg.max_batch]

    def _warmup_prompts(self) -> list[np.ndarray]:
        """One prompt per prompt bucket (`prompt_bucket`) up to cfg.warmup_prompt_len."""
        tok = self.gen.model.config.filler_id
        buckets = sorted({prompt_bucket(n) for n in range(1, max(1, self.cfg.warmup_prompt_len) + 1)})
        return [np.full((n,), tok, np.int32) for n in buckets]

    def _warmup_batch(self, p, size, ids) -> int:
        """Compile a RunningBatch of `size` slots for prompts of len(ids) (its bucket): what `_pick`
        checks before a new batch of this kind runs; and (repacking on) the movers from it into an
        empty batch of each other size (smaller: a shrink; larger: a merge). -> programs compiled."""
        rb = self._running_batch(p, size, len(ids), bucket_gen_length(p.spec_for(self.gen.model.config)))
        n = 0
        if not self.gen.segment_programs_ready(rb.spec, rb.gen_start, rb.B):
            self.gen.warm_segment_programs(rb.spec, rb.gen_start, rb.B)
            n = 1
        others = [d for d in self._warmup_sizes() if d != size]
        if self.cfg.repack and others:  # the movers from this batch into an empty one of each other size
            rb.admit([(0, ids, p)], check=False)  # a state of this size (its init is compiled)
            for d in others:
                key = self.gen.move_key(rb.spec, rb.gen_start, size, d, True)
                if not self.gen.move_ready(key):
                    self.gen.warm_move_program(key, None, abstract_state(rb.state))
                    n += 1
        return n

    # ---- scheduling (scheduler thread)

    def _pick(self):
        """Under the lock: pop the pending jobs that can start now -> ([(RunningBatch, [jobs])],
        [(job, exception)] for jobs that cannot be planned at all: they fail alone)."""
        self._drop(self._purge_locked())  # cancelled / expired jobs never start (Scheduler)
        plan = collections.OrderedDict()  # id(batch) -> (batch, jobs)
        free = {id(rb): len(rb.free) - len(self._book(rb).waiting) for rb in self.batches}
        rest, new_batches, bad = collections.deque(), [], []
        while self.pending:
            j = self.pending.popleft()
            if j.constraint is not None:
                self.templated.append(j)
                continue
            try:
                rb = self._place(j, free, new_batches)
            except Exception as e:  # e.g. InvalidParam: this job's settings; the others go on
                bad.append((j, e))
                continue
            if rb is None:
                rest.append(j)
                continue
            free[id(rb)] -= 1
            plan.setdefault(id(rb), (rb, []))[1].append(j)
        self.pending = rest
        self.batches += new_batches
        self.stats["batches"] += len(new_batches)
        return list(plan.values()), bad

    def _place(self, j, free: dict, new_batches: list):
        """The batch job j joins, or None (it waits). In order: a batch with a free slot whose programs
        are compiled; a new one (when fewer than max_programs exist) that is compiled, for the largest
        gen region running with these settings (rows of every length then share one program: a
        forward per program), else for the job's own; a batch with a free slot still compiling (the
        job waits beside it); a new one to compile, for the largest region. So a job never waits for
        a compile that a ready program of its settings makes unnecessary. A new batch is sized for
        the rows that will use its program: the waiting jobs that join it plus the rows already
        running that program (under load batches grow; a lone request gets a batch of one)."""
        n = len(j.prompt_ids)
        fits = [rb for rb in self.batches + new_batches if rb.accepts(j.key) and rb.fits(n) and free[id(rb)] > 0]
        ready = [rb for rb in fits if self._book(rb).ready()]
        if ready:
            return min(ready, key=lambda r: r.gen_start)
        if len(self.batches) + len(new_batches) < self.max_programs:
            own = bucket_gen_length(j.key)
            largest = max([own] + [rb.spec.gen_length for rb in self.batches + new_batches
                                   if same_program(j.key, rb.spec)])
            candidates = []
            for glen in dict.fromkeys((largest, own)):
                prog = program_spec(j.key, glen)
                same = [k for k in [j] + list(self.pending) if same_program(k.key, prog)]
                running = sum(rb.running for rb in self.batches if rb.spec == prog)
                size = min(self.cfg.max_batch, _pow2(len(same) + running))
                candidates.append((size, max(len(k.prompt_ids) for k in same), glen))
            pick = next((c for c in candidates if self._ready_new(j.params, *c)), None)
            if pick is None and not fits:
                pick = candidates[0]
            if pick is not None:
                rb = self._new_batch(j.params, *pick)
                new_batches.append(rb)
                free[id(rb)] = rb.B
                return rb
        return min(fits, key=lambda r: r.gen_start) if fits else None

    def _has_work(self) -> bool:
        return bool(self.pending) or bool(self.templated) or any(
            rb.running or (self._book(rb).waiting and self._book(rb).ready()) for rb in self.batches)

    def _run(self):
        while True:
            with self.cond:
                while not self._has_work() and not self._stop:
                    self.cond.wait(0.5)  # also woken by submits and finished compiles
                if self._stop:
                    self._cancel_all()
                    return
                plan, bad = self._pick()
            for j, e in bad:
                self._fail([j], e)
            for rb, jobs in plan:  # a batch whose programs are still compiling keeps them aside
                self._book(rb).waiting += jobs
            for rb in list(self.batches):
                try:
                    self._admit_waiting(rb)
                except Exception as e:  # its rows and waiting jobs fail; the other batches go on
                    self._fail_batch(rb, e)
            self._run_templated()
            for rb in list(self.batches):
                if rb.running:
                    try:
                        with self.running(f"segment (B={rb.B}, {rb.running} row(s))",
                                          [j for j in rb.slots if j is not None]):
                            self._segment(rb)
                    except Exception as e:
                        self._fail_batch(rb, e)
            self._repack()
            with self.cond:
                self.batches = [rb for rb in self.batches
                                if (rb.running or self._book(rb).waiting) and not self._book(rb).failed]
                self._books = {rb: self._books[rb] for rb in self.batches if rb in self._books}
                self.stats["running_rows"] = sum(rb.running for rb in self.batches)
                self.stats["waiting_for_compile"] = sum(len(self._book(rb).waiting) for rb in self.batches)

    def _repack(self):
        """Size programs to their rows (a B-slot program computes all B rows whatever the number
        running, so a batch that filled under a burst and drains under a trickle would otherwise
        keep its full cost: bench/continuous_occupancy.py). For the batches of one program
        (settings, prompt bucket) holding R running rows with Q queued jobs of that program:
        - when their slots add up to at least twice S = pow2(R + Q) (at most max_batch), or there
          are several of them and their slots add up to at least S (`repack_size`), the rows
          move into one batch of S slots (an existing one of that size, else a new one once its
          programs are compiled; into a new batch one source per round, the largest first);
        - else, when one of several batches can hold all R rows, the others move into it.
        Once the rows sit in one batch of S, only a shrink moves them again (fewer slots), so rows
        never move back and forth. Every mover is compiled
        on the compile thread first (a move never compiles here); rows decode on exactly as
        before (RunningBatch.take_rows)."""
        if not self.cfg.repack:
            return
        groups = collections.OrderedDict()
        for rb in self.batches:
            if rb.running and not self._book(rb).waiting and not self._book(rb).failed and rb.state is not None:
                groups.setdefault((rb.spec, rb.gen_start), []).append(rb)
        for (spec, gen_start), group in groups.items():
            rows = sum(rb.running for rb in group)
            with self.cond:
                queued = sum(1 for j in self.pending if j.constraint is None and same_program(j.key, spec))
            size = repack_size(rows, queued, [rb.B for rb in group], self.cfg.max_batch)
            if size is not None:
                target = next((rb for rb in group if rb.B == size), None)
                if target is None and not self.gen.segment_programs_ready(spec, gen_start, size):
                    self._compile_async(spec, gen_start, size)  # a later round moves them
                    continue
            elif len(group) > 1:  # consolidate into the smallest batch that holds every row
                holds = [rb for rb in group if len(rb.free) >= rows - rb.running]
                if not holds:
                    continue
                target = min(holds, key=lambda rb: rb.B)
                size = target.B
            else:
                continue
            sources = sorted((rb for rb in group if rb is not target), key=lambda rb: -rb.B)
            sources = sources[:1] if target is None else sources
            keys = [self.gen.move_key(spec, gen_start, rb.B, size, target is None) for rb in sources]
            if any(k in self._move_failed for k in keys):
                continue
            missing = [(k, rb) for k, rb in zip(keys, sources) if not self.gen.move_ready(k)]
            if missing:
                for k, rb in missing:
                    self._compile_mover(k, None if target is None else abstract_state(target.state),
                                        abstract_state(rb.state))
                continue
            if target is None:
                target = self._adopt(RunningBatch(self.gen, spec, gen_start, size, background=self._compile_async))
                with self.cond:
                    self.batches.append(target)
                    self.stats["batches"] += 1
            for k, rb in zip(keys, sources):
                try:  # all or nothing: a move that fails leaves both batches as they were
                    target.take_rows(rb, [b for b, j in enumerate(rb.slots) if j is not None])
                except Exception as e:
                    self._move_failed.add(k)  # not tried again: those rows decode on where they are
                    log.warning("moving %d row(s) from a B=%d batch into a B=%d one failed (%s: %s); "
                                "they decode on where they are", rb.running, rb.B, size, type(e).__name__, e)
                    break
                with self.cond:
                    self.stats["repacked"] += 1

    def _compile_mover(self, key, dst_abstract, src_abstract):
        """Compile a row mover (Generator.warm_move_program) on the compile thread; once per key (a
        failed compile is logged and not retried: those rows stay where they are)."""
        with self.cond:
            old = self._compiling.get(key)
            if old is not None and (not old.done() or old.cancelled() or old.exception() is not None):
                return
            try:
                fut = self._compiler.submit(self.gen.warm_move_program, key, dst_abstract, src_abstract)
            except RuntimeError:  # the compile thread is shut down (closing)
                return
            self._compiling[key] = fut
            self.stats["background_compiles"] += 1

        def done(f):
            if not f.cancelled() and f.exception() is not None:
                self._move_failed.add(key)
                log.warning("compiling a row mover %s failed: %s", key[3:], f.exception())
            with self.cond:
                self.cond.notify_all()
        fut.add_done_callback(done)

    def _run_templated(self):
        """Decode the waiting templated jobs (infill, structured output) as static batches, grouped by
        compiled settings, between segments of the running batches."""
        with self.cond:
            jobs, self.templated = self.templated, []
        groups = collections.OrderedDict()
        for j in jobs:
            groups.setdefault(j.key, []).append(j)
        for group in groups.values():
            for i in range(0, len(group), self.cfg.max_batch):
                part = group[i:i + self.cfg.max_batch]
                try:
                    with self.running(f"templated batch of {len(part)}", part):
                        self._decode(part)
                except Exception as e:
                    self._fail(part, e)

    def _fail(self, jobs, exc: Exception):
        with self.cond:
            self.stats["failed"] += len(jobs)
        if not isinstance(exc, InvalidParam):
            log.error("%d request(s) failed: %s: %s", len(jobs), type(exc).__name__, exc)
        for j in jobs:
            self._finish(j, exc=exc)

    def _fail_batch(self, rb, exc: Exception):
        """A batch whose program or admission failed: its rows and waiting jobs fail, it is dropped
        (its state is not trusted); a failed compile is retried by the next batch of its kind."""
        book = self._book(rb)
        jobs = [j for j in rb.abandon() + book.waiting if j is not None]
        book.waiting, book.failed = [], True
        with self.cond:
            self._compiling.pop((rb.spec, rb.gen_start, rb.B, None), None)
        self._fail(jobs, exc)

    def _recover(self, exc: Exception):
        self.busy = None
        for rb in list(self.batches):
            self._fail_batch(rb, exc)
        with self.cond:
            self.batches = []

    def _admit_waiting(self, rb):
        book = self._book(rb)
        if not book.waiting or not book.ready():
            return
        jobs, book.waiting = book.waiting, []
        if book.compiling is not None and book.compiling.exception() is not None:
            book.waiting = jobs
            self._fail_batch(rb, book.compiling.exception())  # the next batch of this kind tries again
            return
        gone = [j for j in jobs if j.cancelled]
        live = [j for j in jobs if not j.cancelled]
        if gone:
            with self.cond:
                self.stats["cancelled"] += len(gone)
            self._drop(gone)
        if live:
            with self.running(f"admission of {len(live)} row(s) (B={rb.B})", live):
                rb.admit([(j, np.asarray(j.prompt_ids, np.int32), j.params) for j in live])
            now = time.monotonic()
            for j in live:
                j.t_admitted = now
            with self.cond:
                self.stats["admitted"] += len(live)

    def _segment(self, rb):
        gone = [b for b, j in enumerate(rb.slots) if j is not None and j.cancelled]
        if gone:  # client gone / deadline passed mid-decode: the row leaves now, its slot is free
            jobs = [rb.slots[b] for b in gone]
            rb.evict(gone)
            with self.cond:
                self.stats["cancelled"] += len(jobs)
                self.stats["evicted"] += len(jobs)
            for j in jobs:
                self._finish(j, exc=Cancelled("the request was cancelled or its deadline passed while decoding"))
            if not rb.running:
                return
        t = time.perf_counter()
        finished = rb.step(self.segment)
        with self.cond:  # "batches": programs started; "batch_sizes": rows decoding per segment
            self.stats["segments"] += 1
            self.stats["batch_sizes"][rb.running + len(finished)] += 1
            self.stats["max_batch_size"] = max(self.stats["max_batch_size"], rb.running + len(finished))
            self.stats["completed"] += len(finished)
        self.metrics.observe_batch(rb.running + len(finished), rb.B)
        self._answer_rows(rb, finished, t)
        watched = [(b, j) for b, j in enumerate(rb.slots) if j is not None and (j.events is not None or j.stop)]
        if watched:  # streaming rows get their finished blocks; rows whose stop string is committed end now
            gen, blk, done = rb.progress()
            rec = rb.progress_record() if any(j.records for _, j in watched) else None
            its = rb.progress_steps() if any(j.canvas for _, j in watched) else None  # stream_canvas rows only
            bl = rb.spec.block_length
            early = []
            for b, j in watched:
                if j.records:  # committed blocks' records are final (editing stays inside the current block)
                    j.record = row_record(rec, b, gen.shape[1], j.params.logprobs)
                n_blocks = gen.shape[1] // bl if done[b] else int(blk[b])
                if self._stream_row(j, gen[b], n_blocks, bl, None if its is None else int(its[b])) \
                        if j.events is not None else self._stopped_early(j, gen[b], n_blocks, bl):
                    early.append(b)
            if early:
                rows = rb.finish(early)
                with self.cond:
                    self.stats["completed"] += len(rows)
                    self.stats["stopped_early"] += len(rows)
                self._answer_rows(rb, rows, t)

    def _answer_rows(self, rb, rows, t: float):
        """Answer finished rows (decoding/segments.RowResult) of `rb`."""
        for r in rows:
            j = r.tag
            j.record = (r.commit_steps, r.token_logprobs, r.top_logprobs)
            a = self._answer(r.raw_ids, j, j.record)
            self._send_final(j, r.raw_ids, a, rb.spec.block_length, r.nfe)
            edits = {} if r.edits is None else {"edits": r.edits}
            self._finish_decoded(j, a, r.nfe, r.tpf, r.steps_per_block, edits, batch_size=rb.B,
                                 segment_seconds=round(time.perf_counter() - t, 4))

    def _cancel_all(self):
        exc = RuntimeError("the server is shutting down")
        for rb in self.batches:
            for j in rb.slots + self._book(rb).waiting:
                if j is not None:
                    self._finish(j, exc=exc)
        self._compiler.shutdown(wait=False, cancel_futures=True)
        for j in list(self.pending) + self.templated:
            self._finish(j, exc=exc)
        self.pending.clear()
        self.templated = []
