"""The jitted denoising loop vs the slow host-loop reference (tests/decoding_reference.py), batch
invariance, determinism, early stop, one-program/no-host-sync, compile cache, input errors.

Model: the tiny LLaDA-MoE preset with random weights and the LM head scaled x40, so confidences
spread out and threshold strategies unmask several tokens per step.
"""
import dataclasses

import jax
import numpy as np
import pytest

from decoding_reference import reference_generate
from dinfer_jax import SamplingParams, generate, preset
from dinfer_jax.engine import Generator
from dinfer_jax.model import Model
from dinfer_jax.models import init_params

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
BASE = SamplingParams(gen_length=16, block_length=8, threshold=0.35, low_threshold=0.3, factor=2.0, steps=16,
                      prefix_look=4, after_look=4, warmup_steps=2, cache="none")


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny")
    params = init_params(cfg, seed=0)
    params["lm_head"]["unembedding"] = params["lm_head"]["unembedding"] * 40.0
    return Model(cfg, params)


CASES = [(s, c) for s in ("fixed", "threshold", "factor", "credit", "hierarchy") for c in ("none", "dual")] + [
    ("fixed", "prefix"), ("threshold", "prefix"), ("threshold", "vicinity"), ("hierarchy", "vicinity"),
    ("credit", "prefix")]


@pytest.mark.parametrize("strategy,cache", CASES)
def test_loop_matches_reference(model, strategy, cache):
    p = dataclasses.replace(BASE, strategy=strategy, cache=cache)
    r = generate(model, PROMPTS, p)
    for i, prompt in enumerate(PROMPTS):
        rec = {}
        want, nfe = reference_generate(model, prompt, p, record=rec)
        assert r.raw_ids[i].tolist() == want, f"row {i}"
        assert r.nfe[i] == nfe
        n = len(r.token_ids[i])
        assert r.commit_steps[i] == rec["steps"][:n], f"row {i}: step map"  # always recorded
    assert r.token_logprobs is None and r.top_logprobs is None  # not asked
    assert not np.any(r.raw_ids == model.config.mask_token_id)
    if strategy != "fixed":
        assert max(r.tpf) > 1.0  # several tokens per forward really happened


# Logprobs vs the reference's float64 numpy log_softmax of the same forward's logits. Tolerance: the
# loop's log_softmax runs in fp32 on fp32 logits of magnitude <~ 50 (the x40 head), whose rounding is
# ~ 50 * 2**-24 ~ 3e-6 per logit; the jitted forward (padded, batched, cached windows) and the
# reference's own forward differ by about as much, so 1e-4 absolute leaves room while a wrong
# position, step, token or distribution (e.g. after temperature or credit) is off by >> 1e-2.
LP_CASES = [("credit", "dual", 5), ("fixed", "prefix", 0), ("threshold", "vicinity", 20)]


@pytest.mark.parametrize("strategy,cache,top", LP_CASES)
def test_logprobs_match_reference(model, strategy, cache, top):
    p = dataclasses.replace(BASE, strategy=strategy, cache=cache, logprobs=top)
    r = generate(model, PROMPTS, p)
    assert r.top_logprobs is not None
    for i, prompt in enumerate(PROMPTS):
        rec = {}
        want, _ = reference_generate(model, prompt, p, record=rec)
        assert r.raw_ids[i].tolist() == want, f"row {i}"
        n = len(r.token_ids[i])
        assert n > 0 and r.commit_steps[i] == rec["steps"][:n]
        np.testing.assert_allclose(r.token_logprobs[i], rec["logprobs"][:n], rtol=0, atol=1e-4)
        assert all(lp <= 0 for lp in r.token_logprobs[i])
        for j in range(n):
            got = r.top_logprobs[i][j]
            assert len(got) == top
            ref = rec["top"][j][:top]
            assert [t for t, _ in got] == [t for t, _ in ref], f"row {i} pos {j}"
            np.testing.assert_allclose([v for _, v in got], [v for _, v in ref], rtol=0, atol=1e-4)
    # one program per bucket: 1..5 share the bucket of 5 (the top 3 are the bucket's first 3)
    if top == 5:
        q = generate(model, PROMPTS, dataclasses.replace(p, logprobs=3))
        assert q.token_ids == r.token_ids
        assert [[a[:3] for a in row] for row in r.top_logprobs] == q.top_logprobs


@pytest.mark.smoke
@pytest.mark.parametrize("bad,msg", [(dict(logprobs=21), r"logprobs=21 must be in \[0, 20\]"),
                                     (dict(logprobs=-1), r"logprobs=-1 must be in \[0, 20\]"),
                                     (dict(logprobs=True), "logprobs=True must be an integer"),
                                     (dict(logprobs=2.0), "logprobs=2.0 must be an integer")])
def test_bad_logprobs(bad, msg):
    from dinfer_jax.engine import InvalidParam
    with pytest.raises(InvalidParam, match=msg) as e:
        dataclasses.replace(BASE, **bad)
    assert e.value.field == "logprobs"


