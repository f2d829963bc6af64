"""The continuous scheduler behind the server, under an open-loop load (bench/serve_load.py at a
small, bounded scale) side by side with the static batcher: every request completes and the run
stops by itself (row swapping itself is checked token for token in tests/test_segments.py); and a
row cancelled mid-decode is evicted."""
import time

import numpy as np

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


def test_serve_load_small_and_bounded():
    from bench.serve_load import run
    t = time.perf_counter()
    out = run(rate=8.0, duration=2.0, drain=60.0, mix=(16, 32), max_batch=4, seed=1)
    assert time.perf_counter() - t < 300
    for name in ("static", "continuous"):
        r = out["runs"][name]
        assert r["sent"] >= 4 and r["completed"] == r["sent"] and r["unfinished"] == 0, (name, r)
        assert r["tokens_per_s"] > 0 and 0 < r["ttfb_p50"] <= r["e2e_p99"]
    cont = out["runs"]["continuous"]["server_stats"]
    sent = out["runs"]["continuous"]["sent"]  # + the warmup requests
    assert cont["admitted"] >= sent and cont["completed"] >= sent and cont["segments"] >= 1
    assert cont["batch_sizes"] and cont["failed"] == 0


def test_a_row_cancelled_mid_decode_is_evicted_and_its_slot_reused():
    """A request whose client leaves (or whose deadline passes) while its row decodes is evicted at
    the next segment boundary: its future is cancelled, the slot takes the next job, and that job's
    answer equals the engine's."""
    import asyncio

    from demo_helpers import demo as load

    from dinfer_jax.serving.continuous import ContinuousBatcher
    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.serving.scheduler import Job, ServerConfig
    model, tok = load()
    long = SamplingParams(gen_length=128, block_length=8, strategy="fixed", steps=128, cache="dual", early_stop=False)
    b = ContinuousBatcher(model.generator, tok, ServerConfig(model_name="demo", max_batch=4), segment=1)
    key = long.spec(model.config.mask_token_id, model.config.eos_id)

    async def go():
        loop = asyncio.get_running_loop()
        slow = Job(tok.encode("sort 5391="), long, 128, loop, loop.create_future(), key)
        b.submit_all([slow])
        for _ in range(3000):
            if b.snapshot()["segments"] >= 2:
                break
            await asyncio.sleep(0.01)
        slow.cancelled = True
        for _ in range(3000):
            if slow.future.done():
                break
            await asyncio.sleep(0.01)
        nxt = Job(tok.encode("next abcdefgh="), long, 128, loop, loop.create_future(), key)
        b.submit_all([nxt])
        return slow.future, await asyncio.wait_for(nxt.future, 600)

    slow, ok = asyncio.run(go())
    s = b.snapshot()
    b.close()
    assert slow.cancelled() and s["evicted"] == 1 and s["cancelled"] == 1
    want = model.generator.generate([np.asarray(tok.encode("next abcdefgh="), np.int32)], long).raw_ids[0]
    want = want.tolist()
    assert ok["token_ids"] == want[:want.index(model.config.eos_id) if model.config.eos_id in want else len(want)]


def test_prefix_cache_hits_show_in_stats_and_metrics():
    """Block-causal demo model behind the continuous scheduler: a second prompt sharing the first's
    leading blocks reuses their K/V (hit rate in /stats and /metrics) and answers as the engine does."""
    import asyncio

    from dinfer_jax import load_model
    from dinfer_jax.checkpoint import DEMO_BLOCK_MODEL_DIR
    from dinfer_jax.serving.continuous import ContinuousBatcher
    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.serving.scheduler import Job, ServerConfig
    from dinfer_jax.tokenizer import load_tokenizer
    model, tok = load_model(DEMO_BLOCK_MODEL_DIR), load_tokenizer(DEMO_BLOCK_MODEL_DIR)
    sp = SamplingParams(gen_length=16, block_length=4, cache="block", threshold=0.7)
    b = ContinuousBatcher(model.generator, tok, ServerConfig(model_name="demo-block", max_batch=4))
    key = sp.spec(model.config.mask_token_id, model.config.eos_id)
    texts = ["sort 53917428=", "sort 53917420="]  # 3 shared full blocks of 4

    async def go():
        loop = asyncio.get_running_loop()
        out = []
        for t in texts:
            j = Job(tok.encode(t), sp, 16, loop, loop.create_future(), key)
            b.submit_all([j])
            out.append(await asyncio.wait_for(j.future, 600))
        return out

    got = asyncio.run(go())
    s, m = b.snapshot(), b.metrics_text()
    b.close()
    pc = s["prefix_cache"]
    assert pc["blocks_hit"] >= 3 and 0 < pc["hit_rate"] < 1 and pc["bytes"] > 0, pc
    assert "dinfer:prefix_cache_hit_rate" in m
    for t, r in zip(texts, got):
        want = model.generator.generate([np.asarray(tok.encode(t), np.int32)], sp).token_ids[0]
        assert r["token_ids"] == want, t


