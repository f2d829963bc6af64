"""The OpenAI-compatible server: a real uvicorn server on 127.0.0.1 (free port), driven by the
official `openai` client and by raw HTTP for malformed requests.

The model is the tiny random LLaDA-MoE with a BPE tokenizer trained here on a few lines and a
chat template in tokenizer_config.json. Answers are checked against the engine called directly
(temperature 0: the server must return exactly the engine's tokens, alone or batched).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
import time
import types

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dinfer_jax.engine import SamplingParams  # noqa: E402

LINES = ["the cat sat on the mat", "a dog ran in the park", "diffusion models unmask tokens in parallel",
         "jax compiles the whole loop", "hello world, hello jax"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
BASE = dict(max_tokens=16, extra_body={"block_length": 8, "threshold": 0.5})
PARAMS = SamplingParams(gen_length=16, block_length=8, threshold=0.5)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base_url, model, tokenizer, formatter, app) with a uvicorn server running in a thread."""
    import uvicorn
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax.chat import ChatFormatter
    from dinfer_jax.families import preset, to_hf_dict
    from dinfer_jax.model import load_model
    from dinfer_jax.models import init_params
    from dinfer_jax.serving.scheduler import ServerConfig
    from dinfer_jax.serving.http import create_app
    from dinfer_jax.tokenizer import load_tokenizer

    folder = str(tmp_path_factory.mktemp("served") / "model")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|mdm_mask|>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok.train_from_iterator(LINES * 4, trainers.BpeTrainer(vocab_size=120, special_tokens=specials,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = preset("tiny").replace(vocab_size=max(128, tok.get_vocab_size()), eos_token_id=0, pad_token_id=0,
                                 mask_token_id=1)
    ckpt.save_params(folder, init_params(cfg, seed=11), to_hf_dict(cfg))
    tok.save(f"{folder}/tokenizer.json")
    with open(f"{folder}/tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": TEMPLATE}, f)
    model = load_model(folder)
    tokenizer = load_tokenizer(folder)
    fmt = ChatFormatter(folder, model.config.family)
    app = create_app(model, tokenizer, ServerConfig(model_name="tiny", max_tokens=64, max_batch=16,
                                                    batch_wait_s=0.02), fmt)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}", model, tokenizer, fmt, app
    server.should_exit = True
    th.join(timeout=10)


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _direct(model, ids, params=PARAMS):
    r = model.generator.generate([np.asarray(ids, np.int32)], params)
    return r.token_ids[0]


def test_health_models(served):
    url, *_ = served
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    ids = [m.id for m in _client(url).models.list().data]
    assert ids == ["tiny"]


def test_completion_equals_engine(served):
    url, model, tok, *_ = served
    r = _client(url).completions.create(model="tiny", prompt="the cat sat", **BASE)
    want = _direct(model, tok.encode("the cat sat"))
    assert r.choices[0].text == tok.decode(want)
    assert r.model_extra is not None or True
    raw = r.choices[0].model_dump()
    assert raw["token_ids"] == want
    assert r.usage.prompt_tokens == len(tok.encode("the cat sat")) and r.usage.completion_tokens == len(want)


def test_chat_uses_the_folder_template(served):
    url, model, tok, fmt, _ = served
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello jax"}]
    text = fmt(msgs)
    assert text == "<|system|>be brief<|endoftext|><|user|>hello jax<|endoftext|><|assistant|>"
    r = _client(url).chat.completions.create(model="tiny", messages=msgs, **BASE)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(_direct(model, tok.encode(text)))


def test_streaming_sends_blocks_as_they_finish(served):
    url, model, tok, *_ = served
    params = dict(max_tokens=32, extra_body={"block_length": 8, "threshold": 0.5})
    chunks = list(_client(url).completions.create(model="tiny", prompt="a dog", stream=True, **params))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    want = tok.decode(_direct(model, tok.encode("a dog"), SamplingParams(gen_length=32, block_length=8, threshold=0.5)))
    assert "".join(texts) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # one delta per decoded block at most: the 4 blocks arrive as separate events (before the end)
    print("stream deltas:", texts)
    assert 2 <= len(texts) <= 4, texts  # the prompt is chosen so this model writes past its first block


