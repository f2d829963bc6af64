"""The scheduler side of the server, shared by both schedulers: jobs and their lifetimes
(deadline, cancellation, QueueFull), the server's settings (`ServerConfig`), a request's
SamplingParams from the server defaults (`derive_params`), and `Scheduler`: the queue, the
watchdog, /stats and /metrics, and turning a decoded row into an answer or stream chunks.
static.py and continuous.py are the two scheduling loops; http.py is the OpenAI API over them.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Optional

import numpy as np

from dinfer_jax.decoding.rows import ids_until_stop
from dinfer_jax.decoding.spec import SCHEDULED
from dinfer_jax.engine import InvalidParam, SamplingParams
from dinfer_jax.serving_metrics import RequestObservation, ServingMetrics, blocks_at_cap
from dinfer_jax.stop_strings import find_stop, held_back, ids_through

log = logging.getLogger("dinfer_jax.server")  # the name before serving/ existed (users filter by it)


class QueueFull(Exception):
    pass


DISCONNECT_POLL_S = 0.2  # how often a waiting request checks that its client is still there
WARMUP_HEADROOM = 16  # programs the cache holds past what --warmup compiled (new lengths, prefill widths)


class ClientGone(Exception):
    """The client disconnected while its request waited."""


class Cancelled(Exception):
    """A job dropped before decoding (deadline passed, client gone, shutdown); `status` for HTTP."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


class WatchdogTimeout(Cancelled):
    """A batch / segment / compile ran past the server's watchdog bound (504)."""

    def __init__(self, message: str):
        super().__init__(message, status=504)


@dataclasses.dataclass
class Busy:
    """What the scheduler thread runs now (the watchdog reads it): since when, what, for which jobs."""
    started: float
    what: str
    jobs: list
    flagged: bool = False


MiB = 2 ** 20


@dataclasses.dataclass
class ServerConfig:
    model_name: str
    default_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    default_max_tokens: int = 64
    max_tokens: int = 1024
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    max_batch: int = 16
    max_queue: int = 256
    batch_wait_s: float = 0.005
    scheduler: str = "continuous"  # continuous (serving/continuous.py) | static (serving/static.py: whole batches)
    segment: int = 8  # continuous: loop iterations per segment (bench/segment_cost.py)
    repack: bool = True  # continuous: draining batches' rows move into smaller batches (ContinuousBatcher._repack)
    max_steps: int = 1024  # largest `steps` a request may ask (fixed / random strategies)
    max_post_steps: int = 64  # largest `max_post_steps` (block diffusion with editing)
    request_timeout_s: Optional[float] = 600.0  # None: no deadline
    warmup: bool = False  # compile the default settings' batch buckets before admitting traffic
    # --warmup: the max_tokens values whose programs are compiled (default: default_max_tokens), for
    # prompts up to warmup_prompt_len tokens (every prompt bucket up to it)
    warmup_max_tokens: tuple = ()
    warmup_prompt_len: int = 32
    prefix_cache_mb: float = 256.0  # continuous scheduler, block-causal models: prompt-block K/V cache (0: off)
    max_body_bytes: int = 8 * MiB  # larger request bodies: 413 before they are read whole
    max_prompt_chars: Optional[int] = None  # default: CHARS_PER_TOKEN_BOUND x the maximum length
    watchdog_s: float = 300.0  # a segment / batch running longer: its requests get 504, /metrics counts it
    compile_watchdog_s: float = 900.0  # a background compile running longer: its waiting requests get 504
    drain_timeout_s: float = 60.0  # SIGTERM: in-flight requests get this long before the server stops