def test_a_new_programs_compile_never_stalls_running_rows():
    """A request needing a program not compiled yet waits beside its compile (on the compile
    thread, held here by a gate) while the running batch keeps stepping; released, it answers as
    the engine does."""
    import asyncio
    import threading

    from demo_helpers import demo as load

    from dinfer_jax.serving.continuous import ContinuousBatcher
    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.serving.scheduler import Job, ServerConfig
    model, tok = load()
    gen = model.generator
    long = SamplingParams(gen_length=128, block_length=8, strategy="fixed", steps=128, cache="dual", early_stop=False)
    new = SamplingParams(gen_length=24, block_length=8, cache="dual", threshold=0.8)
    key_long = long.spec(model.config.mask_token_id, model.config.eos_id)
    from dinfer_jax.decoding.spec import bucket_gen_length, program_spec
    key_job = new.spec(model.config.mask_token_id, model.config.eos_id)
    key_new = program_spec(key_job, bucket_gen_length(key_job))  # gen 24 joins a program of 32
    gate, seen = threading.Event(), []
    original = gen.warm_segment_programs

    def gated(spec, *a, **k):
        if spec == key_new:
            seen.append(spec)
            assert gate.wait(300)
        return original(spec, *a, **k)
    gen.warm_segment_programs = gated
    b = ContinuousBatcher(gen, tok, ServerConfig(model_name="demo", max_batch=4), segment=1)

    async def go():
        loop = asyncio.get_running_loop()
        slow = Job(tok.encode("sort 5391="), long, 128, loop, loop.create_future(), key_long)
        b.submit_all([slow])
        for _ in range(30000):
            if b.snapshot()["segments"] >= 2:
                break
            await asyncio.sleep(0.01)
        fresh = Job(tok.encode("copy abc="), new, 24, loop, loop.create_future(), key_job)
        b.submit_all([fresh])
        for _ in range(30000):
            if b.snapshot()["waiting_for_compile"] == 1:
                break
            await asyncio.sleep(0.01)
        before = b.snapshot()["segments"]
        for _ in range(30000):  # the running row keeps decoding while the new program compiles
            if b.snapshot()["segments"] >= before + 3 or slow.future.done():
                break
            await asyncio.sleep(0.01)
        progressed = b.snapshot()["segments"] - before
        assert (progressed >= 3 or slow.future.done()), progressed  # not stalled behind the gated compile
        assert not fresh.future.done() and seen == [key_new]
        gate.set()
        return progressed, await asyncio.wait_for(slow.future, 600), await asyncio.wait_for(fresh.future, 600)

    try:
        progressed, _, got = asyncio.run(go())
        s = b.snapshot()
    finally:
        gate.set()
        b.close()
        del gen.warm_segment_programs
    assert s["background_compiles"] >= 1 and s["failed"] == 0
    want = gen.generate([np.asarray(tok.encode("copy abc="), np.int32)], new).token_ids[0]
    assert got["token_ids"] == want


