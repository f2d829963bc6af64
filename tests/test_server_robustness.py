"""A hostile user against `dinfer-jax serve` (real uvicorn on a loopback port, the shipped demo
models, both schedulers): every invalid request is a 4xx within a second and the next ordinary
request still gets the engine's answer; requests of mixed lengths / blocks decode together;
a failing or stuck batch fails only its own requests; bodies and prompts are bounded before they
are read; a new length compiles without delaying the warmed ones; options are checked at startup."""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import logging
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from bench.serve_load import InProcessServer  # noqa: E402
from demo_helpers import demo  # noqa: E402

from dinfer_jax.serving.scheduler import ServerConfig, derive_params  # noqa: E402

PROMPT = "add 123+045="


def _block_demo():
    from dinfer_jax import load_model
    from dinfer_jax.checkpoint import DEMO_BLOCK_MODEL_DIR
    from dinfer_jax.tokenizer import load_tokenizer
    return load_model(DEMO_BLOCK_MODEL_DIR), load_tokenizer(DEMO_BLOCK_MODEL_DIR)


def _engine(model, tok, cfg: ServerConfig, body: dict) -> list[int]:
    """What the server must answer for `body`: the engine alone with the server's derived params."""
    upd = {k: v for k, v in body.items() if k not in ("prompt", "max_tokens")}
    p = derive_params(cfg.default_params, upd, body["max_tokens"], model.config)
    r = model.generator.generate([np.asarray(tok.encode(body["prompt"]), np.int32)], p)
    return r.token_ids[0][:body["max_tokens"]]


@pytest.fixture(scope="module", params=["static", "continuous"])
def server(request):
    model, tok = demo()
    cfg = ServerConfig(model_name="demo", max_batch=8, scheduler=request.param, max_tokens=64,
                       max_body_bytes=64 * 1024)
    with InProcessServer(model, tok, cfg) as s:
        yield s, model, tok, cfg


# (body fields, the param the 400 names): each is refused for the full-attention demo model
INVALID = [
    ({"cache": "block"}, "cache"),  # block diffusion on a full-attention model
    ({"cache": "block", "indel": True}, "cache"),
    ({"strategy": "sequential"}, "strategy"),  # SDAR's remasking needs the block cache
    ({"editing_threshold": 0.5}, "editing_threshold"),  # editing on a full-canvas model
    ({"indel": True}, "indel"),
    ({"sub_block_length": 4}, "sub_block_length"),
    ({"smoothing": True, "cache": "prefix"}, "smoothing"),
    ({"temperature": 1e308}, "temperature"),
    ({"temperature": 1e-30}, "temperature"),
    ({"top_p": 0.5}, "top_p"),
    ({"alg": "entropy"}, "alg"),
    ({"block_length": 0}, "block_length"),
    ({"max_tokens": True}, "max_tokens"),  # strict types: true is no integer
    ({"stream": "yes"}, "stream"),
    ({"seed": -1}, "seed"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"strategy": "fixed", "steps": 3, "block_length": 8}, "steps"),
    ({"min_tokens": 99}, "min_tokens"),
    ({"bogus": 1}, "bogus"),
]


@pytest.mark.parametrize("body,param", INVALID, ids=[f"{p}-{i}" for i, (_, p) in enumerate(INVALID)])
def test_invalid_request_is_a_fast_400_and_the_next_one_succeeds(server, body, param):
    s, model, tok, cfg = server
    t = time.perf_counter()
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert time.perf_counter() - t < 1.0
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 16}, timeout=300)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["token_ids"] == _engine(model, tok, cfg, {"prompt": PROMPT, "max_tokens": 16})
    assert httpx.get(f"{s.url}/health").json() == {"status": "ok"}