PROMPTS_8 = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30], [40, 41], [50, 51, 52, 53],
             [60, 61, 62, 63, 64, 65], [70, 71, 72]]


@pytest.mark.parametrize("n,kw", [(4, dict(strategy="threshold", cache="dual")),
                                  (8, dict(strategy="threshold", cache="dual", smoothing=True)),
                                  (8, dict(strategy="threshold", cache="prefix"))])
def test_partial_full_refresh_matches_reference(model, n, kw):
    """Rows reach block starts at different steps; a step where at most B/2 rows need the
    full-canvas forward runs it on those rows only (gathered, loop.refresh_rows_for). Every row
    still decodes as the host-loop reference decodes it alone, and the partial path did run."""
    p = dataclasses.replace(BASE, gen_length=32, **kw)
    r = generate(model, PROMPTS_8[:n], p)
    for i, prompt in enumerate(PROMPTS_8[:n]):
        assert r.raw_ids[i].tolist() == reference_generate(model, prompt, p)[0], f"row {i}"
    assert 0 < r.batch_nfe_partial < r.batch_nfe_full


@pytest.mark.parametrize("cache,align", [("none", False), ("dual", False), ("vicinity", False), ("dual", True),
                                         ("prefix", True)])
def test_smoothing_and_alignment_match_reference(model, cache, align):
    smoothing = not align or cache == "dual"
    if cache == "prefix":
        smoothing = False
    p = dataclasses.replace(BASE, strategy="threshold", cache=cache, smoothing=smoothing, start_block_align=align)
    r = generate(model, PROMPTS, p)
    for i, prompt in enumerate(PROMPTS):
        assert r.raw_ids[i].tolist() == reference_generate(model, prompt, p)[0], f"row {i}"


def test_prompt_eos_inside_aligned_block_does_not_stop(model):
    """With start_block_align the first block holds prompt tokens; an EOS there is not generated."""
    eos = model.config.eos_token_id
    p = dataclasses.replace(BASE, strategy="threshold", cache="dual", smoothing=True, start_block_align=True)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, eos]  # 10 tokens: the first aligned block is [8, 16)
    r = generate(model, [prompt], p)
    assert r.raw_ids[0].tolist() == reference_generate(model, prompt, p)[0]
    assert not (r.raw_ids[0] == eos).all()


def test_refresh_every_step_equals_no_cache(model):
    a = generate(model, PROMPTS, dataclasses.replace(BASE, cache="none"))
    b = generate(model, PROMPTS, dataclasses.replace(BASE, cache="dual", refresh_every=1))
    np.testing.assert_array_equal(a.raw_ids, b.raw_ids)
    assert b.batch_nfe_window == 0 and b.batch_nfe_full == a.batch_nfe_full


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batch_invariance(model, temperature):
    p = dataclasses.replace(BASE, cache="dual", strategy="credit", temperature=temperature, seed=3)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25]]  # batch bucket 4
    together = generate(model, prompts, p)
    for i, prompt in enumerate(prompts):
        alone = generate(model, [prompt], p)
        np.testing.assert_array_equal(alone.raw_ids[0], together.raw_ids[i])
        assert alone.nfe[0] == together.nfe[i]


def test_seeded_determinism(model):
    p = dataclasses.replace(BASE, cache="dual", temperature=1.0, seed=11)
    a, b = generate(model, PROMPTS, p), generate(model, PROMPTS, p)
    np.testing.assert_array_equal(a.raw_ids, b.raw_ids)
    c = generate(model, PROMPTS, dataclasses.replace(p, seed=12))
    assert not np.array_equal(a.raw_ids, c.raw_ids)


