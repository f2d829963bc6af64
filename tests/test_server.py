"""The OpenAI-compatible server: a real uvicorn server on 127.0.0.1 (free port), driven by the
official `openai` client and by raw HTTP for malformed requests.

The model is the tiny random LLaDA-MoE with a BPE tokenizer trained here on a few lines and a
chat template in tokenizer_config.json. Answers are checked against the engine called directly
(temperature 0: the server must return exactly the engine's tokens, alone or batched).
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

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
    from dinfer_jax.config import preset, to_hf_dict
    from dinfer_jax.model import load_model
    from dinfer_jax.models import init_params
    from dinfer_jax.server import ServerConfig, create_app
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
    ({"prompt": "x", "max_tokens": 8, "n": 3}, 400, "n=3"),
    ({"prompt": "x", "max_tokens": 8, "stop": ["\n"]}, 400, "stop sequences"),
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


def test_full_queue_answers_503(served):
    from fastapi.testclient import TestClient

    from dinfer_jax.server import ServerConfig, create_app
    _, model, tok, fmt, _ = served
    app = create_app(model, tok, ServerConfig(model_name="tiny", max_queue=0), fmt)
    r = TestClient(app).post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
    assert r.status_code == 503 and "queue is full" in r.json()["error"]["message"]
    app.state.batcher.close()
