"""Infilling and structured output through `dinfer-jax serve` (both schedulers, the shipped demo
model): `suffix`, response_format json_object / json_schema (also through the openai client),
vLLM's structured_outputs {json, regex, choice} and guided_* names; every answer parses /
validates / matches; bad constraints are 400s naming the field, and an ordinary request right
after them succeeds."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from bench.serve_load import InProcessServer  # noqa: E402
from demo_helpers import demo  # noqa: E402
from dinfer_jax.serving.scheduler import ServerConfig  # noqa: E402

SCHEMA = {"type": "object", "properties": {"sum": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["sum"]}


@pytest.fixture(scope="module", params=["static", "continuous"])
def server(request):
    from dinfer_jax.chat import ChatFormatter
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    model, tok = demo()
    cfg = ServerConfig(model_name="demo", max_batch=8, scheduler=request.param, max_tokens=128)
    with InProcessServer(model, tok, cfg, ChatFormatter(DEMO_MODEL_DIR, model.config.family)) as s:
        yield s, request.param, tok


def _post(s, body, path="/v1/completions", status=200):
    r = httpx.post(f"{s.url}{path}", json=body, timeout=600)
    assert r.status_code == status, r.text
    return r.json()


def test_suffix_infills_between_prompt_and_suffix(server):
    s, _, _ = server
    # "add 123+045=" -> 0168: the suffix gives the last two digits, the span of 2 fills "01"
    c = _post(s, {"prompt": "add 123+045=", "suffix": "68", "max_tokens": 2})["choices"][0]
    assert c["text"] == "01" and c["finish_reason"] == "stop"
    assert c["token_ids"] == _post(s, {"prompt": "add 123+045=", "max_tokens": 2})["choices"][0]["token_ids"][:2]


def test_infill_pieces_fill_the_gaps(server):
    s, _, _ = server
    # max_tokens 16: the block (and so the region) the demo model was trained on (16 positions)
    c = _post(s, {"prompt": "add 123+045=", "infill": ["0", 1, "6", 1], "max_tokens": 16})["choices"][0]
    assert c["text"] == "0168" and c["infill_spans"] == ["1", "8"]
    err = _post(s, {"prompt": "add 1+2=", "infill": ["x", -1]}, status=400)["error"]
    assert err["param"] == "infill" and "infill[1]" in err["message"]


def test_json_schema_and_object_validate(server):
    s, _, _ = server
    body = {"prompt": "add 123+045=", "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}}}
    for extra in ({}, {"temperature": 1.0, "seed": 3}, {"n": 3, "temperature": 0.7}):
        for c in _post(s, {**body, **extra})["choices"]:
            jsonschema.validate(json.loads(c["text"]), SCHEMA)
    obj = _post(s, {"prompt": "add 1+2=", "max_tokens": 128, "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj["choices"][0]["text"]), dict)
    chat = _post(s, {"messages": [{"role": "user", "content": "add 123+045="}], "max_tokens": 64,
                     "structured_outputs": {"json": SCHEMA}}, "/v1/chat/completions")
    jsonschema.validate(json.loads(chat["choices"][0]["message"]["content"]), SCHEMA)


def test_regex_and_choice(server):
    s, _, _ = server
    got = _post(s, {"prompt": "add 482+039=", "max_tokens": 8, "structured_outputs": {"regex": r"\d{4}"}})
    assert got["choices"][0]["text"] == "0521"  # the demo model's answer, within the pattern
    got = _post(s, {"prompt": "next abcdefgh=", "max_tokens": 16, "guided_regex": r"[a-c]{2,5}-?x"})
    assert re.fullmatch(r"[a-c]{2,5}-?x", got["choices"][0]["text"])
    got = _post(s, {"prompt": "sort 5391=", "max_tokens": 8, "guided_choice": ["9531", "1359", "x"]})
    assert got["choices"][0]["text"] == "1359"
    got = _post(s, {"prompt": "sort 5391=", "max_tokens": 8, "structured_outputs": {"choice": ["a", "bb"]}})
    assert got["choices"][0]["text"] in ("a", "bb")


def test_openai_client_response_format(server):
    openai = pytest.importorskip("openai")
    s, _, _ = server
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="-")
    r = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "add 123+045="}], max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model="demo", prompt="add 123+045=", suffix="68", max_tokens=2)
    assert r.choices[0].text == "01"
    # streamed: the rendered answer comes whole in one chunk, then the finish chunk
    whole = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "add 1+2="}], max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}})
    chunks = list(client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "add 1+2="}], max_tokens=64, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="demo", prompt="sort 5391=", max_tokens=8, stream=True, extra_body={"guided_choice": ["1359", "x"]}))
    assert streamed == "1359"


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array",
                                                                            "items": {"type": "integer"}}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "\\d", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "\\d{2}", "suffix": "x"}, "suffix"),
    ({"guided_regex": "\\d{2}", "stream": True, "stream_canvas": True}, "stream_canvas"),
    ({"guided_regex": "\\d{2}", "stop": ["1"]}, "stop"),
    ({"guided_regex": "\\d{2}", "logprobs": 2}, "logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 64} for i in range(4)}}}}},
     "response_format"),  # needs more than max_tokens=64 positions
])
def test_bad_constraints_are_400_naming_the_field(server, extra, param):
    s, _, _ = server
    err = _post(s, {"prompt": "add 1+2=", "max_tokens": 64, **extra}, status=400)["error"]
    assert err["param"] == param, err
    ok = _post(s, {"prompt": "add 123+045=", "max_tokens": 8})
    assert ok["choices"][0]["text"] == "0168"
