"""Soak: a bounded run (SOAK_SECONDS) of mixed valid / invalid / cancelled / streaming requests at
concurrency 32 against the continuous scheduler (demo model, real uvicorn on loopback). Every
valid request gets the engine's answer, every invalid one a 4xx, nothing is lost, /health answers
ok throughout and the scheduler ends alive with nothing left in flight."""
from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from bench.serve_load import InProcessServer  # noqa: E402
from demo_helpers import demo  # noqa: E402

from dinfer_jax.serving.scheduler import ServerConfig, derive_params  # noqa: E402

SOAK_SECONDS = 30.0
CONCURRENCY = 32
PROMPTS = ["add 123+045=", "sort 5391=", "add 7+8=", "sort 82=", "add 99+1="]
LENGTHS = (8, 16)
INVALID = [({"cache": "block"}, 400), ({"temperature": 1e308}, 400), ({"max_tokens": True}, 400),
           ({"strategy": "sequential"}, 400), ({"bogus": 1}, 400), ({"max_tokens": 100_000}, 400)]


def test_soak_mixed_traffic():
    model, tok = demo()
    cfg = ServerConfig(model_name="demo", max_batch=8, max_tokens=64, request_timeout_s=120)
    want = {}
    for m in LENGTHS:
        p = derive_params(cfg.default_params, {}, m, model.config)
        r = model.generator.generate([np.asarray(tok.encode(t), np.int32) for t in PROMPTS], p)
        for t, ids in zip(PROMPTS, r.token_ids):
            want[t, m] = ids[:m]
    tally = {"ok": 0, "invalid": 0, "cancelled": 0, "stream": 0}
    problems, health_bad = [], []
    with InProcessServer(model, tok, cfg) as s:
        for m in LENGTHS:  # compile outside the timed window
            assert httpx.post(f"{s.url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": m},
                              timeout=600).status_code == 200

        async def worker(c: httpx.AsyncClient, rng: random.Random, end: float):
            while time.monotonic() < end:
                kind = rng.choices(["ok", "invalid", "cancel", "stream"], [5, 2, 1, 2])[0]
                t, m = rng.choice(PROMPTS), rng.choice(LENGTHS)
                body = {"prompt": t, "max_tokens": m}
                if kind == "invalid":
                    extra, status = rng.choice(INVALID)
                    r = await c.post(f"{s.url}/v1/completions", json={**body, **extra})
                    if r.status_code != status:
                        problems.append(("invalid", extra, r.status_code, r.text[:200]))
                    tally["invalid"] += 1
                elif kind == "cancel":  # the client gives up almost at once
                    try:
                        await c.post(f"{s.url}/v1/completions", json=body, timeout=rng.uniform(0.001, 0.05))
                    except httpx.TimeoutException:
                        pass
                    tally["cancelled"] += 1
                elif kind == "stream":
                    text = ""
                    async with c.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                import json
                                ch = json.loads(line[6:]).get("choices") or [{}]
                                text += ch[0].get("text", "")
                    if text != tok.decode(want[t, m]):
                        problems.append(("stream", t, m, text))
                    tally["stream"] += 1
                else:
                    r = await c.post(f"{s.url}/v1/completions", json=body)
                    if r.status_code != 200 or r.json()["choices"][0]["token_ids"] != want[t, m]:
                        problems.append(("ok", t, m, r.status_code, r.text[:200]))
                    tally["ok"] += 1

        async def prober(c: httpx.AsyncClient, end: float):
            while time.monotonic() < end:
                t = time.perf_counter()
                r = await c.get(f"{s.url}/health")
                if r.status_code != 200 or time.perf_counter() - t > 2.0:
                    health_bad.append((r.status_code, time.perf_counter() - t))
                await asyncio.sleep(0.5)

        async def main():
            end = time.monotonic() + SOAK_SECONDS
            limits = httpx.Limits(max_connections=CONCURRENCY + 4)
            async with httpx.AsyncClient(timeout=300, limits=limits) as c:
                await asyncio.gather(prober(c, end),
                                     *(worker(c, random.Random(i), end) for i in range(CONCURRENCY)))
        asyncio.run(main())
        b = s.app.state.batcher
        for _ in range(200):  # cancelled rows leave at their next segment boundary
            if b.idle():
                break
            time.sleep(0.05)
        st = b.snapshot()
        assert b.alive() and b.idle() and st["scheduler_errors"] == 0, st
    assert not problems, problems[:5]
    assert not health_bad, health_bad[:5]
    assert tally["ok"] >= 20 and tally["stream"] >= 5 and tally["invalid"] >= 5 and tally["cancelled"] >= 1, tally