def test_malformed_json_names_no_param_and_bodies_are_capped(server):
    s, *_ = server
    r = httpx.post(f"{s.url}/v1/completions", content=b'{"prompt": "x", "max_tokens": 4,,}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    big = json.dumps({"prompt": "a" * 200_000, "max_tokens": 4}).encode()  # over the 64 KiB cap
    t = time.perf_counter()
    r = httpx.post(f"{s.url}/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"], r.text

    def chunks():  # no Content-Length: the cap applies while the body streams in
        for _ in range(10):
            yield b" " * 20_000
    r = httpx.post(f"{s.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert time.perf_counter() - t < 5
    # under the body cap but over the prompt's character bound (16 x max length 512): refused unread
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "a" * 9000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "8192" in r.text, r.text
    assert httpx.get(f"{s.url}/health").status_code == 200


def test_mixed_lengths_and_blocks_decode_together(server):
    """Concurrent requests whose max_tokens / block_length select different programs (16 and 5,
    24 and 12, blocks 1, 3 and 7): all answered as the engine answers each alone."""
    s, model, tok, cfg = server
    bodies = [{"prompt": PROMPT, "max_tokens": m} for m in (16, 5) * 4]
    bodies += [{"prompt": "sort 5391=", "max_tokens": m} for m in (24, 12)]
    bodies += [{"prompt": PROMPT, "max_tokens": 8, "block_length": b} for b in (1, 3, 7)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
        got = list(ex.map(lambda b: httpx.post(f"{s.url}/v1/completions", json=b, timeout=600), bodies))
    for b, r in zip(bodies, got):
        assert r.status_code == 200, (b, r.text)
        assert r.json()["choices"][0]["token_ids"] == _engine(model, tok, cfg, b), b


def test_block_model_rejections_and_startup_checks():
    """The block-diffusion demo model: indel without DELETE / SPLIT ids and block-only settings on a
    full-canvas cache are 400s; a prefix pool larger than memory is refused at startup."""
    model, tok = _block_demo()
    cfg = ServerConfig(model_name="demo-block", max_batch=4, max_tokens=32, default_max_tokens=16,
                       default_params=derive_params(ServerConfig("x").default_params, {"cache": "block",
                                                                                          "block_length": 4}, 16))
    want = _engine(model, tok, cfg, {"prompt": PROMPT, "max_tokens": 8})  # before the server's threads run
    with InProcessServer(model, tok, cfg) as s:
        for body, param in (({"indel": True}, "indel"), ({"cache": "dual", "sub_block_length": 2}, "sub_block_length"),
                            ({"cache": "dual", "strategy": "sequential"}, "strategy"),
                            ({"smoothing": True}, "smoothing")):
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, **body}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8}, timeout=300)
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["token_ids"] == want
        # the server default (block cache) yields to a request's full-canvas cache
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "cache": "dual"},
                       timeout=300)
        assert r.status_code == 200, r.text
    from dinfer_jax.serving.http import create_app
    with pytest.raises(ValueError, match="--prefix-cache-mb 1e\\+06 .* does not fit"):
        create_app(model, tok, ServerConfig(model_name="x", prefix_cache_mb=1e6))
    with pytest.raises(ValueError, match="--default-max-tokens 4096 leaves no room"):
        create_app(model, tok, ServerConfig(model_name="x", default_max_tokens=4096, max_tokens=8192))


