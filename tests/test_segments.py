"""Continuous batching (decoding/segments.py): rows swapped in between loop segments decode exactly
as alone (tokens and forwards), for full-canvas strategies/caches and block diffusion with editing;
a freed slot's poisoned contents never reach the row that takes it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.engine import SamplingParams, generate


@pytest.fixture(scope="module")
def demo():
    from demo_helpers import demo as load
    return load()


@pytest.fixture(scope="module")
def tiny_llada2():
    from dinfer_jax.families import preset
    from dinfer_jax.model import Model
    cfg = preset("tiny-llada2")
    from demo_helpers import peaky_random_params
    params = peaky_random_params(cfg, seed=11)
    return Model(cfg, params)


def _drive(model, prompts, sps, batch, seg, poison=False):
    """Deterministic staggered driver: prompts 2t and 2t+1 arrive before segment t and take free
    slots when there are any; runs segments of `seg` iterations until all are done."""
    rb = model.generator.running_batch(sps[0], batch, max(len(p) for p in prompts))
    waiting, results, t = [], {}, 0
    rb.mid_flight = 0  # admissions while another row was mid-generation
    while len(results) < len(prompts):
        waiting += [i for i in (2 * t, 2 * t + 1) if i < len(prompts)]
        free = rb.free
        if free and waiting:
            take = waiting[:len(free)]
            waiting = waiting[len(take):]
            if poison and rb.state is not None:
                rb.state = _poison(rb.state, free[:len(take)])
            rb.mid_flight += rb.running > 0
            rb.admit([(i, np.asarray(prompts[i], np.int32), sps[i]) for i in take])
        for r in rb.step(seg):
            results[r.tag] = r
        t += 1
        assert t < 10_000
    return results, rb


def _poison(state, slots):
    """Fill the given slots' every per-row leaf with garbage (large values / random tokens)."""
    import dataclasses

    from dinfer_jax.decoding.loop_state import BATCH_AXIS
    out = {}
    for f in dataclasses.fields(state):
        k, v = f.name, getattr(state, f.name)
        if v is None:
            continue
        axis = BATCH_AXIS.get(k, 0)

        def bad(a, axis=axis):
            if a.ndim == 0:
                return a
            sel = np.zeros((a.shape[axis],), bool)
            sel[slots] = True
            shape = [1] * a.ndim
            shape[axis] = a.shape[axis]
            junk = (jnp.full_like(a, 7) if jnp.issubdtype(a.dtype, jnp.integer) else
                    jnp.full_like(a, True) if a.dtype == jnp.bool_ else jnp.full_like(a, 1e4))
            return jnp.where(jnp.asarray(sel).reshape(shape), junk, a)
        out[k] = jax.tree_util.tree_map(bad, v)
    return state.replace(**out)


def _check_alone(model, prompts, sps, results):
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        alone = generate(model, [p], sp)
        r = results[i]
        assert r.raw_ids.tolist() == alone.raw_ids[0].tolist(), f"prompt {i}"
        assert r.nfe == alone.nfe[0], f"prompt {i}: {r.nfe} forwards, alone {alone.nfe[0]}"
        assert not r.capped
        if alone.edits is not None:
            assert r.edits == alone.edits[0]
        n = len(alone.token_ids[0])  # the row's commit record (over its raw region) vs alone's (over token_ids)
        assert r.commit_steps[:n] == alone.commit_steps[0], f"prompt {i}: step map"
        assert all(v >= 0 for v in r.commit_steps[:n])  # every answered token was written by the decoder
        if sp.logprobs is None:
            assert r.token_logprobs is None and alone.token_logprobs is None
            continue
        # the same forwards in a batch of 2 / of 1: fp32 logits agree to rounding (~4e-5 seen on the demo
        # model: XLA reduces in another order for another batch shape); a wrong step or position is >> 1e-2
        np.testing.assert_allclose(r.token_logprobs[:n], alone.token_logprobs[0], rtol=0, atol=1e-4)
        assert [[t for t, _ in a] for a in r.top_logprobs[:n]] == [[t for t, _ in a] for a in alone.top_logprobs[0]]
        assert all(len(a) == sp.logprobs for a in r.top_logprobs[:n])
        np.testing.assert_allclose([[v for _, v in a] for a in r.top_logprobs[:n]],
                                   [[v for _, v in a] for a in alone.top_logprobs[0]], rtol=0, atol=1e-4)


DEMO_SETTINGS = [
    dict(strategy="threshold", cache="dual", threshold=0.7),
    dict(strategy="fixed", cache="prefix", steps=16),
    dict(strategy="credit", cache="none"),
    dict(strategy="threshold", cache="dual", threshold=0.7, logprobs=20),
]


