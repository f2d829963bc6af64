"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (with `stream`), /v1/models,
/health, /stats. FastAPI + uvicorn; `dinfer-jax serve --model DIR --port P`.

Requests go to a scheduler (continuous.py by default, static.py with `--scheduler static`): one
worker thread runs the engine over the requests in flight. The queue is bounded: a full queue
answers 503.
Streaming requests select the program variant with a per-iteration host callback
(decoding/observe.py); each block is sent as soon as it is decoded. `stream_canvas: true` (dLLM
extension) adds the provisional canvas to the chunks whenever it changed (docs/openai_fields.md).

The decoding settings are body fields generated from decoding/spec.SETTINGS (those it marks
`server`): temperature, seed and top_p are OpenAI's own; threshold, block_length, strategy, cache,
steps, editing_threshold, ... are extra fields (OpenAI clients pass them with `extra_body=`).
Bad input (unknown fields, bad JSON, lengths over the limits) -> 400 with an OpenAI-style error.

Bounds and lifetimes: every knob that sets work (max_tokens, steps, max_post_steps) has a server
limit (400 naming the field above it). A request is admitted whole or not at all: more prompts
than --max-queue -> 400 (it can never fit), a queue without room for all of them -> 503. A request
whose deadline (--request-timeout) passes, or whose streaming client goes away, is cancelled: if
still queued it is dropped before decoding (its slot goes to the next request; static and
continuous schedulers alike). A prompt already decoding in a static batch (one compiled loop) finishes, bounded by the limits
above, and its result is discarded; the continuous scheduler evicts the row at the next segment
boundary.
With temperature > 0 and no seed, each prompt gets a fresh random seed, reported back as `seed`.
`--warmup` compiles the default settings' batch buckets before traffic is admitted; /health
answers 503 until then. SIGTERM: new requests get 503, in-flight ones finish, then the process
exits. /metrics: Prometheus text (queue depth, running rows, tokens, compile-cache hits).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import threading
import time
import uuid
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import ConfigDict, Field, create_model

from dinfer_jax.canvas_template import template_classes
from dinfer_jax.decoding.spec import BOOL, CHOICE, FLOAT, INT, MAX_LOGPROBS, SETTINGS, InvalidParam, Setting
from dinfer_jax.engine import SamplingParams, constrained_spec, templated_params
from dinfer_jax.json_template import SchemaError
from dinfer_jax.serving.continuous import ContinuousBatcher
from dinfer_jax.serving.scheduler import (DISCONNECT_POLL_S, Cancelled, CanvasView, ClientGone, Job, QueueFull,
                                          ServerConfig, WatchdogTimeout, canvas_object, derive_params, log,
                                          warmup_lengths)
from dinfer_jax.serving.static import StaticBatcher
from dinfer_jax.stop_strings import check_stop
from dinfer_jax.structured import REQUEST_FIELDS, build_constraint, constraint_from_request

try:  # module level: FastAPI resolves the handlers' (string) annotations in this module
    from starlette.requests import Request
except ImportError:  # serve needs the [serve] extra; create_app says so
    Request = None

def _setting_type(s: Setting):
    """The request-model type of a decoding setting (strict: `true` is no integer, "yes" no boolean)."""
    if s.kind == CHOICE:
        return Literal[s.choices]
    return {INT: int, FLOAT: float, BOOL: bool}[s.kind]


# The decoding settings a request may set (None = the server's default): every field
# decoding/spec.SETTINGS marks `server`, with its type and help (the OpenAPI schema's description).
# Their rules live in SamplingParams (one place for the CLI, the library and the server), whose
# InvalidParam becomes a 400 naming the field.
DinferFields = create_model(
    "DinferFields", __config__=ConfigDict(extra="forbid", strict=True),
    **{name: (Optional[_setting_type(s)], Field(None, description=s.help or None))
       for name, s in SETTINGS.items() if s.server})


class CommonFields(DinferFields):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    stream: bool = False
    stream_options: Optional[dict] = None
    n: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    user: Optional[str] = None
    return_step_map: Optional[bool] = None  # dLLM extension: each output token's commit step (`commit_steps`)
    stream_canvas: Optional[bool] = None  # dLLM extension: streamed chunks carry the provisional canvas (`canvas`)
    # Structured output (dinfer_jax/structured.py: a canvas template, checked inside the loop):
    # OpenAI's response_format, vLLM's structured_outputs and its earlier guided_* names
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None


