"""SDAR's `sequential` and `entropy_bounded` remasking strategies on the block loop (cache="block";
SamplingParams.strategy, eb_threshold; dinfer_jax/families/sdar.py DECODING has the facts and their
sources): a slow host-loop reference written from those facts (numpy, step by step, a full
block-causal forward over [0, block end) at every step, no cache) against the jitted loop, token for
token and in forwards, on a batch of prompts of different lengths at temperature 0; hand-built
cases for the exact comparisons; bad input.

No torch: the model is a random tiny SDAR-shaped network (runs on python3.12 too).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.families import preset
from dinfer_jax.decoding.block_strategies import entropy, entropy_bounded_transfer, sample_tokens, sequential_transfer
from dinfer_jax.engine import InvalidParam, SamplingParams, generate
from knobs_helper import row_knobs  # noqa: E402

PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14], [60, 61, 62]]  # 1, 0, 3 prompt-tail positions
G = 16


@pytest.fixture(scope="module")
def model():
    """tiny-sdar (block 4) with random weights, its attention and MLP projections x 20 (so the
    context, not only the position's own token, decides the prediction: the decoding order matters)
    and an untied LM head = 40 x the embedding (entropies from ~0 to ~1.5 nats: a bound then commits
    1, 2 or more masks); the mask id's row is 0 (logit 0): this model never predicts <MASK>, as
    trained SDAR models."""
    from dinfer_jax.model import Model
    from dinfer_jax.models import init_params
    cfg = preset("tiny-sdar")
    params = dict(init_params(cfg, seed=3))
    params["layers"] = jax.tree_util.tree_map_with_path(
        lambda path, w: w * 20.0 if str(path[-1].key).endswith("_proj") else w, params["layers"])
    head = (params["embed"]["embedding"] * 40.0).at[cfg.mask_token_id].set(0.0)
    return Model(cfg.replace(tie_word_embeddings=False), {**params, "lm_head": {"unembedding": head}})


_FWD = {}


def _plain_forward(model):
    """The model's plain block-causal forward (no cache), jitted once per model (each canvas length
    then compiles once for all cases)."""
    if id(model) not in _FWD:
        _FWD[id(model)] = (model, jax.jit(lambda params, ids: model.module.apply({"params": params}, ids)[0]))
    return _FWD[id(model)][1]


def reference_remask_generate(model, prompt, B: int, G: int, steps: int, strategy: str, eb: float = 0.35):
    """SDAR's block_diffusion_generate() with remasking_strategy `sequential` / `entropy_bounded`
    at temperature 0, from the facts in families/sdar.py (DECODING): one prompt; canvas = prompt +
    masks up to whole blocks; blocks from floor(P / B); per step (while the block has a mask): a full
    block-causal forward over [0, block end), v = argmax, q = softmax (float64);
      sequential: the positions [first mask, first mask + n_s) of the block, n_s = B // steps (+1 on
        the first B % steps steps);
      entropy_bounded: H_i = -sum_v q log q; the masked positions sorted by increasing H (ties: lower
        position), k = #{running sums of the sorted H < eb}, k = max(1, min(k, #masked)), the first k;
    x_i <- v_i on those; after a block, stop if a stop id is in the generated part.
    -> (generated tokens cut before the first stop id, forwards, commits, steps that committed one
    mask while more were masked)."""
    cfg = model.config
    M, stops = cfg.mask_token_id, cfg.stop_ids
    fwd = _plain_forward(model)
    P = len(prompt)
    nb = -(-(P + G) // B)
    x = list(prompt) + [M] * (nb * B - P)
    sched = [B // steps + (1 if s < B % steps else 0) for s in range(steps)]
    nfe = commits = bound_binds = 0
    for b in range(P // B, nb):
        s, e = b * B, (b + 1) * B
        for step in range(steps + 1):
            masked = [i for i in range(s, e) if x[i] == M]
            if not masked:
                break
            assert step < steps, "the reference's step loop (steps + 1 forwards) would end with masks left"
            logits = np.asarray(fwd(model.params, jnp.asarray([x[:e]], jnp.int32)))[0, s:e].astype(np.float64)
            nfe += 1
            q = np.exp(logits - logits.max(-1, keepdims=True))
            q /= q.sum(-1, keepdims=True)
            v = logits.argmax(-1)
            if strategy == "sequential":
                first = min(masked)
                chosen = list(range(first, min(first + sched[step], e)))
                assert all(i in masked for i in chosen)  # the masks are a suffix of the block
            else:
                H = -(np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0)).sum(-1)
                order = sorted(masked, key=lambda i: (H[i - s], i))
                cum = np.cumsum([H[i - s] for i in order])
                k = int(np.sum(cum < eb))
                k = max(1, min(k, len(masked)))
                chosen = order[:k]
                bound_binds += k == 1 and len(masked) > 1
            for i in chosen:
                assert v[i - s] != M
                x[i] = int(v[i - s])
            commits += len(chosen)
        if any(t in stops for t in x[P:e]):
            break
    gen = x[P:P + G]
    cut = next((i for i, t in enumerate(gen) if t in stops), len(gen))
    return gen[:cut], nfe, commits, bound_binds


CASES = [("sequential", 4, None), ("sequential", 2, None), ("entropy_bounded", 4, 1.0)]


@pytest.mark.parametrize("strategy,steps,eb", CASES, ids=["sequential", "sequential-2-per-step", "entropy_bounded"])
def test_remasking_matches_host_loop_reference(model, strategy, steps, eb):
    cfg = model.config
    kw = dict(eb_threshold=eb) if eb is not None else {}
    p = SamplingParams(gen_length=G, block_length=cfg.block_size, cache="block", strategy=strategy, steps=steps, **kw)
    r = generate(model, PROMPTS, p)
    commits_total = nfe_total = binds = 0
    for i, prompt in enumerate(PROMPTS):
        want, nfe, commits, bb = reference_remask_generate(model, prompt, cfg.block_size, G, steps, strategy,
                                                            eb or 0.35)
        assert r.token_ids[i] == want, f"prompt {i}"
        assert r.nfe[i] == nfe, f"prompt {i}: {r.nfe[i]} forwards, reference {nfe}"
        commits_total, nfe_total, binds = commits_total + commits, nfe_total + nfe, binds + bb
    if strategy == "entropy_bounded":
        assert commits_total > nfe_total, "the bound never let more than one mask through: raise eb"
        assert binds, "the bound never held a step to one mask: lower eb"
        # The bound matters: a tiny one (one mask per step, the lowest entropy first) decodes otherwise.
        one = generate(model, PROMPTS, dataclasses.replace(p, eb_threshold=1e-3))
        assert one.token_ids != r.token_ids and sum(one.nfe) > sum(r.nfe)
    # The same prompts under SDAR's default rule (low_confidence_dynamic at 0.85, 4 steps) decode
    # differently (tokens or forwards), so this test can tell the strategies apart.
    dyn = generate(model, PROMPTS, SamplingParams(gen_length=G, block_length=cfg.block_size, cache="block", steps=4,
                                                  threshold=0.85))
    assert (dyn.token_ids, dyn.nfe) != (r.token_ids, r.nfe)
    print(f"SDAR {strategy} steps={steps}: nfe {r.nfe} (low_confidence_dynamic 0.85: {dyn.nfe}); "
          f"tokens equal to dynamic: {[a == b for a, b in zip(r.token_ids, dyn.token_ids)]}")


def test_entropy_bounded_evaluation_sampler_is_greedy(model):
    """temperature 1, top_k 1 with confidence_before_filter: the entropy comes from the plain softmax
    (before the top-k filter), so this decodes exactly as temperature 0."""
    cfg = model.config
    p = SamplingParams(gen_length=G, block_length=cfg.block_size, cache="block", strategy="entropy_bounded", steps=4,
                       eb_threshold=1.0)
    r0 = generate(model, PROMPTS, p)
    r1 = generate(model, PROMPTS, dataclasses.replace(p, temperature=1.0, top_k=1, confidence_before_filter=True))
    assert (r1.token_ids, r1.nfe) == (r0.token_ids, r0.nfe)


# ------------------------------------------------------------------------------------ exact rules
@pytest.mark.smoke
def test_entropy_bounded_comparisons_on_hand_built_entropies():
    m = jnp.asarray([[True, True, True, True]])
    one = jnp.ones((1,), jnp.int32)
    pick = lambda h, bound, n=one, mask=m: np.asarray(entropy_bounded_transfer(
        jnp.asarray([h], jnp.float32), mask, jnp.asarray([bound], jnp.float32), n))[0].tolist()
    # sorted 0.25, 0.5, 1.0, 2.0 -> running sums 0.25, 0.75, 1.75, 3.75
    h = [1.0, 0.25, 2.0, 0.5]
    assert pick(h, 0.8) == [False, True, False, True]
    assert pick(h, 0.75) == [False, True, False, False]  # a sum equal to the bound is not below it
    assert pick(h, 1.76) == [True, True, False, True]
    assert pick(h, 100.0) == [True, True, True, True]  # at most every mask
    assert pick(h, 0.1) == [False, True, False, False]  # at least one (the lowest entropy)
    assert pick(h, 0.1, jnp.asarray([3], jnp.int32)) == [True, True, False, True]  # at least n
    # Only masked positions count, and in the running sum only theirs; ties go to the lower position.
    mask = jnp.asarray([[False, True, True, True]])
    assert pick([0.0, 0.5, 0.5, 0.5], 0.6, mask=mask) == [False, True, False, False]
    assert pick([0.0, 0.5, 0.5, 0.5], 1.01, mask=mask) == [False, True, True, False]


@pytest.mark.smoke
def test_sequential_takes_the_leftmost_masks():
    mask = jnp.asarray([[False, True, True, True], [True, False, True, True], [False, False, False, True]])
    got = np.asarray(sequential_transfer(mask, jnp.asarray([2, 2, 3], jnp.int32))).tolist()
    assert got == [[False, True, True, False], [True, False, True, False], [False, False, False, True]]


@pytest.mark.smoke
def test_entropy_of_the_sampling_distribution():
    logits = jnp.asarray([[[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 2.9, 0.1]]])
    q = np.exp(np.asarray(logits[0], np.float64))
    q /= q.sum(-1, keepdims=True)
    want = -(q * np.log(q)).sum(-1)
    np.testing.assert_allclose(np.asarray(entropy(logits))[0], want, rtol=1e-5)
    # Filtered-out (-inf) entries contribute 0: top_k 1 -> a one-hot distribution, entropy 0.
    key = jax.vmap(jax.random.key)(jnp.arange(1, dtype=jnp.uint32))
    knobs = row_knobs(1, temperature=jnp.ones(1), top_k=jnp.ones(1), top_p=jnp.ones(1),
                      confidence_before_filter=jnp.zeros(1))
    _, _, h = sample_tokens(logits, knobs, key, with_entropy=True)
    np.testing.assert_allclose(np.asarray(h), 0.0, atol=1e-6)
    _, _, h = sample_tokens(logits, knobs.replace(confidence_before_filter=jnp.ones(1)), key, with_entropy=True)
    np.testing.assert_allclose(np.asarray(h)[0], want, rtol=1e-5)  # before the filter: softmax(l / 1)
    greedy = knobs.replace(temperature=jnp.zeros(1))  # temperature 0: the plain softmax
    _, _, h = sample_tokens(logits, greedy, key, with_entropy=True)
    np.testing.assert_allclose(np.asarray(h)[0], want, rtol=1e-5)


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.smoke
@pytest.mark.parametrize("kw,field,msg", [
    (dict(strategy="entropy_bounded", eb_threshold=0.0), "eb_threshold", r"eb_threshold=0.0 must be in \(0.0, 1e\+06\]"),
    (dict(strategy="entropy_bounded", eb_threshold=-1.0), "eb_threshold", r"must be in \(0.0, 1e\+06\]"),
    (dict(strategy="entropy_bounded", eb_threshold=float("nan")), "eb_threshold", r"must be in \(0.0, 1e\+06\]"),
    (dict(strategy="entropy_bounded", eb_threshold="0.5"), "eb_threshold", "must be a number"),
    (dict(strategy="entropy_bounded", eb_threshold=True), "eb_threshold", "must be a number"),
    (dict(strategy="lowest_entropy"), "strategy", "is not one of"),
])
def test_bad_fields_name_the_field(kw, field, msg):
    with pytest.raises(InvalidParam, match=msg) as e:
        SamplingParams(gen_length=8, block_length=4, cache="block", **kw)
    assert e.value.field == field


@pytest.mark.smoke
@pytest.mark.parametrize("kw,field,msg", [
    (dict(strategy="sequential", cache="dual"), "strategy", "applies to block diffusion only"),
    (dict(strategy="entropy_bounded", cache="none"), "strategy", "applies to block diffusion only"),
    (dict(strategy="threshold", cache="block", eb_threshold=0.5), "eb_threshold", "applies to strategy 'entropy_b"),
    (dict(strategy="sequential", cache="block", eb_threshold=0.5), "eb_threshold", "applies to strategy 'entropy_b"),
    (dict(strategy="entropy_bounded", cache="block", editing_threshold=0.5), "editing_threshold", "does not combine"),
    (dict(strategy="sequential", cache="block", sub_block_length=2), "sub_block_length", "does not combine"),
    (dict(strategy="factor", cache="block"), "strategy", "'sequential' or 'entropy_bounded'"),
])
def test_bad_combinations_name_the_field(kw, field, msg):
    with pytest.raises(InvalidParam, match=msg) as e:
        SamplingParams(gen_length=8, block_length=4, **kw).validate()
    assert e.value.field == field


@pytest.mark.smoke
def test_decode_spec_refuses_them_off_the_block_loop():
    from dinfer_jax.decoding.spec import DecodeSpec
    with pytest.raises(ValueError, match="strategy 'sequential' needs cache='block'"):
        DecodeSpec(gen_length=8, block_length=4, strategy="sequential", cache="dual")
    with pytest.raises(ValueError, match="does not combine with editing"):
        DecodeSpec(gen_length=8, block_length=4, strategy="entropy_bounded", cache="block", editing=True)
    spec = SamplingParams(gen_length=8, block_length=4, cache="block", strategy="entropy_bounded",
                          eb_threshold=0.5).spec(127, 126)
    assert spec.strategy == "entropy_bounded"


@pytest.mark.smoke
def test_cli_flag_and_server_field():
    import argparse

    from dinfer_jax import cli
    ap = argparse.ArgumentParser()
    cli._add_decoding_flags(ap)
    a = ap.parse_args(["--cache", "block", "--strategy", "entropy_bounded", "--eb-threshold", "0.5"])
    assert a.strategy == "entropy_bounded" and cli._explicit_flags(a)["eb_threshold"] == 0.5
    assert "eb_threshold" not in cli._explicit_flags(ap.parse_args([]))
    assert ap.parse_args(["--strategy", "sequential"]).strategy == "sequential"
    pytest.importorskip("pydantic")
    from dinfer_jax.serving.http import DinferFields
    from dinfer_jax.serving.scheduler import derive_params
    f = DinferFields(strategy="entropy_bounded", eb_threshold=0.5, cache="block")
    upd = {k: getattr(f, k) for k in DinferFields.model_fields if getattr(f, k) is not None}
    p = derive_params(SamplingParams(block_length=4), upd, 8)
    assert (p.strategy, p.eb_threshold, p.cache, p.gen_length) == ("entropy_bounded", 0.5, "block", 8)
    assert DinferFields(strategy="sequential").strategy == "sequential"
    with pytest.raises(InvalidParam, match="eb_threshold") as e:  # the server answers 400 naming the field
        derive_params(SamplingParams(block_length=4), {**upd, "eb_threshold": 0.0}, 8)
    assert e.value.field == "eb_threshold"


def test_server_request_decodes_as_generate(model):
    """/v1/completions with strategy "entropy_bounded" and eb_threshold (body fields) through the
    default (continuous) scheduler gives generate()'s tokens; a bad bound answers 400 naming it."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dinfer_jax.serving.scheduler import ServerConfig

    from dinfer_jax.serving.http import create_app
    p = SamplingParams(gen_length=G, block_length=4, cache="block", strategy="entropy_bounded", steps=4,
                       eb_threshold=1.0)
    want = generate(model, [PROMPTS[0]], p)
    body = dict(prompt=PROMPTS[0], max_tokens=G, block_length=4, cache="block", steps=4, strategy="entropy_bounded",
                eb_threshold=1.0)
    app = create_app(model, None, ServerConfig(model_name="tiny-sdar", max_tokens=64, max_batch=4, batch_wait_s=0.0))
    with TestClient(app) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want.token_ids[0]
        r = c.post("/v1/completions", json={**body, "eb_threshold": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "eb_threshold", r.text
        r = c.post("/v1/completions", json={**body, "cache": "dual"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "strategy", r.text