@pytest.mark.parametrize("kw", DEMO_SETTINGS, ids=["threshold-dual", "fixed-prefix", "credit-none",
                                                   "threshold-dual-logprobs"])
def test_swapped_rows_decode_as_alone(demo, kw):
    model, tok = demo
    texts = ["add 123+045=", "sort 5391=", "next abcdefgh=", "add 7+8=", "sort 88123456789=", "next zzzzaaaa="]
    prompts = [tok.encode(t) for t in texts]
    sps = [SamplingParams(gen_length=16, block_length=8, seed=i, **kw) for i in range(len(prompts))]
    results, rb = _drive(model, prompts, sps, batch=2, seg=1)
    assert rb.mid_flight >= 2  # rows really were swapped in while others were mid-generation
    _check_alone(model, prompts, sps, results)
    assert tok.decode(results[0].token_ids) == "0168" or kw["strategy"] != "fixed"


@pytest.mark.parametrize("logprobs", [None, 3])
def test_block_diffusion_rows_with_editing_and_poisoned_slots(tiny_llada2, logprobs):
    """Also the commit record: poisoned slots' old steps / logprobs never reach the new row."""
    model = tiny_llada2
    prompts = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 2], [60, 61, 62, 63, 64, 65, 66, 67, 68],
               [3, 4], [90, 91, 92, 93, 94, 95, 96]]
    sps = [SamplingParams(gen_length=16, block_length=8, cache="block", threshold=0.3 + 0.1 * (i % 3),
                          editing_threshold=0.3, max_post_steps=3, logprobs=logprobs) for i in range(len(prompts))]
    results, rb = _drive(model, prompts, sps, batch=2, seg=1, poison=True)
    assert rb.mid_flight >= 2
    _check_alone(model, prompts, sps, results)


def test_admit_checks(demo):
    model, tok = demo
    sp = SamplingParams(gen_length=16, block_length=8, cache="dual")
    rb = model.generator.running_batch(sp, 1, 12)
    with pytest.raises(ValueError, match="does not fit"):
        rb.admit([("x", np.arange(2, 60, dtype=np.int32) % 90 + 2, sp)])
    with pytest.raises(ValueError, match="different compiled program"):
        rb.admit([("x", np.asarray(tok.encode("add 1+2="), np.int32), SamplingParams(gen_length=32, block_length=8))])
    rb.admit([("a", np.asarray(tok.encode("add 1+2="), np.int32), sp)])
    with pytest.raises(ValueError, match="free slots"):
        rb.admit([("b", np.asarray(tok.encode("add 1+2="), np.int32), sp)])


def test_evicted_row_frees_its_slot_and_leaves_the_others_alone(demo):
    """A cancelled request's row is evicted at a segment boundary: it never reports, its slot takes
    the next prompt, and the other row decodes exactly as alone."""
    model, tok = demo
    sp = SamplingParams(gen_length=16, block_length=8, strategy="fixed", steps=16, cache="dual")
    a, b, c = (tok.encode(t) for t in ("sort 88123456789=", "next abcdefgh=", "add 7+8="))
    rb = model.generator.running_batch(sp, 2, 16)
    rb.admit([("a", np.asarray(a, np.int32), sp), ("b", np.asarray(b, np.int32), sp)])
    assert rb.step(2) == []
    rb.evict([rb.slots.index("a")])
    assert rb.running == 1 and len(rb.free) == 1
    rb.admit([("c", np.asarray(c, np.int32), sp)])
    results = {}
    while rb.running:
        results.update({r.tag: r for r in rb.step(4)})
    assert set(results) == {"b", "c"}
    for tag, p in (("b", b), ("c", c)):
        alone = generate(model, [p], sp)
        assert results[tag].raw_ids.tolist() == alone.raw_ids[0].tolist() and results[tag].nfe == alone.nfe[0]