def test_chat_streaming(served):
    url, model, tok, fmt, _ = served
    msgs = [{"role": "user", "content": "the park"}]
    chunks = list(_client(url).chat.completions.create(model="tiny", messages=msgs, stream=True, **BASE))
    assert chunks[0].choices[0].delta.role == "assistant"
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == tok.decode(_direct(model, tok.encode(fmt(msgs))))


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    ({"prompt": "x", "max_tokens": 8, "frobnicate": 1}, 400, "unknown parameter 'frobnicate'"),
    ({"max_tokens": 8}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 10_000}, 400, "exceeds this server's limit of 64"),
    ({"prompt": "x", "max_tokens": 8, "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 8, "strategy": "beam"}, 400, "strategy"),
    ({"prompt": "x", "max_tokens": 8, "n": 0}, 400, "n=0: must be in [1, 128]"),
    ({"prompt": "x", "max_tokens": 8, "n": 2, "stream": True}, 400, "a stream carries one choice"),
    ({"prompt": "x", "max_tokens": 8, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ({"prompt": "x", "max_tokens": 8, "stop": ""}, 400, "non-empty"),
    ({"prompt": ["a", "b"], "max_tokens": 8, "stream": True}, 400, "one prompt"),
    ({"prompt": [1, 2, 100000], "max_tokens": 8}, 400, "out of range"),
    ({"prompt": "x", "max_tokens": 8, "model": "gpt-4"}, 404, "not served here"),
    ({"prompt": "x" * 600, "max_tokens": 8}, 400, "maximum length"),
])
def test_malformed_requests_get_4xx_with_a_message(served, body, status, needle):
    url, *_ = served
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}/v1/completions", **kw)
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert needle in msg, msg
    assert "Traceback" not in r.text


def test_chat_bad_messages(served):
    url, *_ = served
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/nothing").status_code == 404


def test_hundred_concurrent_requests_are_batched_and_all_correct(served):
    """100 concurrent requests with different prompts, thresholds and seeds: every answer equals
    the engine's for that prompt alone, and the batcher ran far fewer than 100 batches."""
    url, model, tok, _, app = served
    before = httpx.get(f"{url}/stats").json()
    rng = np.random.RandomState(0)
    prompts = [" ".join(rng.choice(LINES[i % len(LINES)].split(), 3)) for i in range(100)]
    taus = [0.5 if i % 2 else 0.7 for i in range(100)]

    async def go():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        reqs = [client.completions.create(model="tiny", prompt=p, max_tokens=16,
                                          extra_body={"block_length": 8, "threshold": t})
                for p, t in zip(prompts, taus)]
        out = await asyncio.gather(*reqs)
        await client.close()
        return out

    results = asyncio.run(go())
    want = model.generator.generate([np.asarray(tok.encode(p), np.int32) for p in prompts],
                                    [SamplingParams(gen_length=16, block_length=8, threshold=t) for t in taus])
    for i, r in enumerate(results):
        assert r.choices[0].model_dump()["token_ids"] == want.token_ids[i], i
    after = httpx.get(f"{url}/stats").json()
    batches = after["batches"] - before["batches"]
    assert after["completed"] - before["completed"] == 100
    print("batcher:", batches, "batches for 100 requests;", after["batch_sizes"])
    assert batches < 50 and after["max_batch_size"] > 1, after


class _HeldGenerator:
    """Stands in for model.generator: records each batch's prompts and holds it until `go` is set
    (a deterministic busy engine; no sleeps decide the outcome)."""

    def __init__(self, config):
        from dinfer_jax.program_cache import ProgramCache
        self.model = types.SimpleNamespace(config=config)
        self.calls, self.go, self.busy = [], threading.Event(), threading.Event()
        self.programs = ProgramCache(2)  # one "program" per call (generate): a bound warmup exceeds
        self.movers = ProgramCache(2)

    def generate(self, prompts, params, observer=None, templates=None):
        self.calls.append([[int(t) for t in p] for p in prompts])
        self.programs.get(len(self.calls), object)
        self.busy.set()
        assert self.go.wait(60)
        p = params[0] if isinstance(params, (list, tuple)) else params
        n = len(prompts)
        return types.SimpleNamespace(raw_ids=np.full((n, p.gen_length), 7, np.int32), nfe=[1] * n, tpf=[1.0] * n,
                                     commit_steps=np.zeros((n, p.gen_length), np.int32), token_logprobs=None,
                                     top_logprobs=None, steps_per_block=np.ones((n, 1), np.int32))


def _held_app(model, tok, **kw):
    from dinfer_jax.serving.scheduler import ServerConfig
    from dinfer_jax.serving.http import create_app
    gen = _HeldGenerator(model.config)
    fake = types.SimpleNamespace(config=model.config, generator=gen)
    app = create_app(fake, tok, ServerConfig(model_name="tiny", batch_wait_s=0.0, scheduler="static", **kw))
    return app, gen


def _asgi(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


async def _until(pred, what="condition"):
    for _ in range(600):
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _wait(pred, what="condition"):
    asyncio.run(_until(pred, what))


def test_request_is_admitted_whole_or_not(served):
    """A multi-prompt request larger than the queue can never fit: 400 naming `prompt`; one that
    does not fit now: 503; neither leaves prompts behind in the queue."""
    _, model, tok, *_ = served
    app, gen = _held_app(model, tok, max_queue=2)
    b = app.state.batcher
    url = "/v1/completions"

    async def go():
        async with _asgi(app) as c:
            first = asyncio.create_task(c.post(url, json={"prompt": "the cat", "max_tokens": 8}))
            await _until(gen.busy.is_set, "the first batch")
            second = asyncio.create_task(c.post(url, json={"prompt": "a dog", "max_tokens": 8}))
            await _until(lambda: b.snapshot()["queue_depth"] == 1, "the second request queued")
            later = await c.post(url, json={"prompt": ["jax", "hello"], "max_tokens": 8})
            never = await c.post(url, json={"prompt": ["jax", "hello", "world"], "max_tokens": 8})
            depth = b.snapshot()["queue_depth"]
            gen.go.set()
            return later, never, depth, await first, await second

    later, never, depth, r1, r2 = asyncio.run(go())
    assert later.status_code == 503 and "queue is full" in later.json()["error"]["message"], later.text
    assert never.status_code == 400, never.text
    assert never.json()["error"]["param"] == "prompt" and "3 prompts" in never.json()["error"]["message"]
    assert depth == 1  # no orphans
    assert r1.status_code == r2.status_code == 200
    assert gen.calls == [[tok.encode("the cat")], [tok.encode("a dog")]]  # jax / hello / world never decoded
    b.close()


def test_deadline_answers_504_and_drops_the_queued_request(served):
    """At the deadline: 504; the expired queued job frees its queue slot (a later request is
    admitted, not 503) and is never decoded."""
    _, model, tok, *_ = served
    app, gen = _held_app(model, tok, request_timeout_s=0.5, max_queue=1)
    b = app.state.batcher

    async def go():
        async with _asgi(app) as c:
            first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 8}))
            await _until(gen.busy.is_set, "the first batch")
            second = await c.post("/v1/completions", json={"prompt": "a dog", "max_tokens": 8})
            third = asyncio.create_task(c.post("/v1/completions", json={"prompt": "jax", "max_tokens": 8}))
            await _until(lambda: b.snapshot()["requests"] == 3, "the third request admitted")
            return await first, second, await third

    r1, r2, r3 = asyncio.run(go())
    for r in (r1, r2, r3):
        assert r.status_code == 504 and "timed out after 0.5s" in r.json()["error"]["message"], r.text
    s = b.snapshot()
    assert s["rejected_queue_full"] == 0 and s["cancelled"] == 1  # the second left the queue for the third
    gen.go.set()  # the running batch (not interruptible) ends; the expired queued ones never start
    _wait(lambda: b.snapshot()["cancelled"] == 2 and b.snapshot()["running_rows"] == 0, "the drop")
    assert gen.calls == [[tok.encode("the cat")]]
    b.close()


