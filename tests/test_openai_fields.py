"""OpenAI / vLLM request fields on `dinfer-jax serve` (the shipped demo model, both schedulers):
`stop` (text cut before the stop string, ids through the token that completed it, finish "stop";
the continuous scheduler ends the row as soon as the string is committed: fewer forwards) and `n`
(n choices per prompt, prompt-major, seed + k each, every choice equal to the same request sent
alone with that seed); the stop-string helpers against hand-made cases; `stream_canvas` (the
provisional canvas in streamed chunks, docs/openai_fields.md)."""
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

from dinfer_jax.serving.scheduler import ServerConfig  # noqa: E402

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


def _records_body(**kw):
    return {"prompt": PROMPT, "max_tokens": 16, "block_length": 8, "ignore_eos": True, **kw}


def _engine_answer(s, body, logprobs):
    """What the library decodes for the same request (tested against the host-loop reference in
    tests/test_engine.py): the server's derived SamplingParams, generate() on the prompt alone."""
    from dinfer_jax.engine import generate
    from dinfer_jax.serving.scheduler import derive_params
    model, tok = demo()
    keys = ("block_length", "ignore_eos")
    p = derive_params(ServerConfig(model_name="demo").default_params,
                      {**{k: body[k] for k in keys}, "logprobs": logprobs}, body["max_tokens"], model.config)
    return generate(model, [tok.encode(body["prompt"])], p)


def test_completion_logprobs_and_step_map(server):
    s, sched, tok = server
    body = _records_body(logprobs=3, return_step_map=True)
    c = _post(s, body)["choices"][0]
    ref = _engine_answer(s, body, 3)
    n = len(c["token_ids"])
    assert c["token_ids"] == ref.token_ids[0][:n] and n == 16
    lp = c["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in c["token_ids"]] and "".join(lp["tokens"]) == c["text"]
    # batch of the server (up to 8 rows) vs 1 row: the same forwards up to fp32 rounding (test_segments.py)
    assert lp["token_logprobs"] == pytest.approx(ref.token_logprobs[0][:n], abs=1e-4)
    assert c["commit_steps"] == ref.commit_steps[0][:n]
    assert c["commit_steps"][:8] != list(range(8)) or c["commit_steps"][8:] != list(range(8, 16))  # not trivial
    assert lp["text_offset"] == list(range(n))  # one character per demo token
    for top, want, got in zip(lp["top_logprobs"], ref.top_logprobs[0], lp["token_logprobs"]):
        assert list(top) == [tok.decode([t], skip_special_tokens=False) for t, _ in want] and len(top) == 3
        assert list(top.values()) == pytest.approx([v for _, v in want], abs=1e-4)
        assert max(top.values()) >= got - 1e-6 and all(v <= 0 for v in top.values())
    # logprobs 0: the tokens' own logprobs, no alternatives; no step map unless asked
    c0 = _post(s, _records_body(logprobs=0))["choices"][0]
    assert c0["token_ids"] == c["token_ids"] and "commit_steps" not in c0
    assert c0["logprobs"]["top_logprobs"] == [{}] * n
    assert c0["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    # streamed: each chunk carries the logprobs / steps of the tokens it sends; together the whole answer
    toks, lps, steps, text = [], [], [], ""
    with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                if ch["finish_reason"] is not None:
                    continue
                assert "".join(ch["logprobs"]["tokens"]) == ch["text"]
                assert ch["logprobs"]["text_offset"] == list(range(len(text), len(text) + len(ch["text"])))
                text += ch["text"]
                toks += ch["logprobs"]["tokens"]
                lps += ch["logprobs"]["token_logprobs"]
                steps += ch["commit_steps"]
    assert text == c["text"] and toks == lp["tokens"] and steps == c["commit_steps"]
    assert lps == pytest.approx(lp["token_logprobs"], abs=1e-4)
    # echo (without logprobs): the prompt's text comes first
    e = _post(s, _records_body(echo=True))["choices"][0]
    assert e["text"] == PROMPT + c["text"] and e["logprobs"] is None


def test_chat_logprobs(server):
    s, sched, tok = server
    msgs = [{"role": "user", "content": PROMPT}]
    body = {"messages": msgs, "max_tokens": 16, "block_length": 8, "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
            "return_step_map": True}
    c = _post(s, body, "/v1/chat/completions")["choices"][0]
    content = c["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == c["message"]["content"] and content
    assert len(c["commit_steps"]) == len(content) and min(c["commit_steps"]) >= 0
    for e in content:
        assert e["bytes"] == list(e["token"].encode()) and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        assert e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6
    plain = _post(s, {**body, "logprobs": False, "top_logprobs": None, "return_step_map": False},
                  "/v1/chat/completions")["choices"][0]
    assert plain["logprobs"] is None and "commit_steps" not in plain
    assert plain["message"]["content"] == c["message"]["content"]
    got, text = [], ""
    with httpx.stream("POST", f"{s.url}/v1/chat/completions", json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and "choices" in line:
                chs = json.loads(line[6:])["choices"]
                if chs and chs[0]["delta"].get("content") and "logprobs" in chs[0]:
                    got += chs[0]["logprobs"]["content"]
                    text += chs[0]["delta"]["content"]
    assert text == c["message"]["content"] and [e["token"] for e in got] == [e["token"] for e in content]
    assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in content], abs=1e-4)


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 2, "echo": True}, "echo"),
    ("/v1/completions", {"return_step_map": "yes"}, "return_step_map"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 5}, "logprobs"),
])
def test_logprobs_refusals(server, path, extra, param):
    s, sched, tok = server
    body = ({"prompt": PROMPT} if "chat" not in path else {"messages": [{"role": "user", "content": PROMPT}]})
    r = httpx.post(f"{s.url}{path}", json={**body, "max_tokens": 8, **extra}, timeout=600)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# ---- stream_canvas (dLLM extension): the provisional canvas in streamed chunks