def test_rows_left_masked_are_cut_and_count_their_own_forwards():
    """A random SDAR model predicts its mask id, so blocks never fill and rows run to their iteration
    bound. The continuous scheduler, with lengths 4 and 12 mixed in one program, reports each row's
    forwards as decoding it alone does (the row's own bound, not the program's), and no answer holds
    the mask id: ids end before the first undecoded position, which `undecoded_tokens` counts."""
    from dinfer_jax.families import preset
    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.model import Model
    from dinfer_jax.train import init_params
    mc = preset("tiny-sdar")
    model = Model(mc, init_params(mc, seed=3))
    cfg = ServerConfig(model_name="m", max_batch=4, max_tokens=16, default_max_tokens=16,
                       default_params=SamplingParams.for_model(mc))
    bodies = [{"prompt": p, "max_tokens": m} for p, m in (([11, 12, 13], 12), ([20, 21], 4), ([30] * 6, 4),
                                                          ([40, 41, 42, 43, 44], 12))]
    alone = []
    for b in bodies:
        p = derive_params(cfg.default_params, {}, b["max_tokens"], mc)
        with pytest.warns(RuntimeWarning, match="iteration bound"):
            r = model.generator.generate([np.asarray(b["prompt"], np.int32)], p)
        assert mc.mask_token_id in r.token_ids[0][:b["max_tokens"]]  # the premise: rows end masked
        alone.append(r)
    with InProcessServer(model, None, cfg) as s:
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
            got = list(ex.map(lambda b: httpx.post(f"{s.url}/v1/completions", json=b, timeout=600), bodies))
        stats = httpx.get(f"{s.url}/stats", timeout=30).json()
    for b, r, a in zip(bodies, got, alone):
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        raw = a.token_ids[0][:b["max_tokens"]]
        first = raw.index(mc.mask_token_id)
        assert ch["token_ids"] == raw[:first] and mc.mask_token_id not in ch["token_ids"]
        assert ch["undecoded_tokens"] == raw.count(mc.mask_token_id) > 0
        assert ch["nfe"] == a.nfe[0], b
    assert stats["undecoded_rows"] == len(bodies)
    # The same rows mixed in one program for certain (the server may run them apart when they
    # arrive one by one): a RunningBatch of the 12-token program holding all four.
    from dinfer_jax.decoding.segments import RunningBatch
    ps = [derive_params(cfg.default_params, {}, b["max_tokens"], mc) for b in bodies]
    rb = RunningBatch(model.generator, ps[0].spec_for(mc), 32, 4)
    rb.admit([(i, np.asarray(b["prompt"], np.int32), p) for i, (b, p) in enumerate(zip(bodies, ps))])
    done = {}
    while rb.running:
        done.update({r.tag: r.nfe for r in rb.step(8)})
    assert [done[i] for i in range(len(bodies))] == [a.nfe[0] for a in alone]


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_streaming_sends_one_chunk_per_block(scheduler):
    """A streamed request gets one text chunk per decoded block, also when one segment (continuous,
    here 10^4 iterations: the whole request) finishes several blocks: chunk k is the text of blocks
    [0, k] minus that of blocks [0, k-1] of the non-streamed answer."""
    model, tok = demo()
    cfg = ServerConfig(model_name="demo", max_batch=2, scheduler=scheduler, segment=10_000, max_tokens=64)
    body = {"prompt": PROMPT, "max_tokens": 40, "block_length": 8, "ignore_eos": True,
            "strategy": "fixed", "steps": 40, "cache": "none"}
    with InProcessServer(model, tok, cfg) as s:
        ids = httpx.post(f"{s.url}/v1/completions", json=body, timeout=300).json()["choices"][0]["token_ids"]
        chunks = []
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    if ch["finish_reason"] is None:
                        chunks.append(ch["text"])
    texts = [tok.decode(ids[:8 * k]) for k in range(6)]
    want = [b[len(a):] for a, b in zip(texts, texts[1:]) if len(b) > len(a)]
    assert len(want) >= 3 and chunks == want, (chunks, want)


def test_server_defaults_yield_to_the_request():
    """A Dream-like server default (strategy dream, alg entropy) does not refuse a request's own
    strategy; a request's own conflicting fields are still refused, naming them."""
    from dinfer_jax.engine import InvalidParam, SamplingParams
    d = SamplingParams(gen_length=64, block_length=64, strategy="dream", alg="entropy", steps=64)
    p = derive_params(d, {"strategy": "threshold"}, 32)
    assert p.strategy == "threshold" and p.alg is None and p.steps == 64
    with pytest.raises(InvalidParam) as e:
        derive_params(d, {"strategy": "threshold", "alg": "entropy"}, 32)
    assert e.value.field == "alg"
    block = SamplingParams(gen_length=32, block_length=32, cache="block", threshold=0.95, editing_threshold=0.5)
    p = derive_params(block, {"cache": "dual"}, 32)
    assert p.cache == "dual" and p.editing_threshold is None and p.threshold == 0.95