def _start(app):
    """A uvicorn server for `app` in a thread -> (url, server, thread)."""
    from dinfer_jax.serving.http import make_server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = make_server(app, "127.0.0.1", port, log_level="warning")
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    _wait(lambda: server.started, "uvicorn")
    return f"http://127.0.0.1:{port}", server, th


def test_clients_that_leave_free_their_slots(served):
    _, model, tok, *_ = served
    app, gen = _held_app(model, tok)
    b = app.state.batcher
    url, server, th = _start(app)
    out = []
    t1 = threading.Thread(target=lambda: out.append(httpx.post(f"{url}/v1/completions", timeout=60,
                                                               json={"prompt": "the cat", "max_tokens": 8})))
    t1.start()
    _wait(gen.busy.is_set, "the first batch")
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"prompt": "a dog", "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200
        _wait(lambda: b.snapshot()["queue_depth"] == 1, "the stream queued")
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(f"{url}/v1/completions", timeout=1.0, json={"prompt": "jax", "max_tokens": 8})
    # the clients are gone: their queued jobs are marked cancelled and dropped
    _wait(lambda: all(j.cancelled for j in list(b.pending)), "the cancel")
    gen.go.set()
    t1.join(60)
    assert out and out[0].status_code == 200
    _wait(lambda: b.snapshot()["cancelled"] == 2, "the drop")
    assert gen.calls == [[tok.encode("the cat")]]
    server.should_exit = True
    th.join(10)