@pytest.mark.parametrize("kind", ["dual", "block"])
def test_rows_of_different_gen_length_share_one_program(demo, tiny_llada2, kind):
    """Rows with gen_length 8, 16 and 24 (block 8) decode in one program whose region is 32 (the
    server's bucket): each equals decoding it alone with its own gen_length, tokens and forwards."""
    if kind == "dual":
        model, tok = demo
        prompts = [tok.encode(t) for t in ("sort 5391=", "add 12+34=", "copy abcd=", "rev 8712=")]
        base = dict(block_length=8, cache="dual", threshold=0.9)
    else:
        model = tiny_llada2
        rng = np.random.default_rng(5)
        prompts = [rng.integers(0, 100, n).tolist() for n in (5, 11, 17, 9)]
        base = dict(block_length=8, cache="block", threshold=0.9)
    sps = [SamplingParams(gen_length=g, **base) for g in (8, 16, 24, 16)]
    gen = model.generator
    rb = gen.running_batch(sps[0], 4, max(map(len, prompts)), gen_length=32)
    assert rb.spec.gen_length == 32
    rb.admit([(i, np.asarray(p, np.int32), sp) for i, (p, sp) in enumerate(zip(prompts[:2], sps[:2]))])
    results, waiting = {}, [2, 3]
    for _ in range(1000):
        for r in rb.step(3):
            results[r.tag] = r
        if len(results) == len(prompts):
            break
        take, waiting = waiting[:len(rb.free)], waiting[len(rb.free):]  # later arrivals join mid-flight
        if take:
            rb.admit([(i, np.asarray(prompts[i], np.int32), sps[i]) for i in take])
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        alone = generate(model, [p], sp)
        assert len(results[i].raw_ids) == sp.gen_length
        assert results[i].raw_ids.tolist() == alone.raw_ids[0].tolist(), i
        assert results[i].nfe == alone.nfe[0], i
    with pytest.raises(ValueError, match="different compiled program"):
        rb.admit([(9, np.asarray(prompts[0], np.int32), SamplingParams(gen_length=40, **base))])


@pytest.mark.parametrize("kind", ["dual", "block"])
def test_rows_moved_between_batch_sizes_decode_as_alone(demo, tiny_llada2, kind):
    """RunningBatch.take_rows (the continuous scheduler's repacking): rows stepped part-way in a batch
    of 4 move into a fresh batch of 2, one of them later into a running batch of 4 beside another
    row: each row's tokens, forwards and commit record equal decoding it alone."""
    if kind == "dual":
        model, tok = demo
        prompts = [tok.encode(t) for t in ("sort 5391=", "add 12+34=", "next abcdefgh=", "add 7+8=")]
        sps = [SamplingParams(gen_length=16, block_length=8, cache="dual", strategy="fixed", steps=16, seed=i,
                              logprobs=2, temperature=0.7 * (i % 2), early_stop=False)  # sampled rows: their RNG moves
               for i in range(4)]
    else:
        model = tiny_llada2
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, 100, n).tolist() for n in (5, 11, 7, 9)]
        sps = [SamplingParams(gen_length=16, block_length=8, cache="block", threshold=0.4, editing_threshold=0.3,
                              max_post_steps=3) for _ in range(4)]
    gen = model.generator
    n = max(map(len, prompts))
    big = gen.running_batch(sps[0], 4, n)
    big.admit([(i, np.asarray(p, np.int32), sp) for i, (p, sp) in enumerate(zip(prompts[:3], sps[:3]))])
    results = {r.tag: r for r in big.step(1)}
    small = gen.running_batch(sps[0], 2, n)
    moved = [b for b, t in enumerate(big.slots) if t is not None][:2]
    assert moved, "every row finished in one step: nothing left to move mid-decode"
    tags = [big.slots[b] for b in moved]
    from dinfer_jax.decoding.segments import abstract_state
    key = small.move_key(big)  # compiled ahead, as the server's compile thread does
    gen.warm_move_program(key, None, abstract_state(big.state))
    assert gen.move_ready(key) and not gen.move_ready(gen.move_key(small.spec, small.gen_start, 4, 2, False))
    assert small.take_rows(big, moved) == list(range(len(moved))) and small.slots[:len(moved)] == tags
    assert all(t not in big.slots for t in tags)
    with pytest.raises(ValueError, match="only running rows"):
        small.take_rows(big, [moved[0]])
    # the moved state is placed as an admitted one (committed-ness is part of a jitted program's
    # signature: a mismatch recompiled the whole segment program at the next step)
    placed = lambda st: [a.committed for a in jax.tree_util.tree_leaves(st)]  # noqa: E731
    assert placed(small.state) == placed(big.state)
    results.update({r.tag: r for r in small.step(1)})
    results.update({r.tag: r for r in big.step(1)})
    # back into the big batch (beside its remaining row and a newly admitted one)
    big.admit([(3, np.asarray(prompts[3], np.int32), sps[3])])
    live = [b for b, t in enumerate(small.slots) if t is not None]
    assert live, "the moved rows all finished in one step: nothing left to move back"
    big.take_rows(small, live)
    assert small.running == 0
    for _ in range(200):
        results.update({r.tag: r for r in big.step(3)})
        if len(results) == 4:
            break
    assert sorted(results) == [0, 1, 2, 3]
    _check_alone(model, prompts, sps, results)
    other = gen.running_batch(SamplingParams(gen_length=32, block_length=8, cache=sps[0].cache), 2, n)
    with pytest.raises(ValueError, match="same program"):
        other.take_rows(big, [])