@dataclasses.dataclass
class Job:
    """One prompt to decode; results come back on `loop` through `future` / `events`."""
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    key: Any  # the compiled settings (DecodeSpec): jobs with equal keys can share a batch
    events: Optional[asyncio.Queue] = None  # streaming: (text delta, ids, records, CanvasView | None)
    sent_text: str = ""
    sent_blocks: int = 0
    deadline: Optional[float] = None  # time.monotonic() after which the job is not started
    cancelled: bool = False  # set by the request handler (timeout, client gone) or the watchdog
    answered: bool = False  # its result / error was handed to its future (once, whoever comes first)
    stop: tuple = ()  # stop strings (dinfer_jax/stop_strings.py)
    # Streaming rows whose chunks carry per-token records (logprobs / step map): the ids already
    # attributed to a chunk, and the row's commit record (decoding/rows.row_record's (steps, logprobs, top),
    # a prefix of the generation region) as last read, which `_emit` attributes from.
    records: bool = False
    sent_ids: int = 0
    record: Optional[tuple] = None
    # serving_metrics: when the job arrived, was admitted into a batch / segment, sent its first text
    t_arrival: float = dataclasses.field(default_factory=time.monotonic)
    t_admitted: Optional[float] = None
    t_first_token: Optional[float] = None
    # stream_canvas rows: the canvas last sent (None: none yet), whether a stop string was found (no
    # canvas after it), and the events `_stream_row` holds back (the canvas goes on the last of them)
    canvas: bool = False
    canvas_sent: Optional["CanvasView"] = None
    stop_hit: bool = False
    held: Optional[list] = None
    # a canvas template (structured.Constrained: infill suffix, JSON schema, regex, choice): the
    # region is laid out by it and the answer is its render
    constraint: Any = None

    def expired(self, now: float) -> bool:
        return self.cancelled or (self.deadline is not None and now >= self.deadline)


@dataclasses.dataclass(frozen=True)
class CanvasView:
    """A stream_canvas row's provisional canvas as observed: token_ids (n,) int32, the generation
    region cut to max_tokens (the mask id where still undecided); step: decoder steps the row had run."""
    token_ids: np.ndarray
    step: int


def canvas_object(view: CanvasView, tokenizer, mask_id: int, stop_ids) -> dict:
    """The `canvas` extension object of a chunk: {token_ids: [int | None] (n,), None where masked;
    text: str | None (no tokenizer), the canvas decoded with each masked position rendered as the
    mask token's text, cut before the first stop id (stop_ids: empty with ignore_eos); masked: int,
    the masked positions; step: int}."""
    ids = [int(t) for t in view.token_ids]
    text = None
    if tokenizer is not None:
        placeholder = tokenizer.decode([mask_id], skip_special_tokens=False) or "_"
        parts, run = [], []
        for t in ids:
            if t in stop_ids:
                break
            if t == mask_id:
                parts += [tokenizer.decode(run), placeholder] if run else [placeholder]
                run = []
            else:
                run.append(t)
        text = "".join(parts) + (tokenizer.decode(run) if run else "")
    return {"token_ids": [None if t == mask_id else t for t in ids], "text": text,
            "masked": sum(t == mask_id for t in ids), "step": int(view.step)}