class CompletionRequest(CommonFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    suffix: Optional[str] = None  # infilling: max_tokens positions between the prompt and this text
    # dLLM extension: the generation region as text pieces (kept) and span lengths (filled)
    infill: Optional[list[Union[str, int]]] = None
    logprobs: Optional[int] = None  # OpenAI legacy: the top N (0..20) alternatives per token
    echo: Optional[bool] = None


class ChatRequest(CommonFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None  # 0..20, with logprobs true


MiB = 2 ** 20
MAX_N = 128  # choices per prompt (`n`)
CHARS_PER_TOKEN_BOUND = 16  # a prompt longer than this many characters per allowed token is refused unread


def memory_bytes(model) -> tuple[int, str]:
    """(bytes of memory the model's device offers, what it is): the accelerator's memory limit,
    or on CPU the host's physical memory."""
    import jax
    dev = jax.tree_util.tree_leaves(model.params)[0].devices().pop()
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{dev.device_kind} memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"


def check_server_config(model, cfg: ServerConfig) -> None:
    """The server's options against the model and the machine, before anything is served:
    ValueError (one line) naming the option that cannot work."""
    import jax
    mc = model.config
    max_len = cfg.max_model_len or mc.max_position_embeddings
    problems = []
    if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
        problems.append(f"--max-model-len {cfg.max_model_len} exceeds the model's max_position_embeddings "
                        f"{mc.max_position_embeddings}")
    if cfg.default_max_tokens >= max_len:
        problems.append(f"--default-max-tokens {cfg.default_max_tokens} leaves no room for a prompt in the maximum "
                        f"length {max_len}")
    elif cfg.max_tokens >= max_len:
        log.warning("--max-tokens %d: requests are bounded by the maximum length %d (prompt + max_tokens)",
                    cfg.max_tokens, max_len)
    if cfg.default_max_tokens > cfg.max_tokens:
        problems.append(f"--default-max-tokens {cfg.default_max_tokens} exceeds --max-tokens {cfg.max_tokens}")
    if any(not 0 < n <= cfg.max_tokens for n in cfg.warmup_max_tokens):
        problems.append(f"--warmup-max-tokens {','.join(map(str, cfg.warmup_max_tokens))}: each must be in "
                        f"[1, --max-tokens {cfg.max_tokens}]")
    if cfg.warmup_prompt_len + min(cfg.warmup_max_tokens or (cfg.default_max_tokens,)) > max_len:
        problems.append(f"--warmup-prompt-len {cfg.warmup_prompt_len} leaves no room to generate in the maximum "
                        f"length {max_len}")
    for name, v in (("--batch-wait-ms", cfg.batch_wait_s), ("--watchdog", cfg.watchdog_s),
                    ("--compile-watchdog", cfg.compile_watchdog_s), ("--drain-timeout", cfg.drain_timeout_s)):
        if not (v >= 0 and v < float("inf")):
            problems.append(f"{name} must be a finite number >= 0, got {v}")
    if cfg.max_body_bytes < 1024:
        problems.append(f"--max-body-mb allows only {cfg.max_body_bytes} bytes: no request fits")
    if problems:
        raise ValueError("; ".join(problems))
    if getattr(model, "params", None) is None:  # a stand-in model (tests): nothing to measure
        return
    mem, what = memory_bytes(model)
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    free = mem - weights
    itemsize = np.dtype(model.module.dtype).itemsize
    row_kv = 2 * mc.num_layers * max_len * mc.num_kv_heads * mc.head_dim * itemsize  # one max-length row's K/V
    pool = int(cfg.prefix_cache_mb * MiB) if mc.attention_mask == "block_causal" and cfg.scheduler == "continuous" else 0
    gib = 2 ** 30
    if pool + row_kv > free:
        raise ValueError(f"--prefix-cache-mb {cfg.prefix_cache_mb:g} ({pool / gib:.1f} GiB) plus one row's K/V at the "
                         f"maximum length {max_len} ({row_kv / gib:.2f} GiB) does not fit the {free / gib:.1f} GiB of "
                         f"{what} left after the weights ({weights / gib:.1f} GiB)")
    if pool + cfg.max_batch * row_kv > free:
        log.warning("--max-batch %d rows at the maximum length %d need %.1f GiB of K/V; %.1f GiB of %s are left "
                    "after the weights and the prefix cache: long requests may fail to allocate", cfg.max_batch,
                    max_len, cfg.max_batch * row_kv / gib, (free - pool) / gib, what)


class RequestGate:
    """ASGI middleware: a request body over `limit` bytes gets 413 before it is read whole (by its
    Content-Length, else while it streams in); `inflight` counts the HTTP requests being answered
    (SIGTERM waits for it to reach 0)."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.inflight = app, limit, 0

    async def _too_large(self, send, n: str):
        body = json.dumps({"error": {"message": f"request body of {n} bytes exceeds this server's limit of "
                                                f"{self.limit} bytes (--max-body-mb)", "type": "invalid_request_error",
                                     "param": None, "code": None}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(send, declared.decode())
        seen, refused = 0, False

        async def limited_receive():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:  # answer 413 now; the app sees the client leave
                    refused = True
                    await self._too_large(send, f"more than {self.limit}")
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg):
            if not refused:  # after a 413 the app's own answer is dropped
                await send(msg)

        self.inflight += 1
        try:
            await self.app(scope, limited_receive, guarded_send)
        finally:
            self.inflight -= 1


def create_app(model, tokenizer, cfg: ServerConfig, chat_formatter=None):
    """The FastAPI app for one model. tokenizer: dinfer_jax.tokenizer.Tokenizer (or None: token-id
    prompts only); chat_formatter: messages -> text (dinfer_jax.chat.ChatFormatter)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    check_server_config(model, cfg)
    try:
        for n in warmup_lengths(cfg):
            derive_params(cfg.default_params, {}, n, model.config)
    except InvalidParam as e:
        raise InvalidParam(e.field, f"the server's default settings are invalid for this model: {e}") from None
    if cfg.scheduler == "continuous":
        batcher = ContinuousBatcher(model.generator, tokenizer, cfg, segment=cfg.segment)
    elif cfg.scheduler == "static":
        batcher = StaticBatcher(model.generator, tokenizer, cfg)
    else:
        raise ValueError(f"scheduler={cfg.scheduler!r}: choose continuous or static")
    max_len = cfg.max_model_len or model.config.max_position_embeddings
    app = FastAPI(title="dinfer-jax", version="1")
    app.state.batcher = batcher
    app.add_middleware(RequestGate, limit=cfg.max_body_bytes)

    def error(status: int, message: str, param: str | None = None, etype: str = "invalid_request_error"):
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": etype,
                                                                   "param": param, "code": None}})

    class BadRequest(Exception):
        def __init__(self, message, param=None, status=400, etype=None):
            super().__init__(message)
            self.message, self.param, self.status = message, param, status
            self.etype = etype or ("server_overloaded" if status == 503 else "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        errs = exc.errors()
        parts = []
        for e in errs[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            if e.get("type") == "json_invalid":  # its loc is a character offset, not a field
                parts.append(f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
            elif e.get("type") == "extra_forbidden":
                parts.append(f"unknown parameter {loc!r}")
            else:
                parts.append(f"{loc or 'body'}: {e.get('msg')}")
        first = errs[0] if errs else {}
        param = None if first.get("type") == "json_invalid" else (
            ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None)
        return error(400, "; ".join(parts) or "invalid request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), etype="not_found" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(BadRequest)
    async def _bad(request, exc: BadRequest):
        return error(exc.status, exc.message, exc.param, exc.etype)

    @app.exception_handler(ClientGone)
    async def _gone(request, exc: ClientGone):
        return error(499, "the client closed the request", etype="client_closed_request")

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}: {exc}", etype="server_error")

    def stop_strings(req: CommonFields) -> tuple[str, ...]:
        try:
            stops = check_stop(req.stop)
        except ValueError as e:
            raise BadRequest(str(e), "stop") from None
        if stops and tokenizer is None:
            raise BadRequest("stop strings need the model's tokenizer.json (this model has none)", "stop")
        return stops

    def choices_per_prompt(req: CommonFields) -> int:
        n = 1 if req.n is None else req.n
        if not 1 <= n <= MAX_N:
            raise BadRequest(f"n={n}: must be in [1, {MAX_N}]", "n")
        if n > 1 and req.stream:
            raise BadRequest(f"n={n} with stream=true: a stream carries one choice here; send n requests", "n")
        if req.stream_canvas and not req.stream:
            raise BadRequest("stream_canvas needs stream: true (the canvas is only sent in streamed chunks)",
                             "stream_canvas")
        return n

    def sampling(req: CommonFields, max_tokens: int, n_prompts: int = 1, n: int = 1,
                 logprobs: Optional[int] = None) -> list[SamplingParams]:
        """SamplingParams for each prompt's n choices (prompt-major, as the choices are listed);
        logprobs: the top alternatives per token the answer lists (None: no logprobs).
        temperature > 0 without a seed: a fresh random seed for each (reported back as `seed`); a
        given seed is used for every prompt, choice k of a prompt taking seed + k (mod 2**32)."""
        if max_tokens > cfg.max_tokens:
            raise BadRequest(f"max_tokens={max_tokens} exceeds this server's limit of {cfg.max_tokens}", "max_tokens")
        for name, limit in (("steps", cfg.max_steps), ("max_post_steps", cfg.max_post_steps)):
            v = getattr(req, name)
            if isinstance(v, int) and v > limit:
                raise BadRequest(f"{name}={v} exceeds this server's limit of {limit}", name)
        d = cfg.default_params
        upd = {k: getattr(req, k) for k in DinferFields.model_fields if getattr(req, k) is not None}
        if logprobs is not None:
            upd["logprobs"] = logprobs
        try:
            p = derive_params(d, upd, max_tokens, model.config)  # the model's own rules too (cache, indel)
        except InvalidParam as e:
            raise BadRequest(str(e), e.field) from None
        if req.seed is None and p.temperature > 0:
            return [dataclasses.replace(p, seed=secrets.randbits(32)) for _ in range(n_prompts * n)]
        return [dataclasses.replace(p, seed=(p.seed + k) % 2 ** 32) for _ in range(n_prompts) for k in range(n)]

    max_chars = cfg.max_prompt_chars or CHARS_PER_TOKEN_BOUND * max_len

    def encode(prompt, what="prompt", allow_special=False) -> list[int]:
        """Text or ids -> checked ids (run off the event loop: `encode_all`). Lengths are bounded
        before tokenizing: at most max_chars characters, max_len ids."""
        if len(prompt) > (max_chars if isinstance(prompt, str) else max_len):
            unit, n = ("characters", max_chars) if isinstance(prompt, str) else ("token ids", max_len)
            raise BadRequest(f"{what} has {len(prompt)} {unit}; this server takes at most {n} (its maximum "
                             f"length is {max_len} tokens)", what)
        if isinstance(prompt, str):
            if tokenizer is None:
                raise BadRequest(f"{what}: this model has no tokenizer.json; send token ids", what)
            try:
                ids = tokenizer.encode_prompt(prompt, what, allow_special=allow_special)
            except ValueError as e:
                raise BadRequest(str(e), what) from None
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise BadRequest(f"{what} is empty", what)
        V = model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V or t == model.config.mask_token_id]
        if bad:
            raise BadRequest(f"{what}: token id {bad[0]} is out of range or the mask token", what)
        return ids

    async def encode_all(prompts, what="prompt", allow_special=False) -> list[list[int]]:
        """encode() for each prompt on a worker thread: a long prompt never blocks the event loop."""
        return await asyncio.to_thread(lambda: [encode(x, what, allow_special) for x in prompts])

    def limits(ids: list[int], max_tokens: int, p: SamplingParams):
        if len(ids) + p.gen_length > max_len:
            raise BadRequest(f"prompt has {len(ids)} tokens; with max_tokens={max_tokens} (decoded as "
                             f"{p.gen_length}) it exceeds the maximum length {max_len}", "max_tokens")

    def admitting():
        if batcher.draining:
            raise BadRequest("the server is shutting down; retry on another instance", status=503)
        if not batcher.ready.is_set():
            raise BadRequest("the server is warming up (compiling); retry shortly", status=503)

    async def constraint_of(req: CommonFields, max_tokens: int, params: list):
        """The request's canvas template (structured.Constrained: suffix, response_format,
        structured_outputs, guided_*) or None, and the params laid out for it; 400 naming the field
        when it cannot be expressed or combines with a field it does not support."""
        body = {k: getattr(req, k, None) for k in REQUEST_FIELDS}
        try:
            c, field = constraint_from_request(body, max_tokens)
        except SchemaError as e:
            raise BadRequest(str(e), e.keyword) from None
        if c is None:
            return None, params
        if tokenizer is None:
            raise BadRequest(f"{field} needs the model's tokenizer.json", field)
        for other, on in (("stream_canvas", req.stream_canvas), ("stop", req.stop),
                          ("return_step_map", req.return_step_map),
                          ("logprobs", getattr(req, "logprobs", None) not in (None, False)),
                          ("echo", getattr(req, "echo", None))):
            if on:
                raise BadRequest(f"{field} does not combine with {other} here (a templated answer is rendered "
                                 f"whole at the end; streamed, it comes as one chunk)", other)
        # a JSON / regex / choice template is the answer (max_tokens bounds it); an infill region is
        # the span (max_tokens) plus the suffix (bounded by the server's max_tokens)
        limit = cfg.max_tokens if field in ("suffix", "infill") else max_tokens
        try:
            built = await asyncio.to_thread(build_constraint, c, tokenizer, model.config, limit)
        except SchemaError as e:
            raise BadRequest(f"{field}: {e}", field) from None
        return built, templated_params(params, [built.template] * len(params))

    async def run_jobs(ids_list, params, max_tokens, stream, stop=(), records=False, canvas=False, constraint=None):
        """Queue one job per (prompt, params) pair, all or none. records: stream chunks carry the
        per-token records (logprobs / step map); canvas: they carry the provisional canvas;
        constraint: the jobs' canvas template (constraint_of)."""
        admitting()
        if len(ids_list) > cfg.max_queue:
            raise BadRequest(f"{len(ids_list)} prompts in one request exceed this server's queue of "
                             f"{cfg.max_queue}; send at most {cfg.max_queue} per request", "prompt")
        loop = asyncio.get_running_loop()
        deadline = None if cfg.request_timeout_s is None else time.monotonic() + cfg.request_timeout_s
        n_classes = 0 if constraint is None else template_classes([constraint.template])
        jobs = [Job(ids, p, max_tokens, loop, loop.create_future(),
                    p.spec_for(model.config) if constraint is None else constrained_spec(p.spec_for(model.config),
                                                                                         n_classes),
                    asyncio.Queue() if stream else None, deadline=deadline, stop=stop, records=records,
                    canvas=canvas, constraint=constraint)
                for ids, p in zip(ids_list, params)]
        try:
            batcher.submit_all(jobs)
        except QueueFull:
            raise BadRequest(f"the request queue is full ({cfg.max_queue} waiting); retry later", status=503) from None
        return jobs

    def cancel(jobs):
        for j in jobs:
            j.cancelled = True

    def timed_out() -> BadRequest:
        return BadRequest(f"the request timed out after {cfg.request_timeout_s:g}s (the server's "
                          f"--request-timeout)", status=504)

    async def wait_or_gone(aws: set, job_list, request, deadline):
        """asyncio.wait for the first of `aws`, polling the client: the jobs are cancelled and
        ClientGone / the 504 raised when the client disconnects / the deadline passes first."""
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                cancel(job_list)
                raise timed_out()
            step = DISCONNECT_POLL_S if left is None else min(DISCONNECT_POLL_S, left)
            done, _ = await asyncio.wait(aws, timeout=step, return_when=asyncio.FIRST_COMPLETED)
            if done:
                return done
            if request is not None and await request.is_disconnected():
                cancel(job_list)
                raise ClientGone()

    async def results_of(jobs, request=None) -> list[dict]:
        """The jobs' results; 504 at the deadline (the jobs are cancelled), 503/504 when dropped."""
        fut = asyncio.gather(*(j.future for j in jobs))
        try:
            await wait_or_gone({fut}, jobs, request, jobs[0].deadline)
            return fut.result()
        except asyncio.CancelledError:  # the handler was cancelled (client gone)
            cancel(jobs)
            raise
        except WatchdogTimeout as e:
            raise BadRequest(str(e), status=504, etype="timeout") from None
        except Cancelled as e:
            cancel(jobs)
            raise (timed_out() if e.status == 504 else BadRequest(str(e), status=e.status)) from None
        except InvalidParam as e:  # the engine refused a request that passed the checks here
            raise BadRequest(str(e), e.field) from None
        finally:
            if not fut.done():
                fut.cancel()  # it ends later, with CancelledError as its exception: retrieve that then
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            elif not fut.cancelled():
                fut.exception()  # retrieved: no "never retrieved" warning

    def edit_counts(r) -> dict:
        """A choice's edits / inserts / deletes (extension; models that edit or insert / delete only)."""
        return {k: r[k] for k in ("edits", "inserts", "deletes") if k in r}

    def usage(n_prompt, results):
        """OpenAI usage, plus (extension) each choice's forwards summed (`nfe`) and, for models that
        edit, the summed edit counts."""
        n_out = sum(len(r["token_ids"]) for r in results)
        out = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
               "nfe": sum(int(r["nfe"]) for r in results)}
        for k in ("edits", "inserts", "deletes"):
            if any(k in r for r in results):
                out[k] = sum(int(r.get(k, 0)) for r in results)
        return out

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    @app.get("/health")
    async def health():
        if batcher.draining:
            return JSONResponse(status_code=503, content={"status": "shutting down"})
        if not batcher.alive():
            return JSONResponse(status_code=503, content={"status": "scheduler stopped"})
        stuck = batcher.stuck()
        if stuck:
            return JSONResponse(status_code=503, content={"status": f"scheduler stuck: {stuck}"})
        if not batcher.ready.is_set():
            return JSONResponse(status_code=503, content={"status": "warming up"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(batcher.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "dinfer-jax"}]}

    @app.get("/stats")
    async def stats():
        return batcher.snapshot()

    def check_model(name):
        if name not in (None, "", cfg.model_name):
            raise BadRequest(f"model {name!r} is not served here (this server has {cfg.model_name!r})", "model", 404)

    # ---- per-token records: logprobs (decoding/row_state.commit_record: the distribution of the step that
    # committed the token) and the commit-step map (dLLM extension)

    def token_text(t: int) -> str:
        """One token's text (special tokens by name, so alternatives never collide on "")."""
        return tokenizer.decode([t], skip_special_tokens=False) if tokenizer is not None else f"token_id:{t}"

    def finite(v: float) -> float:
        """JSON has no -inf: a banned token's (EOS under ignore_eos / min_tokens) logprob -> -9999.0 (vLLM's)."""
        return max(float(v), -9999.0)

    def completion_logprobs(ids, recs, prev_ids=(), base: int = 0) -> dict:
        """OpenAI's legacy `logprobs` object for `ids` (recs: their (step, logprob, top) records);
        text_offset: where each token's text starts in the choice's text, after prev_ids (sent
        before) and `base` characters (the echoed prompt)."""
        dec = tokenizer.decode if tokenizer is not None else (lambda x: "".join(map(token_text, x)))
        prev = list(prev_ids)
        return {"tokens": [token_text(t) for t in ids], "token_logprobs": [finite(r[1]) for r in recs],
                "top_logprobs": [{token_text(t): finite(v) for t, v in r[2]} for r in recs],
                "text_offset": [base + len(dec(prev + list(ids[:k]))) for k in range(len(ids))]}

    def chat_logprobs(ids, recs) -> dict:
        """OpenAI's chat `logprobs` object ({"content": [...]}) for `ids` and their records."""
        def one(t, v):
            s = token_text(t)
            return {"token": s, "logprob": finite(v), "bytes": list(s.encode("utf-8"))}
        return {"content": [{**one(t, r[1]), "top_logprobs": [one(a, v) for a, v in r[2]]} for t, r in zip(ids, recs)]}

    def records_of(r: dict) -> list[tuple]:
        """A result's per-token records (step, logprob | None, top | None), aligned with its token_ids."""
        n = len(r["token_ids"])
        lps, tops = r.get("token_logprobs"), r.get("top_logprobs")
        return [(r["commit_steps"][k], None if lps is None else lps[k], None if tops is None else tops[k])
                for k in range(n)]

    def check_logprobs(n: Optional[int], name: str):
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise BadRequest(f"{name}={n} must be in [0, {MAX_LOGPROBS}]", name)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        check_logprobs(req.logprobs, "logprobs")
        if req.echo and req.logprobs is not None:
            raise BadRequest("echo with logprobs is not supported: a masked-diffusion model assigns no "
                             "left-to-right likelihood to the prompt's tokens (send echo or logprobs)", "echo")
        max_tokens = req.max_tokens or cfg.default_max_tokens
        prompts = req.prompt
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)):
            items = list(prompts)
        else:
            items = [prompts]
        if req.stream and len(items) > 1:
            raise BadRequest("stream=true takes one prompt per request", "prompt")
        n = choices_per_prompt(req)
        stop = stop_strings(req)
        params = sampling(req, max_tokens, len(items), n, req.logprobs)
        constraint, params = await constraint_of(req, max_tokens, params)
        ids_list = await encode_all(items)
        for ids in ids_list:
            limits(ids, max_tokens, params[0])
        records = req.logprobs is not None or bool(req.return_step_map)
        jobs = await run_jobs([ids for ids in ids_list for _ in range(n)], params, max_tokens, req.stream, stop,
                              records, bool(req.stream_canvas), constraint)
        # echo: the prompt's text before the answer's (text prompts as sent; token ids decoded)
        echoed = [(x if isinstance(x, str) else tokenizer.decode(ids) if tokenizer is not None else "")
                  if req.echo else "" for x, ids in zip(items, ids_list)]
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": cfg.model_name}
        if req.stream:
            return StreamingResponse(stream_completion(jobs[0], base, len(ids_list[0]), req, request, echoed[0]),
                                     media_type="text/event-stream")
        results = await results_of(jobs, request)

        def choice(i, r):
            c = {"index": i, "text": echoed[i // n] + (r["text"] if r["text"] is not None else ""),
                 "finish_reason": r["finish_reason"],
                 "logprobs": None if req.logprobs is None else completion_logprobs(r["token_ids"], records_of(r)),
                 "token_ids": r["token_ids"], "nfe": r["nfe"], "tpf": r["tpf"],
                 "undecoded_tokens": r["undecoded"], "seed": r["seed"], **edit_counts(r)}
            if req.return_step_map:
                c["commit_steps"] = r["commit_steps"]
            if "infill_spans" in r:
                c["infill_spans"] = r["infill_spans"]
            return c
        return {**base, "choices": [choice(i, r) for i, r in enumerate(results)],
                "usage": usage(sum(map(len, ids_list)), results)}

    async def stream_events(job, request):
        """The job's stream events (text delta, ids, records, CanvasView | None) until it finishes; at
        the deadline or when the client goes away the job is cancelled (the stream then ends with an
        error event / silently)."""
        while True:
            get = asyncio.ensure_future(job.events.get())
            try:
                done = await wait_or_gone({get, job.future}, [job], request, job.deadline)
            except BaseException:
                get.cancel()
                raise
            if get in done:
                yield get.result()
                continue
            get.cancel()
            while not job.events.empty():
                yield job.events.get_nowait()
            return

    def canvas_of(job: Job, view: CanvasView) -> dict:
        """A stream_canvas chunk's `canvas` object (`canvas_object`) for `job`'s view."""
        stops = () if job.params.ignore_eos else batcher.stop_ids
        return canvas_object(view, tokenizer, model.config.mask_token_id, stops)

    def stream_error(e: Exception) -> str:
        if isinstance(e, BadRequest):
            return sse({"error": {"message": e.message, "type": "timeout" if e.status == 504 else "server_error"}})
        return sse({"error": {"message": f"generation failed: {e}", "type": "server_error"}})

    async def stream_job(job, chunk: dict, n_prompt, req, request, first: list, choice, last):
        """The SSE lines of one streamed job: the `first` choices, then choice(delta, ids, recs) per
        decoded piece (with commit_steps / canvas when asked), then last(result), usage, [DONE].
        A client that goes away, or a failure, cancels the job."""
        try:
            for c in first:
                yield sse({**chunk, "choices": [c]})
            async for delta, ids, recs, view in stream_events(job, request):
                c = choice(delta, ids, recs)
                if req.return_step_map:
                    c["commit_steps"] = [r[0] for r in recs]
                if view is not None:
                    c["canvas"] = canvas_of(job, view)
                yield sse({**chunk, "choices": [c]})
            r = job.future.result()
        except ClientGone:
            return
        except Exception as e:
            yield stream_error(e)
            return
        finally:  # the client went away (the generator is cancelled) or the stream failed
            if not job.future.done():
                job.cancelled = True
        yield sse({**chunk, "choices": [last(r)]})
        if (req.stream_options or {}).get("include_usage"):
            yield sse({**chunk, "choices": [], "usage": usage(n_prompt, [r])})
        yield "data: [DONE]\n\n"

    def stream_completion(job, base, n_prompt, req, request, echoed: str = ""):
        sent: list[int] = []

        def choice(delta, ids, recs):
            c = {"index": 0, "text": delta, "finish_reason": None, "logprobs": None}
            if req.logprobs is not None:
                c["logprobs"] = completion_logprobs(ids, recs, sent, len(echoed))
            sent.extend(ids)
            return c
        first = [{"index": 0, "text": echoed, "finish_reason": None, "logprobs": None}] if echoed else []
        return stream_job(job, base, n_prompt, req, request, first, choice,
                          lambda r: {"index": 0, "text": "", "finish_reason": r["finish_reason"], "logprobs": None,
                                     "seed": r["seed"]})

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check_model(req.model)
        if chat_formatter is None or tokenizer is None:
            raise BadRequest("this model folder has no tokenizer.json, so chat is unavailable; use /v1/completions "
                             "with token ids")
        from dinfer_jax.chat import ChatTemplateError
        max_tokens = req.max_completion_tokens or req.max_tokens or cfg.default_max_tokens
        n = choices_per_prompt(req)
        stop = stop_strings(req)
        check_logprobs(req.top_logprobs, "top_logprobs")
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        params = sampling(req, max_tokens, 1, n, (req.top_logprobs or 0) if req.logprobs else None)
        constraint, params = await constraint_of(req, max_tokens, params)

        def render() -> list[int]:  # on a worker thread: templates and tokenizing take time
            for i, m in enumerate(req.messages):  # user text must not smuggle in special tokens
                content = m.get("content") if isinstance(m, dict) else None
                parts = [content] if isinstance(content, str) else [
                    c.get("text") for c in content or [] if isinstance(c, dict) and isinstance(c.get("text"), str)] \
                    if isinstance(content, list) else []
                for part in filter(None, parts):
                    encode(part, f"messages[{i}].content")
            try:
                text = chat_formatter(req.messages)
            except ChatTemplateError as e:
                raise BadRequest(str(e), "messages") from None
            return encode(text, "messages", allow_special=True)
        ids = await asyncio.to_thread(render)
        limits(ids, max_tokens, params[0])
        jobs = await run_jobs([ids] * n, params, max_tokens, req.stream, stop,
                              bool(req.logprobs) or bool(req.return_step_map), bool(req.stream_canvas), constraint)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": cfg.model_name}
        if req.stream:
            return StreamingResponse(stream_chat(jobs[0], base, len(ids), req, request), media_type="text/event-stream")
        results = await results_of(jobs, request)
        r = results[0]

        def choice(i, c):
            out = {"index": i, "message": {"role": "assistant", "content": c["text"]},
                   "finish_reason": c["finish_reason"],
                   "logprobs": chat_logprobs(c["token_ids"], records_of(c)) if req.logprobs else None,
                   "seed": c["seed"], "nfe": c["nfe"], "tpf": c["tpf"], "undecoded_tokens": c["undecoded"],
                   **edit_counts(c)}
            if req.return_step_map:
                out["commit_steps"] = c["commit_steps"]
            return out
        return {**base, "object": "chat.completion",
                "choices": [choice(i, c) for i, c in enumerate(results)],
                "usage": usage(len(ids), results), "nfe": r["nfe"], "tpf": r["tpf"], "undecoded_tokens": r["undecoded"]}

    def stream_chat(job, base, n_prompt, req, request):
        def choice(delta, ids, recs):
            c = {"index": 0, "delta": {"content": delta}, "finish_reason": None}
            if req.logprobs:
                c["logprobs"] = chat_logprobs(ids, recs)
            return c
        first = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        return stream_job(job, {**base, "object": "chat.completion.chunk"}, n_prompt, req, request, first, choice,
                          lambda r: {"index": 0, "delta": {}, "finish_reason": r["finish_reason"], "seed": r["seed"]})

    @app.on_event("shutdown")
    def _shutdown():
        batcher.close()

    return app


def _gate(app) -> Optional[RequestGate]:
    """The app's RequestGate instance (built by Starlette with the middleware stack)."""
    node = getattr(app, "middleware_stack", None)
    while node is not None and not isinstance(node, RequestGate):
        node = getattr(node, "app", None)
    return node


def make_server(app, host: str, port: int, log_level: str = "info"):
    """A uvicorn.Server whose SIGTERM / SIGINT drains: the app is marked draining (new requests
    and /health answer 503 while the server keeps listening), then, once no request is in flight
    and nothing decodes (or after cfg.drain_timeout_s), uvicorn stops and the process exits. A
    second signal stops at once."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            batcher = app.state.batcher
            if batcher.draining:  # the second signal
                return super().handle_exit(sig, frame)
            batcher.draining = True
            end = time.monotonic() + batcher.cfg.drain_timeout_s

            def drain():
                gate = _gate(app)
                while time.monotonic() < end:
                    idle = batcher.idle() and (gate is None or gate.inflight == 0)
                    if idle:
                        break
                    time.sleep(0.05)
                uvicorn.Server.handle_exit(self, sig, frame)
            threading.Thread(target=drain, name="dinfer-drain", daemon=True).start()

    return DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level))


def serve(model_dir: str | None, host: str = "127.0.0.1", port: int = 8000, cfg: ServerConfig | None = None,
          model=None, log_level: str = "info"):
    """Load the model (or use `model`) and run uvicorn until SIGTERM / SIGINT (graceful: in-flight
    requests finish first)."""
    from dinfer_jax.chat import ChatFormatter
    from dinfer_jax.model import load_model
    from dinfer_jax.tokenizer import has_tokenizer, load_tokenizer
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port} is outside 1..65535")
    model = model or load_model(model_dir)
    tok = load_tokenizer(model_dir) if model_dir and has_tokenizer(model_dir) else None
    fmt = None
    if tok is not None:
        try:
            fmt = ChatFormatter(model_dir, model.config.family)
        except ValueError:
            fmt = None
    cfg = cfg or ServerConfig(model_name=model_dir or "dinfer-jax")
    app = create_app(model, tok, cfg, fmt)
    import signal
    import sys
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal it caught after its graceful shutdown; with this handler
        # restored under it, a drained SIGTERM ends the process with status 0.
        signal.signal(signal.SIGTERM, lambda *_: None)
    make_server(app, host, port, log_level).run()
    s = app.state.batcher.snapshot()
    print(f"dinfer-jax: server stopped ({s['completed']} prompts completed, {s['cancelled']} cancelled)",
          file=sys.stderr, flush=True)