def test_sigterm_drains_then_exits(served):
    """SIGTERM (uvicorn's handle_exit): new requests and /health get 503, the in-flight request
    still completes, and the server thread exits."""
    import signal
    _, model, tok, *_ = served
    app, gen = _held_app(model, tok)
    url, server, th = _start(app)
    out = []
    t1 = threading.Thread(target=lambda: out.append(httpx.post(f"{url}/v1/completions", timeout=60,
                                                               json={"prompt": "the cat", "max_tokens": 8})))
    t1.start()
    _wait(gen.busy.is_set, "the in-flight batch")
    server.handle_exit(signal.SIGTERM, None)
    assert app.state.batcher.draining

    async def late():
        async with _asgi(app) as c:
            return await c.post("/v1/completions", json={"prompt": "a dog", "max_tokens": 8}), await c.get("/health")

    r, health = asyncio.run(late())
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert health.status_code == 503 and health.json() == {"status": "shutting down"}
    gen.go.set()
    t1.join(60)
    assert out and out[0].status_code == 200 and out[0].json()["choices"][0]["token_ids"] == [7] * 8
    th.join(30)
    assert not th.is_alive()


def test_warmup_then_ready(served):
    """--warmup compiles every batch bucket (streaming and not) before traffic: until then /health
    and requests answer 503."""
    _, model, tok, *_ = served
    app, gen = _held_app(model, tok, warmup=True, max_batch=3, default_max_tokens=8)

    async def go(ready):
        async with _asgi(app) as c:
            if ready:
                await _until(app.state.batcher.ready.is_set, "warmup")
            return await c.get("/health"), await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})

    health, r = asyncio.run(go(False))
    assert health.status_code == 503 and health.json() == {"status": "warming up"}
    assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]
    gen.go.set()
    health, r = asyncio.run(go(True))
    assert health.json() == {"status": "ok"} and r.status_code == 200
    assert [len(c) for c in gen.calls[:6]] == [1, 1, 2, 2, 4, 4]  # batch buckets 1, 2, 4 (>= max_batch 3)
    snap = app.state.batcher.snapshot()
    assert snap["warmup_programs"] == 6
    # warmup keeps what it compiled: the cache's bound (2 here) grew to 6 + headroom, nothing evicted
    assert snap["programs_evicted"] == 0 and gen.programs.max_programs == 6 + 16, snap
    app.state.batcher.close()