def derive_params(d: SamplingParams, upd: dict, max_tokens: int, model_cfg=None) -> SamplingParams:
    """A request's SamplingParams: the server defaults `d` with the body's fields `upd`; the block
    is at most max_tokens (not with cache "block": there it is the model's attention block),
    gen_length is max_tokens rounded up to whole blocks, and fixed / random / dream
    strategies default to one step per token. A server default that a rule between fields refuses
    next to the request's own fields (Dream's `alg` after `"strategy": "threshold"`, LLaDA2's block
    settings after `"cache": "dual"`) yields: it falls back to SamplingParams' own default. The
    result is checked against the model (`spec_for`) when model_cfg is given. InvalidParam on a bad
    value, naming a field the request set."""
    upd = dict(upd)
    merged = dataclasses.replace(d, **upd)  # the engine's per-field rules (InvalidParam)
    # a full-canvas block shrinks to max_tokens; a block-causal model's block is its attention block
    block = merged.block_length if merged.cache == "block" else min(merged.block_length, max_tokens)
    upd["block_length"] = block
    upd["gen_length"] = -(-max_tokens // block) * block
    if upd.get("strategy", d.strategy) in ("fixed", "random", "dream") and "steps" not in upd:
        upd["steps"] = upd["gen_length"]
    p = dataclasses.replace(d, **upd)
    own = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    for _ in range(len(own)):
        try:
            p.spec_for(model_cfg) if model_cfg is not None else p.validate()
            return p
        except InvalidParam as e:
            if e.field in upd or e.field not in own or getattr(p, e.field) == own[e.field]:
                raise
            p = dataclasses.replace(p, **{e.field: own[e.field]})  # the server's default yields
    return p


def warmup_params(cfg: ServerConfig, max_tokens: Optional[int] = None) -> SamplingParams:
    """The settings `--warmup` compiles: the server's defaults at max_tokens (default_max_tokens)."""
    return derive_params(cfg.default_params, {}, max_tokens or cfg.default_max_tokens)


def warmup_lengths(cfg: ServerConfig) -> list[int]:
    """The max_tokens values `--warmup` compiles programs for."""
    return sorted(set(cfg.warmup_max_tokens or (cfg.default_max_tokens,)))



class Scheduler:
    """What both schedulers share: the bounded job queue, cancellation, the watchdog, metrics, and
    answering / streaming rows; `_decode` runs a list of jobs as one whole engine batch.

    A scheduler (static.py, continuous.py) supplies `_run` (its loop) and the --warmup hooks
    `_warmup_sizes`, `_warmup_prompts`, `_warmup_batch`. One worker thread runs `_main`: warmup,
    then `ready` is set, then `_run` -- restarted after any exception that escapes it (the requests
    it concerned fail, the loop goes on: `alive()` stays true).
    A watchdog thread answers 504 to the requests of a batch / segment running past
    cfg.watchdog_s (counted in /metrics; `stuck()` while it lasts: /health answers 503)."""

    EXTRA_STATS: tuple = ()  # a subclass's own counters (set before the scheduler thread starts)

    def __init__(self, generator, tokenizer, cfg: ServerConfig):
        self.gen, self.tok, self.cfg = generator, tokenizer, cfg
        mc = generator.model.config
        self.stop_ids = {mc.eos_token_id} | ({mc.eot_token_id} if mc.eot_token_id is not None else set())
        self.mask_id = mc.mask_token_id
        self.pending: collections.deque[Job] = collections.deque()
        self.cond = threading.Condition()
        self.metrics = ServingMetrics()
        self.stats = {"requests": 0, "completed": 0, "failed": 0, "rejected_queue_full": 0, "cancelled": 0,
                      "batches": 0, "max_batch_size": 0, "batch_sizes": collections.Counter(),
                      "generated_tokens": 0, "undecoded_rows": 0, "running_rows": 0, "warmup_programs": 0, "warmup_error": None,
                      "scheduler_errors": 0, "watchdog_timeouts": 0, "compile_timeouts": 0,
                      **{k: 0 for k in self.EXTRA_STATS}}
        self.busy: Optional[Busy] = None  # the scheduler's current batch / segment (the watchdog reads it)
        self._answer_lock = threading.Lock()
        self.ready = threading.Event()
        self.draining = False  # set on SIGTERM: new requests get 503
        self._recent: collections.deque = collections.deque()  # (monotonic end, tokens) of recent batches
        self._t0 = time.monotonic()
        self._warmup = warmup_params(cfg) if cfg.warmup else None
        self._stop = False
        self.thread = threading.Thread(target=self._main, name="dinfer-batcher", daemon=True)
        self.thread.start()
        self._watchdog = threading.Thread(target=self._watch, name="dinfer-watchdog", daemon=True)
        self._watchdog.start()

    # ---- health and the watchdog

    def idle(self) -> bool:
        """Nothing queued and nothing decoding."""
        with self.cond:
            return not self.pending and not self.stats["running_rows"] and self.busy is None

    def alive(self) -> bool:
        """Whether the scheduler thread runs (it only ends at close())."""
        return self.thread.is_alive() and not self._stop

    def stuck(self) -> Optional[str]:
        """What the scheduler has been running past the watchdog bound, or None."""
        b = self.busy
        return f"{b.what} running for {time.monotonic() - b.started:.0f}s" if b is not None and b.flagged else None

    @contextlib.contextmanager
    def running(self, what: str, jobs: list):
        """Context: the scheduler runs `what` for `jobs` (the watchdog's view)."""
        self.busy = Busy(time.monotonic(), what, list(jobs))
        try:
            yield
        finally:
            self.busy = None

    def _watch(self):
        period = max(0.05, min(1.0, self.cfg.watchdog_s / 10, self.cfg.compile_watchdog_s / 10))
        while not self._stop:
            time.sleep(period)
            now = time.monotonic()
            b = self.busy
            if b is not None and not b.flagged and now - b.started > self.cfg.watchdog_s:
                b.flagged = True
                with self.cond:
                    self.stats["watchdog_timeouts"] += 1
                log.warning("watchdog: %s has run %.1fs (bound %gs): its %d request(s) get 504", b.what,
                            now - b.started, self.cfg.watchdog_s, len(b.jobs))
                self._give_up(b.jobs, f"decoding ({b.what}) exceeded the server's watchdog bound of "
                                      f"{self.cfg.watchdog_s:g}s")
            self._watch_more(now)

    def _watch_more(self, now: float):
        """Subclass hook: more watchdog checks (continuous.py: background compiles)."""

    def _give_up(self, jobs, message: str):
        """Answer `jobs` 504 now and mark them cancelled (the scheduler drops them when it can)."""
        for j in jobs:
            j.cancelled = True
            self._finish(j, exc=WatchdogTimeout(message))

    def submit(self, job: Job):
        self.submit_all([job])

    def submit_all(self, jobs: list[Job]):
        """Queue every job of one request, or none (QueueFull when they do not all fit now).
        Cancelled / expired jobs leave the queue first, so their slots count as free."""
        with self.cond:
            dropped = self._purge_locked()
            full = len(self.pending) + len(jobs) > self.cfg.max_queue
            if full:
                self.stats["rejected_queue_full"] += 1
            else:
                self.pending.extend(jobs)
                self.stats["requests"] += len(jobs)
                self.cond.notify()
        self._drop(dropped)
        if full:
            raise QueueFull()

    def _purge_locked(self) -> list[Job]:
        """Remove cancelled / expired jobs from the queue (holding `cond`) -> them."""
        now = time.monotonic()
        dropped = [j for j in self.pending if j.expired(now)]
        if dropped:
            self.pending = collections.deque(j for j in self.pending if not j.expired(now))
            self.stats["cancelled"] += len(dropped)
        return dropped

    def _drop(self, jobs: list[Job]):
        for j in jobs:
            self._finish(j, exc=Cancelled("the request was cancelled or its deadline passed before decoding "
                                          "started", status=504))

    def close(self):
        """Stop the worker; jobs still queued fail with Cancelled (a running batch finishes first)."""
        with self.cond:
            self._stop = True
            left, self.pending = list(self.pending), collections.deque()
            self.stats["cancelled"] += len(left)
            self.cond.notify()
        for j in left:
            self._finish(j, exc=Cancelled("the server is shutting down"))
        self.thread.join(timeout=10)

    def snapshot(self) -> dict:
        with self.cond:
            s = dict(self.stats)
            s["batch_sizes"] = {str(k): v for k, v in sorted(self.stats["batch_sizes"].items())}
            s["queue_depth"] = len(self.pending)
            s["ready"] = self.ready.is_set()
            now = time.monotonic()
            while self._recent and self._recent[0][0] < now - 60:
                self._recent.popleft()
            window = max(1e-9, min(60.0, now - self._t0))
            s["tokens_per_second"] = sum(n for _, n in self._recent) / window
        s["programs_evicted"] = self.gen.programs.evicted + self.gen.movers.evicted  # decoding programs + row movers
        pc = getattr(self.gen, "prefix_cache", None)
        if pc is not None and pc.enabled:
            s["prefix_cache"] = pc.snapshot()
        return s

    def metrics_text(self) -> str:
        """Prometheus text exposition format (version 0.0.4): gauges and counters of the scheduler,
        then the request histograms (serving_metrics; all listed in docs/metrics.md)."""
        from dinfer_jax import compile_cache
        s, cc = self.snapshot(), compile_cache.stats()
        rows = [
            ("dinfer:queue_depth", "gauge", "prompts waiting to be decoded", s["queue_depth"]),
            ("dinfer:running_rows", "gauge", "prompts in the batch being decoded", s["running_rows"]),
            ("dinfer:ready", "gauge", "1 once warmup is done", int(s["ready"])),
            ("dinfer:requests_total", "counter", "prompts admitted", s["requests"]),
            ("dinfer:completed_total", "counter", "prompts decoded", s["completed"]),
            ("dinfer:failed_total", "counter", "prompts whose batch failed", s["failed"]),
            ("dinfer:cancelled_total", "counter", "prompts dropped before decoding (deadline, client gone, "
                                                  "shutdown)", s["cancelled"]),
            ("dinfer:rejected_queue_full_total", "counter", "requests answered 503 (queue full)",
             s["rejected_queue_full"]),
            ("dinfer:batches_total", "counter", "engine batches run", s["batches"]),
            ("dinfer:generated_tokens_total", "counter", "tokens generated for answered prompts", s["generated_tokens"]),
            ("dinfer:tokens_per_second", "gauge", "generated tokens per second over the last 60 s",
             s["tokens_per_second"]),
            ("dinfer:compile_cache_hits_total", "counter", "programs read from the persistent compile cache",
             cc["hits"]),
            ("dinfer:compile_cache_misses_total", "counter", "programs compiled and written to the cache",
             cc["misses"]),
            ("dinfer:compile_seconds_total", "counter", "seconds spent in XLA backend compiles", cc["compile_seconds"]),
            ("dinfer:undecoded_rows_total", "counter", "answers cut before positions the decoder left masked "
             "(iteration bound reached)", s["undecoded_rows"]),
            ("dinfer:scheduler_alive", "gauge", "1 while the scheduler thread runs", int(self.alive())),
            ("dinfer:scheduler_errors_total", "counter", "exceptions the scheduler loop recovered from",
             s["scheduler_errors"]),
            ("dinfer:watchdog_timeouts_total", "counter", "batches / segments that ran past --watchdog (504s)",
             s["watchdog_timeouts"]),
            ("dinfer:compile_timeouts_total", "counter", "background compiles that ran past --compile-watchdog",
             s["compile_timeouts"]),
            ("dinfer:warmup_programs", "gauge", "programs compiled by --warmup", s["warmup_programs"]),
            ("dinfer:programs_evicted_total", "counter", "compiled programs (decoding programs and row movers) dropped "
             "from their program caches (each is compiled again when next needed)", s["programs_evicted"]),
        ]
        if "background_compiles" in s:
            rows.append(("dinfer:background_compiles_total", "counter", "programs compiled off the scheduler "
                         "thread while serving", s["background_compiles"]))
        pc = s.get("prefix_cache")
        if pc is not None:
            rows += [
                ("dinfer:prefix_cache_hit_rate", "gauge", "cached prompt blocks / full prompt blocks looked up",
                 pc["hit_rate"]),
                ("dinfer:prefix_cache_blocks_hit_total", "counter", "prompt blocks whose K/V came from the cache",
                 pc["blocks_hit"]),
                ("dinfer:prefix_cache_bytes", "gauge", "bytes of cached prompt K/V", pc["bytes"]),
                ("dinfer:prefix_cache_evictions_total", "counter", "blocks evicted (least recently used)",
                 pc["evictions"]),
            ]
        out = []
        for name, kind, help_, v in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(v):g}"]
        out += self.metrics.lines()
        return "\n".join(out) + "\n"

    # ---- what a scheduler supplies

    def _run(self):
        """The scheduler loop: returns when stopping."""
        raise NotImplementedError

    def _warmup_sizes(self) -> list[int]:
        """The batch sizes --warmup compiles."""
        raise NotImplementedError

    def _warmup_prompts(self) -> list[np.ndarray]:
        """One prompt per prompt-length bucket --warmup compiles."""
        raise NotImplementedError

    def _warmup_batch(self, p: SamplingParams, size: int, ids: np.ndarray) -> int:
        """Compile the programs a batch of `size` rows for prompts like `ids` uses -> how many."""
        raise NotImplementedError

    def _main(self):
        if self._warmup is not None:
            t = time.perf_counter()
            # what --warmup compiles is kept: the count bound grows to hold it (the cache's memory
            # mapping bound still applies), else later warm-up programs would push out earlier
            # ones and requests would compile them again under load
            caches = [self.gen.programs, self.gen.movers]
            bounds = [c.max_programs for c in caches]
            for c in caches:
                c.resize(1 << 30)
            try:
                for max_tokens in warmup_lengths(self.cfg):
                    p = warmup_params(self.cfg, max_tokens)
                    for ids in self._warmup_prompts():
                        for size in self._warmup_sizes():
                            n = self._warmup_batch(p, size, ids)
                            with self.cond:
                                self.stats["warmup_programs"] += n
            except Exception as e:  # the server still serves; /stats shows why warmup stopped
                log.warning("warmup stopped: %s: %s", type(e).__name__, e)
                with self.cond:
                    self.stats["warmup_error"] = f"{type(e).__name__}: {e}"
            finally:
                for c, bound in zip(caches, bounds):
                    c.resize(max(bound, len(c) + WARMUP_HEADROOM))
            log.info("warmup: %d programs in %.1fs", self.stats["warmup_programs"], time.perf_counter() - t)
        self.ready.set()
        while not self._stop:
            try:
                self._run()
            except Exception as e:  # a scheduler bug: the requests in flight fail, the loop goes on
                log.exception("scheduler error (recovered): %s", e)
                with self.cond:
                    self.stats["scheduler_errors"] += 1
                self._recover(e)

    def _recover(self, exc: Exception):
        """After an exception escaped `_run`: fail what was in flight (subclasses hold more)."""
        b = self.busy
        self.busy = None
        if b is not None:
            for j in b.jobs:
                self._finish(j, exc=exc)

    def _text_until_stop(self, ids, job: Optional[Job] = None) -> tuple[list[int], bool]:
        """The ids before the first stop id (any id with ignore_eos), and whether one was met. The
        mask id is never an answer: the ids end before a position the decoder left masked (it ran
        out of iterations: `undecoded` counts them)."""
        return ids_until_stop(ids, () if job is not None and job.params.ignore_eos else self.stop_ids, self.mask_id)

    def _answer(self, raw, job: Job, record: tuple) -> dict:
        """A finished row's generation region -> {token_ids, text, finish_reason, undecoded:
        positions within max_tokens the decoder left masked, commit_steps, token_logprobs,
        top_logprobs (None unless the job asked for logprobs)}; a stop string cuts the text before
        it and the ids after the token that completed it. record: the row's (commit steps,
        logprobs | None, top logprobs | None) over a prefix of the region holding the answer's ids."""
        if job.constraint is not None:  # a canvas template: its render is the answer
            region = [int(t) for t in raw[:len(job.constraint.template)]]
            ids = job.constraint.answer_ids(region)
            out = {"token_ids": ids, "text": job.constraint.render(region), "finish_reason": "stop", "undecoded": 0,
                   "commit_steps": None, "token_logprobs": None, "top_logprobs": None}
            if job.constraint.parts is not None:
                out["infill_spans"] = job.constraint.parts(region)
            return out
        ids, stopped = self._text_until_stop(raw[:job.max_tokens], job)
        text = self.tok.decode(ids) if self.tok else None

        def rec(ids):
            steps, lps, tops = record
            return {"commit_steps": steps[:len(ids)], "token_logprobs": None if lps is None else lps[:len(ids)],
                    "top_logprobs": None if tops is None else tops[:len(ids)]}
        if job.stop and text is not None:
            hit = find_stop(text, job.stop)
            if hit is not None:
                ids = ids[:ids_through(ids, self.tok.decode, hit[1])]
                return {"token_ids": ids, "text": text[:hit[0]], "finish_reason": "stop", "undecoded": 0, **rec(ids)}
        undecoded = 0
        if not stopped and len(ids) < min(len(raw), job.max_tokens):
            undecoded = int(np.sum(np.asarray(raw[:job.max_tokens]) == self.mask_id))
            if undecoded:
                with self.cond:
                    self.stats["undecoded_rows"] += 1
                log.warning("a row ended with %d undecoded (mask) positions: the decoder hit its iteration "
                            "bound (non-finite logits, or a model that keeps predicting the mask id)", undecoded)
        return {"token_ids": ids, "text": text, "finish_reason": "stop" if stopped else "length",
                "undecoded": undecoded, **rec(ids)}

    def _stopped_early(self, job: Job, gen_G, finished: int, bl: int) -> bool:
        """Whether the committed prefix (`finished` whole blocks) of a row with stop strings holds
        one (the row can be answered now)."""
        if not job.stop or self.tok is None or finished <= 0:
            return False
        ids, _ = self._text_until_stop(gen_G[:min(finished * bl, job.max_tokens)], job)
        return find_stop(self.tok.decode(ids), job.stop) is not None

    def _decode(self, batch: list[Job]):
        streaming = [j for j in batch if j.events is not None]
        observer = None
        if streaming:
            bl = batch[0].params.block_length

            def send_finished_blocks(step, gen_BG, blk_B, done_B, active_B):
                for b, j in enumerate(batch):
                    # rows whose chunks carry records (logprobs / step map) get their text when the
                    # batch ends (the static program's observer sees tokens, not the record); their
                    # canvas streams as any row's. step: the batch's iteration = the row's (0-based)
                    if j.events is None or j.cancelled or (j.records and not j.canvas) or j.constraint is not None:
                        continue
                    n = None if j.records else gen_BG.shape[1] // bl if done_B[b] else int(blk_B[b])
                    self._stream_row(j, gen_BG[b], n, bl, step + 1)
            observer = send_finished_blocks
        now = time.monotonic()
        for j in batch:
            j.t_admitted = now
        self.metrics.observe_batch(len(batch), self.cfg.max_batch)
        templates = ([None if j.constraint is None else j.constraint.template for j in batch]
                     if any(j.constraint is not None for j in batch) else None)
        r = self.gen.generate([np.asarray(j.prompt_ids, np.int32) for j in batch], [j.params for j in batch],
                              observer=observer, templates=templates)
        for b, j in enumerate(batch):
            j.record = (r.commit_steps[b], r.token_logprobs[b] if r.token_logprobs is not None else None,
                        r.top_logprobs[b] if r.top_logprobs is not None else None)
            a = self._answer(r.raw_ids[b], j, j.record)
            self._send_final(j, r.raw_ids[b], a, j.params.block_length, int(r.nfe[b]))
            edits = {k: getattr(r, k)[b] for k in ("edits", "inserts", "deletes") if getattr(r, k, None) is not None}
            self._finish_decoded(j, a, r.nfe[b], r.tpf[b], r.steps_per_block[b], edits, batch_size=len(batch))
        with self.cond:
            self.stats["completed"] += len(batch)

    def _send_final(self, job: Job, gen_G, answer: dict, bl: int, step: int):
        """A finished streaming row's last events: a template's answer whole; else the blocks not
        sent yet (and its last canvas) and the final text."""
        if job.events is None:
            return
        if job.constraint is not None:
            self._put(job, (answer["text"], answer["token_ids"], None, None))
            return
        self._stream_row(job, gen_G, -(-len(gen_G) // bl), bl, step)
        self._emit(job, answer["token_ids"], final=True)

    def _emit_blocks(self, job: Job, gen_G, finished: int, bl: int) -> bool:
        """Stream the blocks `job` has finished since the last call, one event per block (a segment
        or step that finishes several blocks still sends them one by one) -> whether the text sent
        now reached one of its stop strings."""
        while job.sent_blocks < finished:
            job.sent_blocks += 1
            end = min(job.sent_blocks * bl, job.max_tokens)
            ids, stopped = self._text_until_stop(gen_G[:end], job)
            hit = self._emit(job, ids)
            if stopped or hit or len(ids) < end or end == job.max_tokens:
                job.sent_blocks = finished
                return hit
        return False

    def _stream_row(self, job: Job, gen_G, finished: Optional[int], bl: int, step: int) -> bool:
        """Stream what a row shows now: its `finished` blocks' text (`_emit_blocks`; None: no text
        now) and, for a stream_canvas row, its canvas (gen_G cut to max_tokens) at `step` when it is
        newer than the last one sent and changed, on the last text event of this call or on an event
        of its own (none after a stop string was found) -> whether a stop string was found."""
        if not job.canvas:
            return finished is not None and self._emit_blocks(job, gen_G, finished, bl)
        job.held = []
        try:
            hit = finished is not None and self._emit_blocks(job, gen_G, finished, bl)
        finally:
            held, job.held = job.held, None
        ids, last = np.array(gen_G[:job.max_tokens], np.int32), job.canvas_sent
        if not job.stop_hit and (last is None or (step > last.step and not np.array_equal(ids, last.token_ids))):
            view = job.canvas_sent = CanvasView(ids, step)
            if held:
                held[-1] = (*held[-1][:3], view)
            else:
                held.append(("", [], [] if job.records else None, view))
        for event in held:
            self._put(job, event)
        return hit

    def _put(self, job: Job, event: tuple):
        """Hand a stream event (delta, ids, records, CanvasView | None) to the request (held back
        while `_stream_row` collects the events of one observation)."""
        if job.held is not None:
            job.held.append(event)
            return
        if event[0] and job.t_first_token is None:  # TTFT: when the first text is handed over, not queued
            job.t_first_token = time.monotonic()
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the request's event loop is closed
            job.cancelled = True

    def _emit(self, job: Job, ids: list[int], final: bool = False) -> bool:
        """Send the text of `ids` past what was sent; with stop strings, the text before the first
        one, and (until final) without a tail that may still become one -> whether a stop string
        was found."""
        text = full = self.tok.decode(ids) if self.tok else " ".join(map(str, ids))
        hit = find_stop(text, job.stop) if job.stop else None
        if hit:
            text = text[:hit[0]]
        elif job.stop and not final:
            text = text[:len(text) - held_back(text, job.stop)]
        grew = len(text) > len(job.sent_text) and text.startswith(job.sent_text)
        # ids go with the chunk that completes their text (all of them with the final one)
        upto = len(ids) if final or (grew and not hit and text == full) else job.sent_ids
        chunk = self._chunk_ids(job, ids, upto)
        if grew or (final and job.records and chunk[0]):
            delta, job.sent_text = (text[len(job.sent_text):], text) if grew else ("", job.sent_text)
            self._put(job, (delta, *chunk, None))
        job.stop_hit |= hit is not None
        return hit is not None

    def _chunk_ids(self, job: Job, ids: list[int], upto: int) -> tuple[list[int], Optional[list[tuple]]]:
        """The ids ids[job.sent_ids:upto] that a chunk carries, and their records (commit step,
        logprob | None, top | None) when the job streams records; advances job.sent_ids."""
        lo = job.sent_ids
        if upto <= lo:
            return [], None if not job.records else []
        job.sent_ids = upto
        if not job.records:
            return list(ids[lo:upto]), None
        steps, lps, tops = job.record
        return list(ids[lo:upto]), [(steps[k], None if lps is None else lps[k], None if tops is None else tops[k])
                                    for k in range(lo, upto)]

    def _observe(self, job: Job, nfe: int, tpf: float, steps_per_block, edits: dict):
        """Record an answered row in self.metrics (serving_metrics): its times, forwards, tokens per
        forward, blocks at their step cap and edit counts (edits: {"edits" / "inserts" / "deletes": n})."""
        now = time.monotonic()
        spec = job.key
        blocks, capped = blocks_at_cap(steps_per_block, spec.iterations_per_block,
                                       spec.strategy not in SCHEDULED)
        first = job.t_first_token if job.events is not None else now
        self.metrics.observe_request(RequestObservation(
            queue_s=(job.t_admitted or now) - job.t_arrival,
            first_token_s=None if first is None else first - job.t_arrival, e2e_s=now - job.t_arrival,
            nfe=int(nfe), tpf=float(tpf), blocks=blocks, blocks_at_cap=capped,
            **{k: int(v) for k, v in edits.items()}))

    def _finish_decoded(self, job: Job, answer: dict, nfe: int, tpf: float, steps_per_block, edits: dict,
                        **extra):
        """Answer a decoded row (both schedulers): its metrics (`_observe`), then its result: the
        answer (`_answer`), edit counts, nfe, tpf and the scheduler's `extra` fields."""
        self._observe(job, nfe, tpf, steps_per_block, edits)
        self._finish(job, result={**answer, **edits, "nfe": nfe, "tpf": round(tpf, 4), **extra})

    def _finish(self, job: Job, result=None, exc=None):
        """Answer a job (any scheduler; once: later answers are ignored): its seed is added to the
        result, its tokens counted."""
        with self._answer_lock:
            if job.answered:
                return
            job.answered = True
        if result is not None:
            result = {**result, "seed": job.params.seed}
            with self.cond:
                self.stats["generated_tokens"] += len(result["token_ids"])
                now = time.monotonic()
                self._recent.append((now, len(result["token_ids"])))
                while self._recent[0][0] < now - 60:
                    self._recent.popleft()

        def done():
            if job.future.done():
                return
            if job.cancelled and not isinstance(exc, WatchdogTimeout):  # nobody waits (timed out / client gone)
                job.future.cancel()
            elif exc is not None:
                job.future.set_exception(exc)
                job.future.exception()  # retrieved: no "never retrieved" warning when nobody awaits it
            else:
                job.future.set_result(result)
        try:
            job.loop.call_soon_threadsafe(done)
        except RuntimeError:  # the request's event loop is closed: nobody waits for this result
            pass