def test_scheduler_survives_a_planning_bug_and_a_failing_batch():
    """An exception escaping the scheduler loop (a bug) fails the requests in flight; a failing
    segment fails only its batch; the thread stays alive, /health stays ok, the next request succeeds.
    With the thread gone /health says so."""
    model, tok = demo()
    cfg = ServerConfig(model_name="demo", max_batch=4)
    with InProcessServer(model, tok, cfg) as s:
        b = s.app.state.batcher
        real_pick, real_segment = b._pick, b._segment
        calls = {"pick": 0, "segment": 0}

        def bad_pick():
            calls["pick"] += 1
            if calls["pick"] == 1:
                raise RuntimeError("injected planning bug")
            return real_pick()

        def bad_segment(rb):
            calls["segment"] += 1
            if calls["segment"] == 1:
                raise RuntimeError("injected device failure")
            return real_segment(rb)
        b._pick = bad_pick
        body = {"prompt": PROMPT, "max_tokens": 16}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)
        assert r.status_code in (500, 200)  # the queued job stays queued (planning failed before it was popped)
        b._segment = bad_segment
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 500 and "injected device failure" in r.text, r.text
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "0168"
        assert httpx.get(f"{s.url}/health").json() == {"status": "ok"}
        st = b.snapshot()
        assert st["scheduler_errors"] == 1 and st["failed"] >= 1 and b.alive()
        b.close()
        h = httpx.get(f"{s.url}/health")
        assert h.status_code == 503 and h.json()["status"] == "scheduler stopped"


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_watchdog_answers_a_stuck_batch_and_the_server_recovers(scheduler):
    """A batch / segment running past --watchdog: its request gets 504 at the bound (not when the
    segment returns), /metrics counts it, /health reports the scheduler stuck meanwhile; then the
    server serves again."""
    model, tok = demo()
    cfg = ServerConfig(model_name="demo", max_batch=4, scheduler=scheduler, watchdog_s=5.0)
    body = {"prompt": PROMPT, "max_tokens": 16}
    with InProcessServer(model, tok, cfg) as s:
        b = s.app.state.batcher
        assert httpx.post(f"{s.url}/v1/completions", json=body, timeout=300).status_code == 200  # compiled
        b.cfg.watchdog_s = 0.5
        name = "_decode" if scheduler == "static" else "_segment"
        real = getattr(b, name)
        stuck = {"n": 0}

        def slow(*a):
            stuck["n"] += 1
            if stuck["n"] == 1:
                time.sleep(3.0)
            return real(*a)
        setattr(b, name, slow)
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            t = time.perf_counter()
            fut = ex.submit(httpx.post, f"{s.url}/v1/completions", json=body, timeout=60)
            time.sleep(1.5)
            h = httpx.get(f"{s.url}/health")
            r = fut.result()
        assert r.status_code == 504 and "watchdog" in r.json()["error"]["message"], r.text
        assert time.perf_counter() - t < 2.9  # answered at the bound, before the segment returned
        assert h.status_code == 503 and "stuck" in h.json()["status"]
        assert "dinfer:watchdog_timeouts_total 1" in httpx.get(f"{s.url}/metrics").text
        time.sleep(2.0)
        ok = httpx.post(f"{s.url}/v1/completions", json=body, timeout=300)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "0168"
        assert httpx.get(f"{s.url}/health").json() == {"status": "ok"}