def test_a_job_never_waits_for_a_compile_that_a_ready_program_makes_unnecessary():
    """Rows of any length share the largest program of their settings, but not while it compiles: a
    gen-16 job arriving while a gen-40 job's program (a region of 64) compiles (held here by a gate)
    starts at once in a new batch of its own compiled region and answers as the engine does."""
    import asyncio
    import threading

    from demo_helpers import demo as load

    from dinfer_jax.serving.continuous import ContinuousBatcher
    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.serving.scheduler import Job, ServerConfig
    model, tok = load()
    gen = model.generator
    short = SamplingParams(gen_length=16, block_length=8, cache="dual", threshold=0.8)
    longer = SamplingParams(gen_length=40, block_length=8, cache="dual", threshold=0.8)
    mask, eos = model.config.mask_token_id, model.config.eos_id
    gate, held = threading.Event(), []
    original = gen.warm_segment_programs

    def gated(spec, *a, **k):
        if spec.gen_length > 16:
            held.append(spec.gen_length)
            assert gate.wait(300)
        return original(spec, *a, **k)
    gen.warm_segment_programs = gated
    b = ContinuousBatcher(gen, tok, ServerConfig(model_name="demo", max_batch=4), segment=2)
    prompt = tok.encode("copy abc=")
    original(*gen.running_batch_key(short, 1, *b._bucketed(short, len(prompt), 16)))  # the short program: warm
    assert b._ready_new(short, 1, len(prompt), 16)

    async def go():
        loop = asyncio.get_running_loop()
        big = Job(tok.encode("sort 5391="), longer, 40, loop, loop.create_future(), longer.spec(mask, eos))
        b.submit_all([big])
        for _ in range(30000):
            if b.snapshot()["waiting_for_compile"] == 1:
                break
            await asyncio.sleep(0.01)
        small = Job(prompt, short, 16, loop, loop.create_future(), short.spec(mask, eos))
        b.submit_all([small])
        got = await asyncio.wait_for(small.future, 120)  # the gate still holds the big one's compile
        assert not big.future.done() and held == [64]
        gate.set()
        return got, await asyncio.wait_for(big.future, 600)

    try:
        got, _ = asyncio.run(go())
        s = b.snapshot()
    finally:
        gate.set()
        b.close()
        del gen.warm_segment_programs
    assert s["failed"] == 0
    assert got["token_ids"] == gen.generate([np.asarray(prompt, np.int32)], short).token_ids[0]


def test_a_drained_batch_moves_its_rows_into_a_smaller_one():
    """Four rows of one program start together in a batch of 4; three end after 24 iterations, and
    the last row moves into a batch of 1 (compiled in the background first) instead of costing 4
    rows per forward until it ends; every answer equals the engine's."""
    import asyncio

    from demo_helpers import demo as load

    from dinfer_jax.serving.continuous import ContinuousBatcher, repack_size
    from dinfer_jax.decoding.segments import abstract_state
    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.serving.scheduler import Job, ServerConfig
    assert repack_size(1, 0, [4], 4) == 1 and repack_size(3, 0, [4], 4) is None
    assert repack_size(2, 2, [16], 16) == 4 and repack_size(5, 0, [4, 4], 8) == 8 and repack_size(5, 0, [8], 8) is None
    assert repack_size(3, 0, [4, 8], 16) == 4 and repack_size(0, 3, [8], 8) is None
    model, tok = load()
    mc = model.config

    def sp(g):
        return SamplingParams(gen_length=g, block_length=8, strategy="fixed", steps=g, cache="dual", early_stop=False)
    texts = ["sort 5391=", "add 12+34=", "next abcdefgh=", "add 7+8="]
    lens = [24, 24, 24, 32]
    b = ContinuousBatcher(model.generator, tok, ServerConfig(model_name="demo", max_batch=4), segment=1)
    ids = np.asarray(tok.encode(texts[2]), np.int32)
    for size in (1, 4):  # as --warmup does: the move waits for no compile
        b._warmup_batch(sp(32), size, ids)
    four = b._running_batch(sp(32), 4, len(ids), 32)
    four.admit([(0, ids, sp(24))])
    key = model.generator.move_key(four.spec, four.gen_start, 4, 1, True)  # 4 slots -> an empty batch of 1
    model.generator.warm_move_program(key, None, abstract_state(four.state))  # else compiled in the background
    assert model.generator.move_ready(key)
    seen = []
    step = b._segment
    b._segment = lambda rb: (seen.append((rb.B, rb.running)), step(rb))[1]

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [Job(tok.encode(t), sp(g), g, loop, loop.create_future(), sp(g).spec(mc.mask_token_id, mc.eos_id))
                for t, g in zip(texts, lens)]
        b.submit_all(jobs)
        return [await asyncio.wait_for(j.future, 600) for j in jobs]

    try:
        got = asyncio.run(go())
        s = b.snapshot()
    finally:
        b.close()
    assert s["batches"] == 2 and s["repacked"] == 1 and s["failed"] == 0, s  # the first, then the one of 1
    assert seen[0] == (4, 4) and (1, 1) in seen, seen  # the last row ran on in a batch of one ...
    assert seen.count((4, 1)) <= 1, seen  # ... at most one segment after the others ended
    for t, g, r in zip(texts, lens, got):
        want = model.generator.generate([np.asarray(tok.encode(t), np.int32)], sp(g)).token_ids[0]
        assert r["token_ids"] == want, t
