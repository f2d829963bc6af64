"""The server's continuous-batching scheduler (first done, first out).

`ContinuousBatcher` has the static `server.Batcher`'s interface (submit / close / snapshot) and
its job plumbing, but decodes with `decoding/segments.RunningBatch`es: the one-jit loop runs in
segments of at most `segment` iterations (a segment also ends as soon as some row finishes);
between segments, finished rows are answered and waiting requests take the freed slots. A short
request no longer waits for the longest one in its batch, and a request arriving mid-batch starts
at the next segment boundary instead of after the whole batch.

Programs: one RunningBatch per (DecodeSpec with the gen length bucketed to a power-of-two number
of blocks, prompt bucket) in flight; a row decodes its own gen_length inside the program's region
(max_tokens 16, 24 and 32 with block 8 share one program of 32), exactly as alone, at most `max_programs` at
once, stepped round robin; a batch's size is the power of two covering the waiting rows that
match it (at least MIN_BATCH, at most max_batch) when it is created, and it is dropped when it runs empty (its
compiled programs stay cached). Rows of one batch share the compiled settings; per-row knobs
(threshold, temperature, seed, ...) differ freely. A job that fits no running batch waits for one
to drain (FIFO among equals; other jobs may pass it).

Compilation never stalls the running rows: a new program (spec, prompt bucket, batch size) not yet
compiled is compiled on a separate thread (`Generator.warm_segment_programs`, a throwaway batch);
its jobs wait beside it while the other batches keep stepping, and are admitted once it is ready.
The prefix cache's shorter prefills (one program per width) are compiled the same way; until one
is ready, admissions prefill in full.

Streaming jobs get each finished block at the segment boundary after it is decoded (one extra
device-to-host read of the running canvas per segment, only while a streaming row runs).
"""
from __future__ import annotations

import collections
import concurrent.futures
import time

import numpy as np

from dinfer_jax.engine import bucket_gen_length, program_spec
from dinfer_jax.server import Batcher, Cancelled

