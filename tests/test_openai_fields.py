"""OpenAI / vLLM request fields on `dinfer-jax serve` (the shipped demo model, both schedulers):
`stop` (text cut before the stop string, ids through the token that completed it, finish "stop";
the continuous scheduler ends the row as soon as the string is committed: fewer forwards) and `n`
(n choices per prompt, prompt-major, seed + k each, every choice equal to the same request sent
alone with that seed); the stop-string helpers against hand-made cases."""
from __future__ import annotations

import json

import pytest

from dinfer_jax.stop_strings import check_stop, find_stop, held_back, ids_through


@pytest.mark.smoke
def test_stop_string_helpers():
    assert check_stop(None) == () and check_stop("ab") == ("ab",) and check_stop(["a", "b", "a"]) == ("a", "b")
    for bad, msg in ((["a"] * 5, "at most 4"), ([""], "non-empty"), ([3], "non-empty"), (["x" * 300], "256")):
        with pytest.raises(ValueError, match=msg):
            check_stop(bad)
    assert find_stop("hello world", ("o w", "wor")) == (4, 7)
    assert find_stop("hello", ("xyz",)) is None
    assert find_stop("abcd", ("bc", "bcd")) == (1, 4)  # the longest at the earliest start
    assert held_back("the en", ("end",)) == 2 and held_back("the e", ("end", "e.")) == 1
    assert held_back("abc", ("xyz",)) == 0 and held_back("ab", ("ab",)) == 0  # a whole match is found, not held
    toks = ["a", "bc", "d", "ef"]

    def dec(ids):
        return "".join(toks[i] for i in ids)
    assert [ids_through([0, 1, 2, 3], dec, e) for e in (1, 2, 3, 4, 5, 6)] == [1, 2, 2, 3, 4, 4]


pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from bench.serve_load import InProcessServer  # noqa: E402
from demo_helpers import demo  # noqa: E402

from dinfer_jax.server import ServerConfig  # noqa: E402

PROMPT = "add 123+045="  # the demo model answers 0168


@pytest.fixture(scope="module", params=["static", "continuous"])
def server(request):
    from dinfer_jax.chat import ChatFormatter
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    model, tok = demo()
    cfg = ServerConfig(model_name="demo", max_batch=8, scheduler=request.param, max_tokens=64)
    with InProcessServer(model, tok, cfg, ChatFormatter(DEMO_MODEL_DIR, model.config.family)) as s:
        yield s, request.param, tok


def _post(s, body, path="/v1/completions"):
    r = httpx.post(f"{s.url}{path}", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_cuts_text_ids_and_finish_reason(server):
    s, sched, tok = server
    base = {"prompt": PROMPT, "max_tokens": 64, "block_length": 8, "ignore_eos": True}
    full = _post(s, base)["choices"][0]
    text = full["text"]
    assert "6" in text[:4], text  # the demo model's answer starts 016
    got = _post(s, {**base, "stop": ["6", "zz"]})["choices"][0]
    cut = text.index("6")
    assert got["text"] == text[:cut] and got["finish_reason"] == "stop"
    # the demo tokenizer has one character per token: the ids run through the "6"
    assert got["token_ids"] == full["token_ids"][:cut + 1] and tok.decode(got["token_ids"]) == text[:cut + 1]
    # a stop string that never appears changes nothing
    same = _post(s, {**base, "stop": "@@"})["choices"][0]
    assert same["text"] == text and same["finish_reason"] == "length"
    if sched == "continuous":  # the row ended once "6" was committed (first block), not after 8 blocks
        assert got["nfe"] < full["nfe"], (got["nfe"], full["nfe"])
        assert httpx.get(f"{s.url}/stats").json()["stopped_early"] >= 1
    # streamed: the chunks add up to the cut text; none reaches past the stop string
    stop = text[cut:cut + 2]
    chunks, finish = [], None
    with httpx.stream("POST", f"{s.url}/v1/completions", json={**base, "stop": stop, "stream": True},
                      timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                chunks.append(ch["text"])
                finish = ch["finish_reason"] or finish
    assert "".join(chunks) == text[:text.index(stop)] and finish == "stop", chunks
    # chat: the same cut on the message content
    chat = _post(s, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "stop": "8"},
                 "/v1/chat/completions")
    plain = _post(s, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}, "/v1/chat/completions")
    want = plain["choices"][0]["message"]["content"]
    if "8" in want:
        assert chat["choices"][0]["message"]["content"] == want[:want.index("8")]
        assert chat["choices"][0]["finish_reason"] == "stop"
    else:
        assert chat["choices"][0]["message"]["content"] == want


def test_n_choices_with_their_own_seeds(server):
    s, sched, tok = server
    greedy = _post(s, {"prompt": [PROMPT, "sort 5391="], "max_tokens": 16, "n": 3})
    ch = greedy["choices"]
    assert [c["index"] for c in ch] == list(range(6))
    assert len({c["text"] for c in ch[:3]}) == 1 and len({c["text"] for c in ch[3:]}) == 1  # temperature 0
    assert ch[0]["text"] == "0168"
    assert greedy["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in ch)
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 20.0, "seed": 7}
    sampled = _post(s, {**body, "n": 4})["choices"]
    assert [c["seed"] for c in sampled] == [7, 8, 9, 10]
    for c in sampled:  # each choice is the request alone with its seed
        alone = _post(s, {**body, "seed": c["seed"]})["choices"][0]
        assert alone["token_ids"] == c["token_ids"]
    assert len({tuple(c["token_ids"]) for c in sampled}) > 1, "4 samples at temperature 20 all equal"
    chat = _post(s, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "n": 2},
                 "/v1/chat/completions")
    assert [c["index"] for c in chat["choices"]] == [0, 1]


def test_openai_client_gets_n_and_stop(server):
    openai = pytest.importorskip("openai")
    s, sched, tok = server
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none")
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=16, n=2, stop=["8"])
    assert [c.text for c in r.choices] == ["016", "016"] and {c.finish_reason for c in r.choices} == {"stop"}
    c = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPT}], max_tokens=16, n=2)
    assert len(c.choices) == 2 and c.choices[0].message.content == c.choices[1].message.content