@pytest.mark.parametrize("body,param", [
    ({"strategy": "fixed", "steps": 1_000_000_000}, "steps"),
    ({"max_post_steps": 1000}, "max_post_steps"),
    ({"max_tokens": 1_000_000_000}, "max_tokens"),
    ({"min_tokens": 99}, "min_tokens"),
])
def test_work_knobs_are_bounded(served, body, param):
    url, *_ = served
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={"prompt": "x", "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


@pytest.mark.parametrize("flags,needle", [
    (["--port", "70000"], "port 70000 is outside 1..65535"),
    (["--port", "0"], "port 0 is outside 1..65535"),
    (["--request-timeout", "-1"], "expected a finite number >= 0"),
    (["--steps", "2000"], "--steps 2000 exceeds --max-steps 1024"),
    (["--max-post-steps", "100"], "--max-post-steps 100 exceeds --max-post-steps-limit 64"),
    (["--default-max-tokens", "64", "--max-tokens", "32"], "--default-max-tokens 64 exceeds --max-tokens 32"),
])
def test_serve_rejects_bad_flags(capsys, flags, needle):
    from dinfer_jax.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", *flags])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_sampling_without_seed_gets_a_fresh_reported_seed(served):
    """temperature > 0 and no seed: each prompt draws its own seed (identical prompts in one request
    differ), reported back; decoding with the reported seed reproduces the answer."""
    url, model, tok, *_ = served
    body = {"prompt": ["the cat", "the cat"], "max_tokens": 16, "block_length": 8, "threshold": 0.5,
            "temperature": 2.0}
    a = httpx.post(f"{url}/v1/completions", timeout=300, json=body).json()["choices"]
    b = httpx.post(f"{url}/v1/completions", timeout=300, json=body).json()["choices"]
    seeds = [c["seed"] for c in a + b]
    assert len(set(seeds)) == 4, seeds
    ids = tok.encode("the cat")
    for c in a + b:
        sp = SamplingParams(gen_length=16, block_length=8, threshold=0.5, temperature=2.0, seed=c["seed"])
        assert c["token_ids"] == _direct(model, ids, sp)
    assert len({tuple(c["token_ids"]) for c in a + b}) > 1
    fixed = [httpx.post(f"{url}/v1/completions", timeout=300, json={**body, "seed": 7}).json()["choices"] for _ in range(2)]
    assert [c["seed"] for c in fixed[0]] == [7, 7] and fixed[0] == fixed[1]


def test_ignore_eos_and_min_tokens_fields(served):
    url, model, tok, *_ = served
    ids = tok.encode("hello world")
    for extra, sp in (({"ignore_eos": True}, dict(ignore_eos=True)), ({"min_tokens": 12}, dict(min_tokens=12))):
        r = httpx.post(f"{url}/v1/completions", timeout=300, json={"prompt": "hello world", "max_tokens": 16, "block_length": 8,
                                                      "threshold": 0.5, **extra}).json()["choices"][0]
        want = _direct(model, ids, SamplingParams(gen_length=16, block_length=8, threshold=0.5, **sp))
        assert r["token_ids"] == want
        if "ignore_eos" in extra:
            assert len(r["token_ids"]) == 16 and r["finish_reason"] == "length"
        else:
            assert len(r["token_ids"]) >= 12


def test_metrics_are_prometheus_text(served):
    url, *_ = served
    httpx.post(f"{url}/v1/completions", timeout=300, json={"prompt": "the cat", "max_tokens": 8, "ignore_eos": True})
    r = httpx.get(f"{url}/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for line in r.text.splitlines():
        if not line.startswith("#"):
            name, v = line.split()
            values[name] = float(v)
    assert values["dinfer:queue_depth"] == 0 and values["dinfer:running_rows"] == 0
    assert values["dinfer:generated_tokens_total"] >= 8 and values["dinfer:tokens_per_second"] > 0
    assert "dinfer:compile_cache_hits_total" in values and values["dinfer:ready"] == 1
    assert "# TYPE dinfer:generated_tokens_total counter" in r.text


def _metric_values(url) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if not line.startswith("#")}


def test_request_histograms_count_each_answer(served):
    """One answered request moves every request histogram by one observation: its forwards and
    tokens per forward as the response reports them, latencies ordered queue <= first token <= E2E;
    buckets are cumulative and end at the count."""
    url, *_ = served
    before = _metric_values(url)
    r = httpx.post(f"{url}/v1/completions", timeout=300,
                   json={"prompt": "the cat", "max_tokens": 8, "ignore_eos": True, "stream": False}).json()
    after = _metric_values(url)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    c = r["choices"][0]
    for h in ("request_queue_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds",
              "tokens_per_forward", "forwards_per_request"):
        assert d[f"dinfer:{h}_count"] == 1, h
        assert d[f'dinfer:{h}_bucket{{le="+Inf"}}'] == 1, h
        buckets = [v for k, v in after.items() if k.startswith(f"dinfer:{h}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == after[f"dinfer:{h}_count"], h
    assert d["dinfer:forwards_per_request_sum"] == c["nfe"] and r["usage"]["nfe"] == c["nfe"]
    assert d["dinfer:tokens_per_forward_sum"] == pytest.approx(c["tpf"], abs=1e-4)
    q, f, e = (d[f"dinfer:{h}_sum"] for h in ("request_queue_time_seconds", "time_to_first_token_seconds",
                                                "e2e_request_latency_seconds"))
    assert 0 <= q <= f <= e < 300
    assert d["dinfer:blocks_total"] >= 1 and 0 <= d["dinfer:blocks_at_cap_total"] <= d["dinfer:blocks_total"]
    assert d["dinfer:batch_occupancy_count"] >= 1


def test_grafana_dashboard_reads_served_metrics(served):
    """Every metric the dashboard (docs/grafana/dinfer-jax.json) queries is exported, or is one of
    the scheduler- / model-dependent ones docs/metrics.md lists as conditional."""
    import json
    import pathlib
    import re
    url, *_ = served
    root = pathlib.Path(__file__).resolve().parents[1]
    dash = json.loads((root / "docs/grafana/dinfer-jax.json").read_text())
    wanted = {re.sub(r"_(bucket|sum|count)$", "", m) for p in dash["panels"] for t in p["targets"]
              for m in re.findall(r"dinfer:[a-z0-9_]+", t["expr"])}
    raw = {k.split("{")[0] for k in _metric_values(url)}
    bases = {re.sub(r"_(bucket|sum|count)$", "", k) for k in raw}  # histograms by their name
    exported = raw | bases
    conditional = {"dinfer:prefix_cache_hit_rate", "dinfer:background_compiles_total"}
    doc = (root / "docs/metrics.md").read_text()
    assert wanted - exported <= conditional, wanted - exported - conditional
    for m in wanted | bases:
        assert f"`{m}`" in doc, f"{m} is not in docs/metrics.md"


def test_serve_process_warmup_then_sigterm_exits_cleanly(tmp_path):
    """`dinfer-jax serve --warmup` (demo model) in its own process: ready after warmup, answers,
    exports /metrics, and on SIGTERM finishes and exits 0."""
    import os
    import signal
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(tmp_path / "serve.log", "w+")
    p = subprocess.Popen([sys.executable, "-m", "dinfer_jax.cli", "serve", "--port", str(port), "--warmup",
                          "--max-batch", "1", "--compile-cache", str(tmp_path / "cc"), "--log-level", "warning"],
                         stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        ready = None
        for _ in range(1200):
            assert p.poll() is None, open(tmp_path / "serve.log").read()
            try:
                ready = httpx.get(f"{url}/health", timeout=5)
                if ready.status_code == 200:
                    break
                assert ready.json() == {"status": "warming up"}
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert ready is not None and ready.json() == {"status": "ok"}
        assert "dinfer:ready 1" in httpx.get(f"{url}/metrics", timeout=10).text
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "add 123+045="}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "0168"
        stats = httpx.get(f"{url}/stats", timeout=10).json()
        assert stats["warmup_programs"] >= 1 and stats["warmup_error"] is None, stats
        assert os.listdir(tmp_path / "cc")  # the warmed programs went to the on-disk compile cache
        # SIGTERM with a request in flight (a new length: it compiles, then decodes 96 tokens): the
        # process keeps listening, new requests and /health get 503, the in-flight one is answered.
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            long = ex.submit(httpx.post, f"{url}/v1/completions", timeout=300,
                             json={"prompt": "add 123+045=", "max_tokens": 96, "ignore_eos": True})
            for _ in range(600):
                if httpx.get(f"{url}/stats", timeout=10).json()["requests"] >= 2:
                    break
                time.sleep(0.05)
            p.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert not long.done(), "the in-flight request finished before SIGTERM: the test needs a longer one"
            late = httpx.post(f"{url}/v1/completions", json={"prompt": "add 1+2="}, timeout=30)
            assert late.status_code == 503, late.text
            assert httpx.get(f"{url}/health", timeout=10).status_code == 503
            assert long.result().status_code == 200 and len(long.result().json()["choices"][0]["token_ids"]) == 96
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_continuous_scheduler_drops_cancelled_jobs_and_reports_seed(served):
    """The continuous scheduler (default) never starts a cancelled queued job; answers carry the seed."""
    from dinfer_jax.serving.continuous import ContinuousBatcher
    from dinfer_jax.serving.scheduler import Job, ServerConfig
    _, model, tok, *_ = served
    b = ContinuousBatcher(model.generator, tok, ServerConfig(model_name="tiny", max_batch=4), segment=8)
    spec = PARAMS.spec(model.config.mask_token_id, model.config.eos_id)

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [Job(tok.encode(p), PARAMS, 16, loop, loop.create_future(), spec) for p in ("the cat", "a dog")]
        jobs[0].cancelled = True
        b.submit_all(jobs)
        ok = await asyncio.wait_for(jobs[1].future, 300)
        await _until(jobs[0].future.done, "the drop")
        return jobs[0].future, ok

    dropped, ok = asyncio.run(go())
    assert dropped.cancelled()  # nobody waits for a cancelled job: its future is cancelled, not failed
    assert ok["token_ids"] == _direct(model, tok.encode("a dog")) and ok["seed"] == PARAMS.seed
    s = b.snapshot()
    assert s["cancelled"] == 1 and s["admitted"] == 1 and s["generated_tokens"] == len(ok["token_ids"])
    b.close()