MASK_TEXT = "<|mdm_mask|>"  # the demo tokenizer's mask token


@pytest.mark.smoke
def test_canvas_object_shape():
    import numpy as np

    from dinfer_jax.serving.scheduler import CanvasView, canvas_object
    from dinfer_jax.tokenizer import char_tokenizer
    tok = char_tokenizer()
    eos, mask = 0, 1
    a, b, c = tok.encode("abc")
    view = CanvasView(np.array([a, mask, b, mask, mask, eos, c], np.int32), 3)
    got = canvas_object(view, tok, mask, {eos})
    assert got == {"token_ids": [a, None, b, None, None, eos, c], "text": f"a{MASK_TEXT}b{MASK_TEXT}{MASK_TEXT}",
                   "masked": 3, "step": 3}
    assert canvas_object(view, tok, mask, ())["text"] == f"a{MASK_TEXT}b{MASK_TEXT}{MASK_TEXT}c"  # ignore_eos
    assert canvas_object(view, None, mask, {eos})["text"] is None  # no tokenizer: ids only


def _stream_choices(s, body, path="/v1/completions") -> list[dict]:
    """The first choice of every streamed chunk that has one (the usage chunk has none)."""
    out = []
    with httpx.stream("POST", f"{s.url}{path}", json={**body, "stream": True}, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                out += chunk["choices"][:1]
    return out


def _check_canvases(canvases: list[dict], final_ids: list[int], n: int, tok):
    """What every canvas stream of the demo model (threshold decoding, no editing) shows: n
    positions, masked = the nulls, the text rendered from the ids, steps rising, masked never
    growing, a filled position never changing (its final token), the last canvas complete."""
    assert canvases, "no canvas event"
    assert any(v["masked"] > 0 for v in canvases), "no canvas with masked positions before the end"
    for v in canvases:
        ids = v["token_ids"]
        assert len(ids) == n and v["masked"] == ids.count(None)
        assert v["text"] == "".join(MASK_TEXT if t is None else tok.decode([t]) for t in ids)
        assert all(t is None or t == f for t, f in zip(ids, final_ids)), (ids, final_ids)
    steps = [v["step"] for v in canvases]
    assert steps == sorted(set(steps)) and steps[0] >= 1, steps
    masked = [v["masked"] for v in canvases]
    assert masked == sorted(masked, reverse=True), masked
    assert canvases[-1]["masked"] == 0 and canvases[-1]["token_ids"] == final_ids


CANVAS_BODY = {"prompt": PROMPT, "max_tokens": 64, "block_length": 4, "ignore_eos": True}
# 16 blocks: at least 16 steps, so even the continuous scheduler (a read every 8 steps) shows masks


def test_stream_canvas_completions(server):
    s, sched, tok = server
    want = _post(s, {**CANVAS_BODY, "return_step_map": True})["choices"][0]
    assert len(want["token_ids"]) == 64
    chs = _stream_choices(s, {**CANVAS_BODY, "stream_canvas": True})
    assert "".join(c["text"] for c in chs) == want["text"]  # the committed text: the plain answer
    assert chs[-1]["finish_reason"] == "length" and "canvas" not in chs[-1]
    canvases = [c["canvas"] for c in chs if "canvas" in c]
    _check_canvases(canvases, want["token_ids"], 64, tok)
    # the canvas at step k holds exactly the tokens committed before step k (commit_steps is 0-based)
    for v in canvases:
        assert [t is not None for t in v["token_ids"]] == [k < v["step"] for k in want["commit_steps"]]
    # the committed text never runs ahead of the canvas it comes with
    sent = ""
    for c in chs:
        sent += c["text"]
        if "canvas" in c:
            ids = c["canvas"]["token_ids"]
            filled = ids.index(None) if None in ids else len(ids)
            assert len(sent) <= filled  # one character per demo token
    # with the step map (static: the text comes at the end, the canvas still per step): the same canvases
    rec = _stream_choices(s, {**CANVAS_BODY, "stream_canvas": True, "return_step_map": True})
    assert [c["canvas"] for c in rec if "canvas" in c] == canvases
    assert sum((c.get("commit_steps", []) for c in rec), []) == want["commit_steps"]
    # without stream_canvas: no canvas, and the same text chunks
    plain = _stream_choices(s, CANVAS_BODY)
    assert all("canvas" not in c for c in plain)
    assert [c["text"] for c in plain if c["text"]] == [c["text"] for c in chs if c["text"]]
    # the openai client parses the chunks; the canvas is an extra field of the choice
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none")
    text, got = "", []
    extra = {k: v for k, v in CANVAS_BODY.items() if k in ("block_length", "ignore_eos")}
    for chunk in client.completions.create(model="demo", prompt=PROMPT, max_tokens=64, stream=True,
                                           extra_body={**extra, "stream_canvas": True}):
        text += chunk.choices[0].text
        if getattr(chunk.choices[0], "canvas", None) is not None:
            got.append(chunk.choices[0].canvas)
    assert text == want["text"] and got == canvases


def test_stream_canvas_chat(server):
    s, sched, tok = server
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 64, "block_length": 4,
            "ignore_eos": True}
    want = _post(s, body, "/v1/chat/completions")["choices"][0]["message"]["content"]
    chs = _stream_choices(s, {**body, "stream_canvas": True}, "/v1/chat/completions")
    assert "".join(c["delta"].get("content") or "" for c in chs) == want
    canvases = [c["canvas"] for c in chs if "canvas" in c]
    final = canvases[-1]["token_ids"]
    assert tok.decode(final) == want
    _check_canvases(canvases, final, 64, tok)
    assert all("canvas" not in c for c in _stream_choices(s, body, "/v1/chat/completions"))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra", [{"stream_canvas": True}, {"stream_canvas": True, "stream": False},
                                   {"stream_canvas": "yes", "stream": True}])
def test_stream_canvas_refusals(server, path, extra):
    s, sched, tok = server
    body = ({"prompt": PROMPT} if "chat" not in path else {"messages": [{"role": "user", "content": PROMPT}]})
    r = httpx.post(f"{s.url}{path}", json={**body, "max_tokens": 8, **extra}, timeout=600)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stream_canvas", r.json()
    ok = httpx.post(f"{s.url}{path}", json={**body, "max_tokens": 8, "stream_canvas": False}, timeout=600)
    assert ok.status_code == 200 and "canvas" not in ok.text
