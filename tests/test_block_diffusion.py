"""Block diffusion (cache="block"): the jitted loop vs the slow no-cache host-loop reference of
LLaDA2's generate() (tests/block_decoding_reference.py) token for token and in forwards, with and
without LLaDA2.1 editing, batch 1 and mixed-length batches; the exact prefix cache; the decoder
on hand-built logits; and that a step's cost does not grow with the generation length."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from block_decoding_reference import reference_block_generate, reference_indel_generate

from dinfer_jax.cache import cache_shape
from dinfer_jax.families import preset
from dinfer_jax.decoding.block_strategies import block_decide, indel_rebuild, indel_step
from dinfer_jax.decoding.loop_state import IndelState
from dinfer_jax.engine import SamplingParams, generate
from dinfer_jax.model import Model
from dinfer_jax.models import init_params
from knobs_helper import row_knobs  # noqa: E402

CFG = preset("tiny-llada2")
PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 2], [60, 61, 62, 63, 64, 65, 66, 67, 68]]


@pytest.fixture(scope="module")
def model():
    # A random model is peaky enough at std 0.1 for threshold decoding to commit several tokens a step.
    cfg = CFG
    from demo_helpers import peaky_random_params
    params = peaky_random_params(cfg, seed=11)
    return Model(cfg, params)


def _gen(tokens_row):
    return tokens_row


SETTINGS = [
    dict(threshold=0.3),
    dict(threshold=0.5, num_to_transfer=2),
    dict(threshold=0.3, editing_threshold=0.3, max_post_steps=3),
    dict(threshold=0.2, editing_threshold=0.0, max_post_steps=2),  # edits every changed token: hits the bound
    dict(threshold=0.9, steps=3),  # LLaDA2.0's schedule: 3, 3, 2 tokens per step of an 8-token block
]


@pytest.mark.parametrize("kw", SETTINGS, ids=["m2t", "m2t-n2", "edit", "edit-bound", "steps-schedule"])
def test_loop_matches_no_cache_reference(model, kw):
    p = SamplingParams(gen_length=16, block_length=8, cache="block", **kw)
    r = generate(model, PROMPTS, p)
    for i, prompt in enumerate(PROMPTS):
        want, nfe, edits = reference_block_generate(model, prompt, p)
        ours = r.raw_ids[i].tolist()
        if CFG.eos_token_id in want:
            ours = ours[:len(want)]
        assert ours == want, f"prompt {i}"
        assert r.nfe[i] == nfe, f"prompt {i}: {r.nfe[i]} forwards, reference {nfe}"
        if p.editing_threshold is not None:
            assert r.edits[i] == edits, f"prompt {i}"
    one = generate(model, [PROMPTS[1]], p)  # batch invariance: alone == inside the batch
    assert one.raw_ids[0].tolist() == r.raw_ids[1].tolist() and one.nfe[0] == r.nfe[1]


def test_editing_happens_and_is_counted(model):
    p = SamplingParams(gen_length=16, block_length=8, cache="block", threshold=0.2, editing_threshold=0.0,
                       max_post_steps=2)
    r = generate(model, PROMPTS, p)
    assert sum(r.edits) > 0
    # Each block: at most max_post_steps post-fill forwards after its last mask is filled.
    plain = generate(model, PROMPTS, SamplingParams(gen_length=16, block_length=8, cache="block", threshold=0.2))
    assert (r.steps_per_block <= plain.steps_per_block + 2 + 8).all()


def test_edit_threshold_one_costs_one_post_fill_forward_per_block(model):
    """editing_threshold 1.0 never edits (p <= 1): every block ends after exactly one post-fill
    forward, so each block takes one step more than without editing and the tokens are the same."""
    base = dict(gen_length=16, block_length=8, cache="block", threshold=0.3)
    a = generate(model, PROMPTS, SamplingParams(**base))
    b = generate(model, PROMPTS, SamplingParams(**base, editing_threshold=1.0))
    assert a.raw_ids.tolist() == b.raw_ids.tolist() and b.edits == [0, 0, 0]
    used = a.steps_per_block > 0
    np.testing.assert_array_equal(b.steps_per_block[used], a.steps_per_block[used] + 1)


def test_block_decide_on_hand_built_logits():
    """M2T threshold / fallback count, T2T above vs below the edit threshold, prompt never edited."""
    M, V = 9, 10
    x = jnp.asarray([[3, M, M, 4, 5, M]])
    editable = jnp.asarray([[False, True, True, True, True, True]])  # position 0 is prompt
    logits = np.zeros((1, 6, V), np.float32)  # unsure rows: p(best) = e^a / (e^a + 9), about 0.14..0.23
    logits[0, [0, 1, 3]] = -10.0
    logits[0, 0, 7] = 10.0  # prompt position: a confident other token, must not be edited
    logits[0, 1, 1] = 10.0  # mask, confident -> committed
    logits[0, 2, 2] = 0.5   # mask, unsure (p 0.155) -> not committed while another mask is confident
    logits[0, 3, 6] = 10.0  # filled 4, confident 6 -> edited
    logits[0, 4, 8] = 1.0   # filled 5, unsure 8 (p 0.23) -> kept
    logits[0, 5, 0] = 0.4   # mask, unsure (p 0.142)
    knobs = row_knobs(1, temperature=jnp.zeros(1), top_k=jnp.zeros(1), top_p=jnp.ones(1),
                      threshold=jnp.full(1, 0.9), num_to_transfer=jnp.ones(1), editing_threshold=jnp.full(1, 0.8))
    keys = jax.random.split(jax.random.key(0), 1)
    new, m2t, t2t = block_decide(jnp.asarray(logits), x, editable, M, knobs, keys, editing=True)
    assert new.tolist() == [[3, 1, M, 6, 5, M]] and t2t.tolist() == [[False, False, False, True, False, False]]
    new, _, t2t = block_decide(jnp.asarray(logits), x, editable, M, knobs, keys, editing=False)
    assert new.tolist() == [[3, 1, M, 4, 5, M]] and not t2t.any()
    # No mask above the threshold: the num_to_transfer most probable masks are committed anyway.
    knobs = knobs.replace(threshold=jnp.full(1, 0.9999), num_to_transfer=jnp.full(1, 2.0))
    new, m2t, _ = block_decide(jnp.asarray(logits), x, editable, M, knobs, keys, editing=False)
    assert m2t.tolist() == [[False, True, True, False, False, False]]


def test_prefill_and_commit_windows_are_exact(model):
    """The loop's cache recipe: prefill the prompt region, then a 2B window [block k-1 | block k]
    over the cache: block k's logits equal a full block-causal forward's (fp32, <= 1e-5 rel)."""
    m, p = model.module.clone(attention_block=8), model.params
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 120, (2, 40)))
    full, _ = m.apply({"params": p}, ids)
    pos = jnp.broadcast_to(jnp.arange(40), (2, 40))
    _, kv_pre = m.apply({"params": p}, ids[:, :16])
    kv = tuple(jnp.zeros(cache_shape(CFG.num_layers, 2, 40, CFG.num_kv_heads, CFG.head_dim)).at[:, :, :16].set(t)
               for t in kv_pre)
    win, kv2 = m.apply({"params": p}, ids[:, 16:32], positions_BS=pos[:, 16:32], kv=kv, window_start=16,
                       key_positions_BL=pos)
    rel = float(jnp.abs(win[:, 8:] - full[:, 24:32]).max() / jnp.abs(full).max())
    assert rel <= 1e-5
    win3, _ = m.apply({"params": p}, ids[:, 32:40], positions_BS=pos[:, 32:40], kv=kv2, window_start=32,
                      key_positions_BL=pos)
    assert float(jnp.abs(win3 - full[:, 32:40]).max() / jnp.abs(full).max()) <= 1e-5


def _body_flops(model, gen_length, cache):
    p = SamplingParams(gen_length=gen_length, block_length=8, cache=cache, threshold=0.3)
    compiled = model.generator.lower([PROMPTS[0]], p).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca["flops"])


def test_step_cost_does_not_grow_with_generation_length(model):
    """XLA's cost analysis counts a while body once: for cache="block" the program's flops barely
    move from gen 16 to gen 128 (only attention over the longer prefix grows); the full-canvas
    dual cache (a full refresh in the body) grows with the canvas."""
    block = _body_flops(model, 128, "block") / _body_flops(model, 16, "block")
    dual = _body_flops(model, 128, "dual") / _body_flops(model, 16, "dual")
    print(f"program flops gen 128 / gen 16: block {block:.3f}, dual {dual:.3f}")
    assert block < 1.5 and dual > 2.5, (block, dual)


def test_block_mode_needs_a_block_causal_model():
    cfg = preset("tiny")
    m = Model(cfg, init_params(cfg))
    with pytest.raises(ValueError, match="needs a block-causal model"):
        generate(m, [[1, 2, 3]], SamplingParams(gen_length=8, block_length=8, cache="block"))
    with pytest.raises(ValueError, match="editing"):
        SamplingParams(gen_length=8, block_length=8, cache="dual", editing_threshold=0.5).spec(1, 2)
    with pytest.raises(ValueError, match="strategy 'threshold'"):
        SamplingParams(gen_length=8, block_length=8, cache="block", strategy="credit").spec(1, 2)


def test_canvas_view_shows_edits(model):
    import io

    from dinfer_jax.canvas_view import CanvasView
    view = CanvasView(CFG.mask_token_id, {CFG.eos_token_id}, stream=io.StringIO(), force=True)
    p = SamplingParams(gen_length=16, block_length=8, cache="block", threshold=0.2, editing_threshold=0.0,
                       max_post_steps=2)
    prompt = PROMPTS[2][:8]  # P + G = 24 = 3 blocks: no tail past the generation region, all edits visible
    r = generate(model, [prompt], p, observer=view)
    assert r.edits[0] > 0 and view.edits == r.edits[0] and view.steps == r.nfe[0]
    assert "edited" in view.stream.getvalue() and "\x1b[1;33m" in view.stream.getvalue()


def test_block_knobs_through_cli_and_server_names(tmp_path):
    """The peers' knob names reach SamplingParams from the CLI flags and the server body; the
    edit-mode presets; knobs of this mode are refused (naming the field) with another cache."""
    import argparse

    from dinfer_jax import cli
    from dinfer_jax.decoding.spec import EDIT_MODES, InvalidParam
    p = argparse.ArgumentParser()
    cli._add_decoding_flags(p)
    a = p.parse_args(["--cache", "block", "--edit-mode", "quality", "--max-post-steps", "4"])
    assert cli._explicit_flags(a) == dict(EDIT_MODES["quality"], max_post_steps=4, cache="block")
    a = p.parse_args(["--cache", "block", "--edit-mode", "speed", "--threshold", "0.6", "--editing-threshold", "0.1",
                      "--num-to-transfer", "2", "--top-k", "5", "--top-p", "0.9"])
    assert cli._explicit_flags(a) == dict(threshold=0.6, editing_threshold=0.1, max_post_steps=16, num_to_transfer=2,
                                          top_k=5, top_p=0.9, cache="block")
    assert cli._explicit_flags(p.parse_args([])) == {}  # the rest: the model's defaults (SamplingParams.for_model)
    with pytest.raises(InvalidParam, match="editing_threshold=0.5 applies to block diffusion only") as e:
        SamplingParams(cache="dual", editing_threshold=0.5).validate()
    assert e.value.field == "editing_threshold"
    with pytest.raises(InvalidParam, match="top_p"):
        SamplingParams(cache="none", top_p=0.5).validate()
    with pytest.raises(InvalidParam, match="editing_threshold"):
        SamplingParams(cache="block", editing_threshold=1.5)
    from dinfer_jax.serving.http import DinferFields
    assert {"editing_threshold", "max_post_steps", "num_to_transfer", "top_k"} <= set(DinferFields.model_fields)


def test_server_block_diffusion_request(model):
    """/v1/completions with the block-diffusion body fields gives generate()'s tokens; a block-only
    knob with another cache answers 400 naming it."""
    from fastapi.testclient import TestClient

    from dinfer_jax.serving.scheduler import ServerConfig

    from dinfer_jax.serving.http import create_app
    body = dict(prompt=PROMPTS[0], max_tokens=16, block_length=8, cache="block", threshold=0.3,
                editing_threshold=0.3, max_post_steps=3)
    want = generate(model, [PROMPTS[0]], SamplingParams(gen_length=16, block_length=8, cache="block", threshold=0.3,
                                                         editing_threshold=0.3, max_post_steps=3))
    app = create_app(model, None, ServerConfig(model_name="tiny-llada2", max_tokens=64, max_batch=4, batch_wait_s=0.0))
    with TestClient(app) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want.token_ids[0]
        r = c.post("/v1/completions", json={**body, "cache": "dual"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "editing_threshold"


def test_llada2_0_transfer_schedule_and_its_limits():
    """reference §5.1: B // steps per step, the first B % steps steps one more; steps > B: one per
    step for B steps. `steps` does not combine with editing (LLaDA2.1 has no schedule)."""
    from dinfer_jax.decoding.block_strategies import transfer_schedule
    from dinfer_jax.engine import InvalidParam
    sched = lambda B, steps: np.asarray(transfer_schedule(jnp.arange(steps), B, steps)).tolist()  # noqa: E731
    assert sched(8, 3) == [3, 3, 2]
    assert sched(8, 8) == [1] * 8 and sched(8, 1)[0] == 8
    assert sched(4, 6) == [1, 1, 1, 1, 0, 0]
    assert sum(sched(32, 5)) == 32
    with pytest.raises(InvalidParam) as e:
        SamplingParams(gen_length=16, block_length=8, cache="block", steps=4, editing_threshold=0.5).validate()
    assert e.value.field == "steps"


# LLaDA2.2 insert/delete editing (indel). The tiny preset declares no edit-control tokens: give it two
# ids inside its vocabulary, and scale their lm_head columns (and the mask id's) so a random model
# predicts them now and then (without that it never emits DELETE/SPLIT, nor MASK at a mask, and the
# comparison could not fail).
DEL, SPL = 124, 125


@pytest.fixture(scope="module")
def indel_model(model):
    import dataclasses
    cfg = dataclasses.replace(CFG, extra_token_ids=(("delete_token_id", DEL), ("split_token_id", SPL)))
    head = model.params["lm_head"]["unembedding"].at[np.array([DEL, SPL, CFG.mask_token_id])].multiply(3.0)
    return Model(cfg, dict(model.params, lm_head={"unembedding": head}))


INDEL_SETTINGS = [
    dict(threshold=0.3, editing_threshold=0.3, max_post_steps=3),  # inserts, deletes, anti-loop, cleanups
    dict(threshold=0.5, max_post_steps=0),  # edit threshold 0 (SGLang's default); no post-edit rounds
]


@pytest.mark.parametrize("kw", INDEL_SETTINGS, ids=["indel", "indel-post0"])
def test_indel_loop_matches_no_cache_reference(indel_model, kw):
    p = SamplingParams(gen_length=16, block_length=8, cache="block", indel=True, **kw)
    r = generate(indel_model, PROMPTS, p)  # a mixed-length batch
    total = dict(inserts=0, deletes=0, antiloop=0, cleanups=0)
    for i, prompt in enumerate(PROMPTS):
        want, nfe, cnt = reference_indel_generate(indel_model, prompt, p, DEL, SPL)
        ours = r.raw_ids[i].tolist()
        if CFG.eos_token_id in want:
            ours = ours[:len(want)]
        assert ours == want, f"prompt {i}"
        assert r.nfe[i] == nfe, f"prompt {i}: {r.nfe[i]} forwards, reference {nfe}"
        assert (r.edits[i], r.inserts[i], r.deletes[i]) == (cnt["edits"], cnt["inserts"], cnt["deletes"]), i
        total = {k: total[k] + cnt[k] for k in total}
    # The rules under test really ran (else the comparison could not fail).
    assert total["inserts"] > 0 and total["deletes"] > 0 and total["cleanups"] > 0, total
    if kw["max_post_steps"]:
        assert total["antiloop"] > 0, total
    else:  # batch 1: alone == inside the batch == the reference
        one = generate(indel_model, [PROMPTS[2]], p)
        assert one.raw_ids[0].tolist() == r.raw_ids[2].tolist() and one.nfe[0] == r.nfe[2]


def test_indel_rebuild_on_hand_built_blocks():
    """DELETE drops its slot (masks pad the tail), SPLIT emits a new mask then the OLD token, the
    result is cut at the block length, the prompt prefix is copied, original-mask flags travel."""
    M, D, S = 9, 7, 8
    gen = jnp.asarray([[False, True, True, True, True, True]])  # slot 0 is prompt
    x = jnp.asarray([[1, 2, M, 3, M, 4]])
    orig = jnp.asarray([[False, False, True, False, True, False]])

    def rb(y):
        t, f = indel_rebuild(jnp.asarray([y]), x, orig, gen, M, D, S)
        return t[0].tolist(), f[0].astype(int).tolist()

    assert rb([1, 2, 5, 3, M, 4]) == ([1, 2, 5, 3, M, 4], [0, 0, 1, 0, 1, 0])  # no control token: identity
    assert rb([1, D, 5, D, M, 4]) == ([1, 5, M, 4, M, M], [0, 1, 1, 0, 0, 0])  # deletes, padded with masks
    assert rb([1, 2, S, 3, M, 4]) == ([1, 2, M, M, 3, M], [0, 0, 0, 1, 0, 1])  # split at a mask: new + old mask
    assert rb([1, S, 5, D, S, 4]) == ([1, M, 2, 5, M, M], [0, 0, 0, 1, 0, 1])  # split, delete, cut at the tail
    assert rb([D, 2, 5, 3, M, 4])[0] == [D, 2, 5, 3, M, 4]  # prompt slots never act


def _indel_state(H, S, B=1):
    return IndelState(orig=jnp.zeros((B, S), bool), seen=jnp.zeros((B, H, S), jnp.int32),
                      hist=jnp.zeros((B, H, S), jnp.int32))


def test_indel_step_on_hand_built_logits():
    """Original masks never take the mask id; M2T takes 1 + #introduced masks; the cleanup writes no
    MASK/DELETE/SPLIT; the anti-loop re-picks the least confident change among untried tokens."""
    from dinfer_jax.decoding.spec import DecodeSpec
    M, D, S, V = 9, 7, 8, 10
    spec = DecodeSpec(gen_length=8, block_length=4, cache="block", mask_id=M, eos_id=0, indel=True, max_post_steps=2)
    knobs = row_knobs(1, threshold=jnp.full(1, 0.9), editing_threshold=jnp.full(1, 0.9), num_to_transfer=jnp.ones(1))
    gen = jnp.ones((1, 4), bool)
    lg = np.full((1, 4, V), -5.0, np.float32)
    lg[0, 0, M], lg[0, 0, 3] = 4.0, 2.0   # original mask predicting MASK -> its next best, 3 (p ~ 0.1)
    lg[0, 1, 5] = 1.0                     # original mask, 5 (p 0.98)
    lg[0, 2, 6] = 3.0                     # filled 6, agrees
    lg[0, 3, D] = 9.0                     # filled 4, confident DELETE -> edited, the block rebuilt
    x = jnp.asarray([[M, M, 6, 4]])
    st = _indel_state(7, 4)
    step = lambda x, stp, post, st, sp=spec: indel_step(jnp.asarray(lg), x, gen, jnp.asarray([stp]),
                                                        jnp.asarray([post]), st, knobs, sp, D, S)
    new, fin, post, st2, t2t, ins, dels = step(x, 0, 0, st)
    # M2T: slot 1 (above 0.9); T2T: slot 3 takes DELETE -> dropped, a mask pads the tail.
    assert new.tolist() == [[M, 5, 6, M]] and dels.tolist() == [1] and not fin[0] and post.tolist() == [0]
    assert st2.orig.tolist() == [[True, True, False, False]]  # the padding mask is not original
    # Next step: 1 original + 1 introduced mask -> 2 transfers although only one is above 0.9 (the
    # introduced mask predicting MASK keeps it; the original one takes its re-argmax 3).
    lg[0, 3] = -5.0
    lg[0, 3, M] = 4.0
    lg[0, 1, 5] = 6.0
    new, fin, _, st3, _, _, _ = step(new, 1, 0, st2)
    assert new.tolist() == [[3, 5, 6, M]] and not fin[0]
    # Only introduced masks left: a post-edit round fills all of them; its budget runs out at 2 ->
    # the cleanup: MASK/DELETE/SPLIT predictions take the best other token, and the block ends.
    lg[0, 0, D] = 9.0
    new, fin, post, _, t2t, _, dels = step(new, 2, 1, st3)
    assert post.tolist() == [2] and fin[0] and dels.tolist() == [0]
    assert new.tolist() == [[3, 5, 6, 0]] and t2t.tolist() == [[True, False, False, False]]  # 0: first of the -5s
    # Anti-loop: this block state was seen at step 0 and 4 was already written at slot 3; the least
    # confident changing slot (3) takes its best untried token instead.
    lg2 = np.full((1, 4, V), -5.0, np.float32)
    lg2[0, :, 2] = 5.0
    lg2[0, 3, 4], lg2[0, 3, 2], lg2[0, 3, 1] = 2.0, 1.5, 1.0
    x = jnp.asarray([[2, 2, 2, 1]])
    st = _indel_state(7, 4)
    st = st.replace(seen=st.seen.at[0, 0].set(x[0]), hist=st.hist.at[0, 0].set(jnp.asarray([-1, -1, -1, 4])))
    knobs = knobs.replace(editing_threshold=jnp.zeros(1))
    new, fin, _, st4, _, _, _ = indel_step(jnp.asarray(lg2), x, gen, jnp.asarray([1]), jnp.asarray([0]), st, knobs,
                                           spec, D, S)
    assert new.tolist() == [[2, 2, 2, 2]] and not fin[0]  # argmax 4 was tried: the next best, 2
    assert st4.hist[0, 1].tolist() == [-1, -1, -1, 2] and st4.seen[0, 1].tolist() == [2, 2, 2, 1]
    new, *_ = indel_step(jnp.asarray(lg2), x, gen, jnp.asarray([1]), jnp.asarray([0]), _indel_state(7, 4), knobs,
                         spec, D, S)
    assert new.tolist() == [[2, 2, 2, 4]]  # not seen before: the argmax
    # A block with no mask and no edit above the threshold writes nothing and ends unchanged.
    knobs = knobs.replace(editing_threshold=jnp.full(1, 0.99))
    new, fin, *_ = indel_step(jnp.asarray(lg2), x, gen, jnp.asarray([1]), jnp.asarray([0]), _indel_state(7, 4),
                              knobs, spec, D, S)
    assert new.tolist() == x.tolist() and fin[0]
    # The step bound: update step B + max_post_steps + 1 is the cleanup even with original masks left.
    xm = jnp.asarray([[2, M, M, 2]])
    st = _indel_state(7, 4)
    st = st.replace(orig=jnp.asarray([[False, True, True, False]]))
    new, fin, *_ = indel_step(jnp.asarray(lg2), xm, gen, jnp.asarray([6]), jnp.asarray([0]), st, knobs, spec, D, S)
    assert new.tolist() == [[2, 2, 2, 2]] and fin[0]
    new, fin, *_ = indel_step(jnp.asarray(lg2), xm, gen, jnp.asarray([5]), jnp.asarray([0]), st, knobs, spec, D, S)
    assert not fin[0]


def test_indel_validation(model, indel_model):
    """indel needs cache='block', greedy decoding and a model declaring both edit-control ids."""
    from dinfer_jax.engine import InvalidParam
    with pytest.raises(InvalidParam, match="block diffusion only") as e:
        SamplingParams(cache="dual", indel=True).validate()
    assert e.value.field == "indel"
    with pytest.raises(InvalidParam, match="greedily") as e:
        SamplingParams(gen_length=8, block_length=8, cache="block", indel=True, temperature=0.5).validate()
    assert e.value.field == "temperature"
    with pytest.raises(InvalidParam, match="does not combine with indel") as e:
        SamplingParams(gen_length=8, block_length=8, cache="block", indel=True, steps=4).validate()
    assert e.value.field == "steps"
    with pytest.raises(InvalidParam, match="delete_token_id and split_token_id") as e:
        generate(model, [[1, 2, 3]], SamplingParams(gen_length=8, block_length=8, cache="block", indel=True))
    assert e.value.field == "indel"
    with pytest.raises(InvalidParam, match="indel"):
        SamplingParams(indel=1)
    import argparse

    from dinfer_jax import cli
    from dinfer_jax.serving.http import DinferFields
    ap = argparse.ArgumentParser()
    cli._add_decoding_flags(ap)
    assert cli._explicit_flags(ap.parse_args(["--cache", "block", "--indel", "--edit-mode", "speed"])) == dict(
        threshold=0.5, editing_threshold=0.0, max_post_steps=16, indel=True, cache="block")
    assert "indel" not in cli._explicit_flags(ap.parse_args([])) and "indel" in DinferFields.model_fields
    assert cli._explicit_flags(ap.parse_args(["--cache", "block", "--confidence-before-filter"]))[
        "confidence_before_filter"] is True
    assert "confidence_before_filter" in DinferFields.model_fields
