"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (with `stream`), /v1/models,
/health, /stats. FastAPI + uvicorn; `dinfer-jax serve --model DIR --port P`.

Requests go through a `Batcher`: one worker thread runs the engine; concurrent requests whose
compiled settings match (gen_length, block_length, strategy, cache, ...) are decoded together in
one batch (per-request threshold, temperature and seed are per-row values of the same program;
batches are padded to the engine's shape buckets). The queue is bounded: a full queue answers 503.
Streaming requests select the program variant with a per-iteration host callback
(decoding/observe.py); each block is sent as soon as it is decoded.

dInfer's sampling settings are extra body fields: threshold, low_threshold, block_length,
strategy, cache, steps, factor, smoothing, and for block diffusion (cache "block") editing_threshold,
max_post_steps, num_to_transfer, top_k, indel (OpenAI clients pass them with `extra_body=`); top_p is
OpenAI's own field.
Bad input (unknown fields, bad JSON, lengths over the limits) -> 400 with an OpenAI-style error.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import threading
import time
import uuid
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dinfer_jax.engine import InvalidParam, SamplingParams

STRATEGY = Literal["fixed", "random", "threshold", "factor", "credit", "hierarchy"]
CACHE = Literal["none", "prefix", "dual", "vicinity", "block"]


class QueueFull(Exception):
    pass


class DinferFields(BaseModel):
    """Extra body fields: dInfer's decoding settings (None = the server's default). Only their
    types are declared here; their rules live in SamplingParams (one place for the CLI, the library
    and the server), whose InvalidParam becomes a 400 naming the field."""
    model_config = ConfigDict(extra="forbid")
    threshold: Optional[float] = None
    low_threshold: Optional[float] = None
    block_length: Optional[int] = None
    strategy: Optional[STRATEGY] = None
    cache: Optional[CACHE] = None
    steps: Optional[int] = None
    factor: Optional[float] = None
    smoothing: Optional[bool] = None
    # block diffusion (cache "block"; LLaDA2.x): the peers' names
    editing_threshold: Optional[float] = None
    max_post_steps: Optional[int] = None
    num_to_transfer: Optional[int] = None
    top_k: Optional[int] = None
    indel: Optional[bool] = None  # LLaDA2.2 insert/delete editing


class CommonFields(DinferFields):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[dict] = None
    n: Optional[int] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    user: Optional[str] = None


class CompletionRequest(CommonFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]


class ChatRequest(CommonFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = Field(None, ge=1)


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
    scheduler: str = "continuous"  # continuous (dinfer_jax/continuous.py) | static (Batcher: whole batches)
    segment: int = 8  # continuous: loop iterations per segment (bench/segment_cost.py)


@dataclasses.dataclass
class Job:
    """One prompt to decode; results come back on `loop` through `future` / `events`."""
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    key: Any  # the compiled settings (DecodeSpec): jobs with equal keys can share a batch
    events: Optional[asyncio.Queue] = None  # streaming: text deltas
    sent_text: str = ""
    sent_blocks: int = 0


class Batcher:
    """Groups queued jobs with the same compiled settings into engine batches (one worker thread)."""

    def __init__(self, generator, tokenizer, cfg: ServerConfig):
        self.gen, self.tok, self.cfg = generator, tokenizer, cfg
        mc = generator.model.config
        self.stop_ids = {mc.eos_token_id} | ({mc.eot_token_id} if mc.eot_token_id is not None else set())
        self.mask_id = mc.mask_token_id
        self.pending: collections.deque[Job] = collections.deque()
        self.cond = threading.Condition()
        self.stats = {"requests": 0, "completed": 0, "failed": 0, "rejected_queue_full": 0, "batches": 0,
                      "max_batch_size": 0, "batch_sizes": collections.Counter()}
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="dinfer-batcher", daemon=True)
        self.thread.start()

    def submit(self, job: Job):
        with self.cond:
            if len(self.pending) >= self.cfg.max_queue:
                self.stats["rejected_queue_full"] += 1
                raise QueueFull()
            self.pending.append(job)
            self.stats["requests"] += 1
            self.cond.notify()

    def close(self):
        with self.cond:
            self._stop = True
            self.cond.notify()
        self.thread.join(timeout=10)

    def snapshot(self) -> dict:
        with self.cond:
            s = dict(self.stats)
            s["batch_sizes"] = {str(k): v for k, v in sorted(self.stats["batch_sizes"].items())}
            s["queue_depth"] = len(self.pending)
        return s

    def _take_batch(self) -> list[Job]:
        with self.cond:
            while not self.pending and not self._stop:
                self.cond.wait()
            if self._stop:
                return []
        time.sleep(self.cfg.batch_wait_s)  # let concurrent requests arrive
        with self.cond:
            key = self.pending[0].key
            batch, rest = [], collections.deque()
            while self.pending:
                j = self.pending.popleft()
                (batch if j.key == key and len(batch) < self.cfg.max_batch else rest).append(j)
            self.pending = rest
            self.stats["batches"] += 1
            self.stats["batch_sizes"][len(batch)] += 1
            self.stats["max_batch_size"] = max(self.stats["max_batch_size"], len(batch))
        return batch

    def _run(self):
        while True:
            batch = self._take_batch()
            if not batch:
                return
            try:
                self._decode(batch)
            except Exception as e:  # the batch fails, the server stays up
                with self.cond:
                    self.stats["failed"] += len(batch)
                for j in batch:
                    self._finish(j, exc=e)

    def _text_until_stop(self, ids) -> tuple[list[int], bool]:
        out = []
        for t in ids:
            if t in self.stop_ids:
                return out, True
            out.append(int(t))
        return out, False

    def _decode(self, batch: list[Job]):
        streaming = [j for j in batch if j.events is not None]
        observer = None
        if streaming:
            bl = batch[0].params.block_length

            def send_finished_blocks(step, gen_BG, blk_B, done_B, active_B):
                for b, j in enumerate(batch):
                    if j.events is None:
                        continue
                    finished = gen_BG.shape[1] // bl if done_B[b] else int(blk_B[b])
                    if finished > j.sent_blocks:
                        j.sent_blocks = finished
                        ids, _ = self._text_until_stop(gen_BG[b, :min(finished * bl, j.max_tokens)])
                        self._emit(j, ids)
            observer = send_finished_blocks
        r = self.gen.generate([np.asarray(j.prompt_ids, np.int32) for j in batch], [j.params for j in batch],
                              observer=observer)
        for b, j in enumerate(batch):
            ids, stopped = self._text_until_stop(r.raw_ids[b][:j.max_tokens])
            if j.events is not None:
                self._emit(j, ids)
            self._finish(j, result={"token_ids": ids, "text": self.tok.decode(ids) if self.tok else None,
                                    "finish_reason": "stop" if stopped else "length", "nfe": r.nfe[b],
                                    "tpf": round(r.tpf[b], 4), "batch_size": len(batch)})
        with self.cond:
            self.stats["completed"] += len(batch)

    def _emit(self, job: Job, ids: list[int]):
        text = self.tok.decode(ids) if self.tok else " ".join(map(str, ids))
        if len(text) > len(job.sent_text) and text.startswith(job.sent_text):
            delta, job.sent_text = text[len(job.sent_text):], text
            job.loop.call_soon_threadsafe(job.events.put_nowait, delta)

    def _finish(self, job: Job, result=None, exc=None):
        def done():
            if job.future.done():
                return
            if exc is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
        job.loop.call_soon_threadsafe(done)


def create_app(model, tokenizer, cfg: ServerConfig, chat_formatter=None):
    """The FastAPI app for one model. tokenizer: dinfer_jax.tokenizer.Tokenizer (or None: token-id
    prompts only); chat_formatter: messages -> text (dinfer_jax.chat.ChatFormatter)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    if cfg.scheduler == "continuous":
        from dinfer_jax.continuous import ContinuousBatcher
        batcher = ContinuousBatcher(model.generator, tokenizer, cfg, segment=cfg.segment)
    elif cfg.scheduler == "static":
        batcher = Batcher(model.generator, tokenizer, cfg)
    else:
        raise ValueError(f"scheduler={cfg.scheduler!r}: choose continuous or static")
    max_len = cfg.max_model_len or model.config.max_position_embeddings
    app = FastAPI(title="dinfer-jax", version="1")
    app.state.batcher = batcher

    def error(status: int, message: str, param: str | None = None, etype: str = "invalid_request_error"):
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": etype,
                                                                   "param": param, "code": None}})

    class BadRequest(Exception):
        def __init__(self, message, param=None, status=400):
            super().__init__(message)
            self.message, self.param, self.status = message, param, status

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        errs = exc.errors()
        parts = []
        for e in errs[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            if e.get("type") == "json_invalid":
                parts.append(f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
            elif e.get("type") == "extra_forbidden":
                parts.append(f"unknown parameter {loc!r}")
            else:
                parts.append(f"{loc or 'body'}: {e.get('msg')}")
        first = errs[0].get("loc", ()) if errs else ()
        return error(400, "; ".join(parts) or "invalid request", ".".join(str(x) for x in first if x != "body") or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), etype="not_found" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(BadRequest)
    async def _bad(request, exc: BadRequest):
        return error(exc.status, exc.message, exc.param, "server_overloaded" if exc.status == 503 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}: {exc}", etype="server_error")

    def sampling(req: CommonFields, max_tokens: int) -> SamplingParams:
        if req.n not in (None, 1):
            raise BadRequest(f"n={req.n}: one completion per prompt is supported (send the prompt again)", "n")
        if req.stop:
            raise BadRequest("stop sequences are not supported (generation ends at the model's EOS)", "stop")
        d = cfg.default_params
        upd = {k: getattr(req, k) for k in DinferFields.model_fields if getattr(req, k) is not None}
        if req.temperature is not None:
            upd["temperature"] = req.temperature
        if req.seed is not None:
            upd["seed"] = req.seed
        if req.top_p is not None:
            upd["top_p"] = req.top_p
        try:
            block = dataclasses.replace(d, **upd).block_length  # the engine's rules (InvalidParam)
            block = min(block, max_tokens)
            upd["block_length"] = block
            upd["gen_length"] = -(-max_tokens // block) * block
            if upd.get("strategy", d.strategy) in ("fixed", "random") and "steps" not in upd:
                upd["steps"] = upd["gen_length"]
            p = dataclasses.replace(d, **upd)
            p.spec(model.config.mask_token_id, model.config.eos_id)
        except InvalidParam as e:
            raise BadRequest(str(e), e.field) from None
        return p

    def encode(prompt, what="prompt", allow_special=False) -> list[int]:
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

    def limits(ids: list[int], max_tokens: int, p: SamplingParams):
        if max_tokens > cfg.max_tokens:
            raise BadRequest(f"max_tokens={max_tokens} exceeds this server's limit of {cfg.max_tokens}", "max_tokens")
        if len(ids) + p.gen_length > max_len:
            raise BadRequest(f"prompt has {len(ids)} tokens; with max_tokens={max_tokens} (decoded as "
                             f"{p.gen_length}) it exceeds the maximum length {max_len}", "max_tokens")

    async def run_jobs(ids_list, p, max_tokens, stream):
        loop = asyncio.get_running_loop()
        key = p.spec(model.config.mask_token_id, model.config.eos_token_id)
        jobs = [Job(ids, p, max_tokens, loop, loop.create_future(), key, asyncio.Queue() if stream else None)
                for ids in ids_list]
        try:
            for j in jobs:
                batcher.submit(j)
        except QueueFull:
            raise BadRequest(f"the request queue is full ({cfg.max_queue} waiting); retry later", status=503) from None
        return jobs

    def usage(n_prompt, results):
        n_out = sum(len(r["token_ids"]) for r in results)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    @app.get("/health")
    async def health():
        return {"status": "ok"}

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

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        max_tokens = req.max_tokens or cfg.default_max_tokens
        prompts = req.prompt
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)):
            items = list(prompts)
        else:
            items = [prompts]
        if req.stream and len(items) > 1:
            raise BadRequest("stream=true takes one prompt per request", "prompt")
        p = sampling(req, max_tokens)
        ids_list = [encode(x) for x in items]
        for ids in ids_list:
            limits(ids, max_tokens, p)
        jobs = await run_jobs(ids_list, p, max_tokens, req.stream)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": cfg.model_name}
        if req.stream:
            return StreamingResponse(stream_completion(jobs[0], base, len(ids_list[0]), req), media_type="text/event-stream")
        results = await asyncio.gather(*(j.future for j in jobs))
        return {**base, "choices": [{"index": i, "text": r["text"] if r["text"] is not None else "",
                                     "finish_reason": r["finish_reason"], "logprobs": None,
                                     "token_ids": r["token_ids"], "nfe": r["nfe"], "tpf": r["tpf"]}
                                    for i, r in enumerate(results)],
                "usage": usage(sum(map(len, ids_list)), results)}

    async def stream_events(job):
        while True:
            get = asyncio.ensure_future(job.events.get())
            done, _ = await asyncio.wait({get, job.future}, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                yield get.result()
                continue
            get.cancel()
            while not job.events.empty():
                yield job.events.get_nowait()
            return

    async def stream_completion(job, base, n_prompt, req):
        async for delta in stream_events(job):
            yield sse({**base, "choices": [{"index": 0, "text": delta, "finish_reason": None, "logprobs": None}]})
        try:
            r = job.future.result()
        except Exception as e:
            yield sse({"error": {"message": f"generation failed: {e}", "type": "server_error"}})
            return
        yield sse({**base, "choices": [{"index": 0, "text": "", "finish_reason": r["finish_reason"], "logprobs": None}]})
        if (req.stream_options or {}).get("include_usage"):
            yield sse({**base, "choices": [], "usage": usage(n_prompt, [r])})
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        check_model(req.model)
        if chat_formatter is None or tokenizer is None:
            raise BadRequest("this model folder has no tokenizer.json, so chat is unavailable; use /v1/completions "
                             "with token ids")
        from dinfer_jax.chat import ChatTemplateError
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
        max_tokens = req.max_completion_tokens or req.max_tokens or cfg.default_max_tokens
        p = sampling(req, max_tokens)
        ids = encode(text, "messages", allow_special=True)
        limits(ids, max_tokens, p)
        jobs = await run_jobs([ids], p, max_tokens, req.stream)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": cfg.model_name}
        if req.stream:
            return StreamingResponse(stream_chat(jobs[0], base, len(ids), req), media_type="text/event-stream")
        r = await jobs[0].future
        return {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r["text"]},
                             "finish_reason": r["finish_reason"], "logprobs": None}],
                "usage": usage(len(ids), [r]), "nfe": r["nfe"], "tpf": r["tpf"]}

    async def stream_chat(job, base, n_prompt, req):
        chunk = {**base, "object": "chat.completion.chunk"}
        yield sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
        async for delta in stream_events(job):
            yield sse({**chunk, "choices": [{"index": 0, "delta": {"content": delta}, "finish_reason": None}]})
        try:
            r = job.future.result()
        except Exception as e:
            yield sse({"error": {"message": f"generation failed: {e}", "type": "server_error"}})
            return
        yield sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": r["finish_reason"]}]})
        if (req.stream_options or {}).get("include_usage"):
            yield sse({**chunk, "choices": [], "usage": usage(n_prompt, [r])})
        yield "data: [DONE]\n\n"

    @app.on_event("shutdown")
    def _shutdown():
        batcher.close()

    return app


def serve(model_dir: str | None, host: str = "127.0.0.1", port: int = 8000, cfg: ServerConfig | None = None,
          model=None, log_level: str = "info"):
    """Load the model (or use `model`) and run uvicorn until interrupted."""
    import uvicorn
    from dinfer_jax.chat import ChatFormatter
    from dinfer_jax.model import load_model
    from dinfer_jax.tokenizer import has_tokenizer, load_tokenizer
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
    uvicorn.run(app, host=host, port=port, log_level=log_level)