DEFAULT_SEGMENT = 8  # iterations per segment (bench/segment_cost.py measures the boundary cost)
MIN_BATCH = 4  # smallest batch a new program gets (fewer distinct compiled sizes: 4, 8, ..., max_batch)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class ContinuousBatcher(Batcher):
    """Continuous batching over RunningBatches (module doc). One scheduler thread."""

    def __init__(self, generator, tokenizer, cfg, segment: int = DEFAULT_SEGMENT, max_programs: int = 4):
        from dinfer_jax.decoding.prefix_cache import PrefixCache
        self.segment, self.max_programs = segment, max_programs
        block_causal = generator.model.config.attention_mask == "block_causal"  # the only exact reuse
        generator.prefix_cache = PrefixCache(int(cfg.prefix_cache_mb * 2 ** 20) if block_causal else 0)
        self.batches: list = []
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dinfer-compile")
        self._compiling: dict = {}  # program key -> Future (background compiles)
        super().__init__(generator, tokenizer, cfg)  # starts the scheduler thread (it idles until a submit)
        with self.cond:
            for k in ("segments", "admitted", "running_rows", "background_compiles", "waiting_for_compile"):
                self.stats.setdefault(k, 0)

    # ---- background compilation (the compile thread)

    def _compile_async(self, spec, gen_start, batch, width=None):
        """Future of compiling a batch's programs (width: a prefix prefill variant) off the scheduler
        thread; one per key. Completion wakes the scheduler."""
        key = (spec, gen_start, batch, width)
        with self.cond:
            fut = self._compiling.get(key)
            if fut is None:
                widths = () if width is None else (width,)
                fut = self._compiler.submit(self.gen.warm_segment_programs, spec, gen_start, batch, widths)
                self._compiling[key] = fut
                self.stats["background_compiles"] += 1

                def wake(_):
                    with self.cond:
                        self.cond.notify_all()
                fut.add_done_callback(wake)
        return fut

    def _new_batch(self, params, size, max_prompt_len, gen_length=None):
        rb = self.gen.running_batch(params, size, max_prompt_len, gen_length)
        rb.background = self._compile_async
        rb.waiting = []  # jobs assigned to this batch while its programs compile
        rb.compiling = None
        if not self.gen.segment_programs_ready(rb.spec, rb.gen_start, rb.B):
            rb.compiling = self._compile_async(rb.spec, rb.gen_start, rb.B)
        return rb

    # ---- --warmup (server.Batcher._main calls these before the first job)

    def _warmup_sizes(self) -> list[int]:
        """The batch sizes `_pick` creates: powers of two from MIN_BATCH, capped at max_batch."""
        sizes, b = [], min(self.cfg.max_batch, MIN_BATCH)
        while b not in sizes:
            sizes.append(b)
            b = min(self.cfg.max_batch, b * 2)
        return sizes

    def _warmup_batch(self, p, size, ids) -> int:
        """Compile a RunningBatch of `size` slots: fill it, run its segments until every row is done."""
        mc = self.gen.model.config
        rb = self.gen.running_batch(p, size, len(ids), bucket_gen_length(p.spec_for(mc)))
        self.gen.warm_segment_programs(rb.spec, rb.gen_start, rb.B)  # what a new batch of this kind checks
        rb.admit([(object(), ids, p) for _ in range(size)])
        while rb.running:
            rb.step(self.segment)
        return 1

    # ---- scheduling (scheduler thread)

    def _pick(self):
        """Under the lock: pop the pending jobs that can start now -> [(RunningBatch, [jobs])]."""
        self._drop(self._purge_locked())  # cancelled / expired jobs never start (server.Batcher)
        plan = collections.OrderedDict()  # id(batch) -> (batch, jobs)
        free = {id(rb): len(rb.free) - len(rb.waiting) for rb in self.batches}
        rest = collections.deque()
        new_batches = []
        while self.pending:
            j = self.pending.popleft()
            n = len(j.prompt_ids)
            fits = [rb for rb in self.batches + new_batches if rb.accepts(j.key) and rb.fits(n) and free[id(rb)] > 0]
            if not fits and len(self.batches) + len(new_batches) < self.max_programs:
                glen = bucket_gen_length(j.key)  # rows of any gen_length up to it share the program
                prog = program_spec(j.key, glen)
                same = [k for k in [j] + list(self.pending)
                        if k.key.gen_length <= glen and program_spec(k.key, glen) == prog]
                size = min(self.cfg.max_batch, max(_pow2(len(same)), MIN_BATCH))
                rb = self._new_batch(j.params, size, max(len(k.prompt_ids) for k in same), glen)
                new_batches.append(rb)
                free[id(rb)] = rb.B
                fits = [rb]
            if not fits:
                rest.append(j)
                continue
            rb = min(fits, key=lambda r: r.gen_start)
            free[id(rb)] -= 1
            plan.setdefault(id(rb), (rb, []))[1].append(j)
        self.pending = rest
        self.batches += new_batches
        self.stats["batches"] += len(new_batches)
        return list(plan.values())

    def _has_work(self) -> bool:
        return bool(self.pending) or any(rb.running or (rb.waiting and rb.compiling.done()) for rb in self.batches)

    def _run(self):
        while True:
            with self.cond:
                while not self._has_work() and not self._stop:
                    self.cond.wait()
                if self._stop:
                    self._cancel_all()
                    return
                plan = self._pick()
            try:
                for rb, jobs in plan:  # a batch whose programs are still compiling keeps them aside
                    rb.waiting += jobs
                for rb in list(self.batches):
                    self._admit_waiting(rb)
                for rb in list(self.batches):
                    if rb.running:
                        self._segment(rb)
            except Exception as e:  # a failing program fails its rows; the server stays up
                self._fail_all(e)
            with self.cond:
                self.batches = [rb for rb in self.batches if rb.running or rb.waiting]
                self.stats["running_rows"] = sum(rb.running for rb in self.batches)
                self.stats["waiting_for_compile"] = sum(len(rb.waiting) for rb in self.batches)

    def _admit_waiting(self, rb):
        if not rb.waiting or (rb.compiling is not None and not rb.compiling.done()):
            return
        jobs, rb.waiting = rb.waiting, []
        if rb.compiling is not None and rb.compiling.exception() is not None:
            exc = rb.compiling.exception()
            rb.compiling = None
            with self.cond:  # the next batch of this kind tries again
                self._compiling.pop((rb.spec, rb.gen_start, rb.B, None), None)
                self.stats["failed"] += len(jobs)
            for j in jobs:
                self._finish(j, exc=exc)
            return
        gone = [j for j in jobs if j.cancelled]
        live = [j for j in jobs if not j.cancelled]
        if gone:
            with self.cond:
                self.stats["cancelled"] += len(gone)
            self._drop(gone)
        if live:
            rb.admit([(j, np.asarray(j.prompt_ids, np.int32), j.params) for j in live])
            with self.cond:
                self.stats["admitted"] += len(live)

    def _segment(self, rb):
        gone = [b for b, j in enumerate(rb.slots) if j is not None and j.cancelled]
        if gone:  # client gone / deadline passed mid-decode: the row leaves now, its slot is free
            jobs = [rb.slots[b] for b in gone]
            rb.evict(gone)
            with self.cond:
                self.stats["cancelled"] += len(jobs)
                self.stats["evicted"] = self.stats.get("evicted", 0) + len(jobs)
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
        for r in finished:
            j = r.tag
            ids, stopped = self._text_until_stop(r.raw_ids[:j.max_tokens], j)
            if j.events is not None:
                self._emit(j, ids)
            self._finish(j, result={"token_ids": ids, "text": self.tok.decode(ids) if self.tok else None,
                                    "finish_reason": "stop" if stopped else "length", "nfe": r.nfe,
                                    "tpf": round(r.tpf, 4), "batch_size": rb.B,
                                    "segment_seconds": round(time.perf_counter() - t, 4)})
        streaming = [(b, j) for b, j in enumerate(rb.slots) if j is not None and j.events is not None]
        if streaming:
            gen, blk, done = rb.progress()
            bl = rb.spec.block_length
            for b, j in streaming:
                n_blocks = gen.shape[1] // bl if done[b] else int(blk[b])
                if n_blocks > j.sent_blocks:
                    j.sent_blocks = n_blocks
                    ids, _ = self._text_until_stop(gen[b, :min(n_blocks * bl, j.max_tokens)], j)
                    self._emit(j, ids)

    def _fail_all(self, exc):
        for rb in self.batches:
            for b, j in enumerate(rb.slots):
                if j is not None:
                    self._finish(j, exc=exc)
                    rb.slots[b] = None
            for j in rb.waiting:
                self._finish(j, exc=exc)
            rb.waiting = []
            rb.state = None
        with self.cond:
            self.stats["failed"] += 1

    def _cancel_all(self):
        exc = RuntimeError("the server is shutting down")
        for rb in self.batches:
            for j in rb.slots + rb.waiting:
                if j is not None:
                    self._finish(j, exc=exc)
        self._compiler.shutdown(wait=False, cancel_futures=True)
        for j in self.pending:
            self._finish(j, exc=exc)
        self.pending.clear()