def test_early_stop_at_eos(model):
    cfg = model.config
    params = jax.tree_util.tree_map(lambda a: a, model.params)
    k = params["lm_head"]["unembedding"]
    params["lm_head"]["unembedding"] = k.at[cfg.eos_token_id].set(1.5 * k[90])  # EOS wins where 90 would
    eos_model = Model(cfg, params)
    p = dataclasses.replace(BASE, gen_length=32, cache="dual")
    stop = generate(eos_model, PROMPTS, p)
    full = generate(eos_model, PROMPTS, dataclasses.replace(p, early_stop=False))
    for i in range(len(PROMPTS)):
        row = stop.raw_ids[i]
        first_eos = int(np.flatnonzero(row == cfg.eos_token_id)[0])
        block_end = (first_eos // 8 + 1) * 8
        assert (row[block_end:] == cfg.eos_token_id).all()
        assert block_end < 32  # stopped before the last block
        assert stop.nfe[i] < full.nfe[i]
        np.testing.assert_array_equal(row[:block_end], full.raw_ids[i][:block_end])
    assert stop.batch_nfe_full + stop.batch_nfe_window < full.batch_nfe_full + full.batch_nfe_window


def _primitives(jaxpr, out):
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for v in eqn.params.values():
            for j in (v if isinstance(v, (list, tuple)) else [v]):
                if hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
                    _primitives(j.jaxpr, out)
                elif hasattr(j, "eqns"):
                    _primitives(j, out)
    return out


def test_whole_generation_is_one_program_without_host_callbacks(model):
    gen = Generator(model)
    p = dataclasses.replace(BASE, cache="dual", strategy="credit")
    prog, args, *_ = gen._prepare(PROMPTS, p)
    closed = jax.make_jaxpr(prog)(*args)
    inner = closed.jaxpr.eqns
    # jit wraps everything in one pjit whose body has exactly one top-level while loop.
    assert len(inner) == 1 and inner[0].primitive.name in ("pjit", "jit")
    body = inner[0].params["jaxpr"].jaxpr
    assert [e.primitive.name for e in body.eqns].count("while") == 1
    prims = _primitives(closed.jaxpr, [])
    assert not [n for n in prims if "callback" in n or n in ("debug_print", "io_callback")]
    assert prims.count("while") == 1 and "scan" in prims  # the denoising loop; the layer scan inside it
    assert prims.count("dot_general") >= 10  # the model really is inside the loop body


def test_compile_once_per_bucket(model):
    gen = Generator(model)
    p = dataclasses.replace(BASE, cache="dual")
    gen.generate([[1, 2, 3]], p)
    gen.generate([[4, 5, 6, 7, 8, 9]], dataclasses.replace(p, threshold=0.7, seed=5, temperature=0.5))
    gen.generate([[4, 5], [6, 7, 8]], p)  # batch 2 -> another bucket
    gen.generate([[9, 9], [8, 8, 8, 8]], dataclasses.replace(p, threshold=0.2))
    assert gen.compiles == 2


@pytest.mark.smoke
@pytest.mark.parametrize("bad,msg", [
    (dict(strategy="greedy"), "strategy='greedy' is not one of"),
    (dict(cache="paged"), "cache='paged' is not one of"),
    (dict(gen_length=20, block_length=8), "gen_length=20 must be a positive multiple of block_length=8"),
    (dict(strategy="fixed", steps=3), r"steps=3 must be a positive multiple of the number of blocks \(2\)"),
    (dict(temperature=-1.0), r"temperature=-1.0 must be in \[0.0, 1000.0\]"),
    (dict(smoothing=True, cache="prefix"), "iteration smoothing with the prefix cache is not supported"),
    (dict(seed=-1), r"seed=-1 must be in \[0, 2\*\*32\)"),
])
def test_bad_settings(bad, msg):
    cfg = preset("tiny")
    with pytest.raises(ValueError, match=msg):
        dataclasses.replace(BASE, **bad).spec(cfg.mask_token_id, cfg.eos_token_id)


def test_bad_prompts(model):
    with pytest.raises(ValueError, match="prompt contains the mask token id 127"):
        generate(model, [[1, 127]], BASE)
    with pytest.raises(ValueError, match="token id 500 is out of the vocabulary"):
        generate(model, [[1, 500]], BASE)
    with pytest.raises(ValueError, match=r"each prompt must be a 1-D sequence of token ids, got shape \(2, 2\)"):
        generate(model, [[[1, 2], [3, 4]]], BASE)
    with pytest.raises(ValueError, match="no prompts given"):
        generate(model, [], BASE)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=512"):
        generate(model, [[1] * 500], dataclasses.replace(BASE, gen_length=64))


def test_random_remasking_runs_fixed_steps(model):
    p = dataclasses.replace(BASE, strategy="random", cache="dual", seed=2)
    r = generate(model, PROMPTS, p)
    assert r.nfe == [16, 16] and not np.any(r.raw_ids == model.config.mask_token_id)
    assert (r.steps_per_block == 8).all()


def test_observer_sees_every_iteration_without_changing_tokens(model):
    """generate(observer=...) (streaming / live canvas) runs the variant with one host callback per
    iteration; its tokens equal the callback-free program's, the last state is the final canvas,
    and per-prompt knobs (threshold, seed) may differ inside one batch."""
    gen = Generator(model)
    p = dataclasses.replace(BASE, cache="dual")
    q = dataclasses.replace(p, threshold=0.6, seed=7)
    plain = gen.generate(PROMPTS[:2], [p, q])
    seen = []
    watched = gen.generate(PROMPTS[:2], [p, q], observer=lambda *a: seen.append(a))
    assert watched.token_ids == plain.token_ids
    assert len(seen) == max(watched.nfe)  # one call per loop iteration
    step, gen_BG, blk_B, done_B, active_B = seen[-1]
    assert (gen_BG[:2] == watched.raw_ids).all() and done_B[:2].all()
    assert [s[0] for s in seen] == list(range(len(seen)))
    masks = [int((s[1][:2] == model.config.mask_token_id).sum()) for s in seen]
    assert masks == sorted(masks, reverse=True)  # masks only ever resolve
    alone = [gen.generate([PROMPTS[i]], pp).token_ids[0] for i, pp in enumerate((p, q))]
    assert alone == plain.token_ids  # per-row knobs: the same as each prompt decoded alone
    with pytest.raises(ValueError, match="share the compiled settings.*block_length"):
        gen.generate(PROMPTS[:2], [p, dataclasses.replace(p, block_length=4)])