def test_a_new_length_compiles_without_delaying_warmed_lengths():
    """Continuous scheduler, max_tokens 16 warmed: while a request of a new length (a new program)
    waits for its compile, the compile runs on the compile thread, no steady request joins a batch
    that is still compiling, and steady clients go on being answered inside the compile's window."""
    model, tok = demo()
    cfg = ServerConfig(model_name="demo", max_batch=4, warmup=True, warmup_max_tokens=(16,), default_max_tokens=16)
    with InProcessServer(model, tok, cfg) as s:
        for _ in range(600):
            if httpx.get(f"{s.url}/health").status_code == 200:
                break
            time.sleep(0.1)
        steady = {"prompt": PROMPT, "max_tokens": 16}
        for _ in range(3):
            assert httpx.post(f"{s.url}/v1/completions", json=steady, timeout=120).status_code == 200
        batcher = s.app.state.batcher
        compiles = []  # (thread name, start, end) of each segment-program compile
        real_warm = batcher.gen.warm_segment_programs

        def recorded_warm(*a, **k):
            t0 = time.perf_counter()
            try:
                return real_warm(*a, **k)
            finally:
                compiles.append((threading.current_thread().name, t0, time.perf_counter()))
        batcher.gen.warm_segment_programs = recorded_warm
        placed = []  # (the job's gen_length, whether the batch it joined was still compiling)
        real_place = batcher._place

        def recorded_place(j, free, new_batches):
            rb = real_place(j, free, new_batches)
            if rb is not None:
                placed.append((j.params.gen_length, not batcher._book(rb).ready()))
            return rb
        batcher._place = recorded_place
        # Twice seen in full `-n 2` CI runs (never alone): the new length ran with no compile at all
        # (13 requests, 0 background compiles; cause not found). A second new length is tried then,
        # and both snapshots are printed if it happens again.
        tries = []
        for max_tokens in (40, 72):
            compiles.clear()
            answered, stop = [], []  # (start, end) of each steady request

            def client():
                while not stop:
                    t = time.perf_counter()
                    r = httpx.post(f"{s.url}/v1/completions", json=steady, timeout=120)
                    assert r.status_code == 200
                    answered.append((t, time.perf_counter()))
            with concurrent.futures.ThreadPoolExecutor(3) as ex:
                clients = [ex.submit(client) for _ in range(2)]
                time.sleep(0.5)
                r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "sort 5391=", "max_tokens": max_tokens,
                                                                  "block_length": 8}, timeout=300)
                stop.append(1)
                for c in clients:
                    c.result()
            assert r.status_code == 200
            tries.append((max_tokens, json.dumps(batcher.snapshot())))
            if compiles:  # it compiled something new
                break
        else:
            raise AssertionError(f"no new program was compiled: {tries}")
        assert all(name.startswith("dinfer-compile") for name, _, _ in compiles), compiles
        # no warmed-length job waits beside the new program's compile (its own programs are ready)
        assert not [p for p in placed if p[0] == 16 and p[1]], placed
        name, c0, c1 = max(compiles, key=lambda c: c[2] - c[1])
        inside = [a for a in answered if c0 <= a[0] and a[1] <= c1]
        # A scheduler blocked by the compile answers no steady request that starts and ends inside it.
        # (Their latency is not bounded here: XLA:CPU compiles and runs programs on the same few cores,
        # so on a loaded 2-core machine one run can wait most of a compile; the scheduler still
        # dispatches: every request inside the window was scheduled while the compile ran.)
        assert len(inside) >= 3, (c1 - c0, answered)


def test_no_unretrieved_exceptions_on_cancel_and_shutdown():
    """Clients leaving mid-stream, requests timing out in the queue and a shutdown with requests in
    flight leave no "exception was never retrieved" in asyncio's log."""
    records = []

    class Catch(logging.Handler):
        def emit(self, rec):
            records.append(rec.getMessage())
    h = Catch()
    logging.getLogger("asyncio").addHandler(h)
    try:
        model, tok = demo()
        cfg = ServerConfig(model_name="demo", max_batch=2, request_timeout_s=0.3)
        with InProcessServer(model, tok, cfg) as s:
            long = {"prompt": PROMPT, "max_tokens": 64, "strategy": "fixed", "ignore_eos": True}

            async def go():
                async with httpx.AsyncClient(timeout=30) as c:
                    async def stream_and_leave():
                        async with c.stream("POST", f"{s.url}/v1/completions", json={**long, "stream": True}) as r:
                            async for _ in r.aiter_lines():
                                break
                    await asyncio.gather(*(c.post(f"{s.url}/v1/completions", json=long) for _ in range(6)),
                                         stream_and_leave(), return_exceptions=True)
            asyncio.run(go())
            s.app.state.batcher.close()
        gc.collect()
    finally:
        logging.getLogger("asyncio").removeHandler(h)
    assert not [m for m in records if "never retrieved" in m], records


def test_atomic_folders_get_ordinary_permissions(tmp_path):
    import os
    import stat

    from dinfer_jax.atomic import atomic_folder
    old = os.umask(0o022)
    try:
        with atomic_folder(str(tmp_path / "out")) as tmp:
            open(os.path.join(tmp, "f"), "w").close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o755


def test_config_field_of_the_wrong_type_is_named(tmp_path):
    from dinfer_jax.config import ConfigError
    from dinfer_jax.families import from_hf_dict, to_hf_dict
    model, _ = demo()
    hf = {**to_hf_dict(model.config), "hidden_size": "big"}
    with pytest.raises(ConfigError, match="hidden_size='big' is not a valid value"):
        from_hf_dict(hf)
