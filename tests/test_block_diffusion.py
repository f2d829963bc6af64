"""Block diffusion (cache="block"): the jitted loop vs the slow no-cache host-loop reference of
LLaDA2's generate() (tests/block_decoding_reference.py) token for token and in forwards, with and
without LLaDA2.1 editing, batch 1 and mixed-length batches; the exact prefix cache; the decoder
on hand-built logits; and that a step's cost does not grow with the generation length."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from block_decoding_reference import reference_block_generate

from dinfer_jax.config import preset
from dinfer_jax.decoding.block_loop import block_decide
from dinfer_jax.engine import SamplingParams, generate
from dinfer_jax.model import Model
from dinfer_jax.models import init_params

CFG = preset("tiny-llada2")
PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 2], [60, 61, 62, 63, 64, 65, 66, 67, 68]]


@pytest.fixture(scope="module")
def model():
    # A random model is peaky enough at std 0.1 for threshold decoding to commit several tokens a step.
    cfg = CFG
    rng = np.random.default_rng(11)
    shapes = jax.eval_shape(lambda: init_params(cfg, seed=11))
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.asarray((1.0 + 0.1 * rng.standard_normal(a.shape)) if "norm" in jax.tree_util.keystr(path)
                                    else 0.15 * rng.standard_normal(a.shape), a.dtype), shapes)
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
    knobs = {"temperature": jnp.zeros(1), "top_k": jnp.zeros(1), "top_p": jnp.ones(1),
             "threshold": jnp.full(1, 0.9), "num_to_transfer": jnp.ones(1), "editing_threshold": jnp.full(1, 0.8)}
    keys = jax.random.split(jax.random.key(0), 1)
    new, m2t, t2t = block_decide(jnp.asarray(logits), x, editable, M, knobs, keys, editing=True)
    assert new.tolist() == [[3, 1, M, 6, 5, M]] and t2t.tolist() == [[False, False, False, True, False, False]]
    new, _, t2t = block_decide(jnp.asarray(logits), x, editable, M, knobs, keys, editing=False)
    assert new.tolist() == [[3, 1, M, 4, 5, M]] and not t2t.any()
    # No mask above the threshold: the num_to_transfer most probable masks are committed anyway.
    knobs["threshold"] = jnp.full(1, 0.9999)
    knobs["num_to_transfer"] = jnp.full(1, 2.0)
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
    kv = tuple(jnp.zeros((CFG.num_layers, 2, 40, CFG.num_kv_heads, CFG.head_dim)).at[:, :, :16].set(t) for t in kv_pre)
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
    from dinfer_jax.engine import EDIT_MODES, InvalidParam
    p = argparse.ArgumentParser()
    cli._add_decoding_flags(p)
    a = p.parse_args(["--cache", "block", "--edit-mode", "quality", "--max-post-steps", "4"])
    assert cli._block_flags(a) == dict(EDIT_MODES["quality"], max_post_steps=4)
    a = p.parse_args(["--cache", "block", "--edit-mode", "speed", "--threshold", "0.6", "--editing-threshold", "0.1",
                      "--num-to-transfer", "2", "--top-k", "5", "--top-p", "0.9"])
    assert cli._block_flags(a) == dict(threshold=0.6, editing_threshold=0.1, max_post_steps=16, num_to_transfer=2,
                                       top_k=5, top_p=0.9)
    assert cli._block_flags(p.parse_args([]))["threshold"] == 0.9
    with pytest.raises(InvalidParam, match="editing_threshold=0.5 applies to block diffusion only") as e:
        SamplingParams(cache="dual", editing_threshold=0.5).validate()
    assert e.value.field == "editing_threshold"
    with pytest.raises(InvalidParam, match="top_p"):
        SamplingParams(cache="none", top_p=0.5).validate()
    with pytest.raises(InvalidParam, match="editing_threshold"):
        SamplingParams(cache="block", editing_threshold=1.5)
    from dinfer_jax.server import DinferFields
    assert {"editing_threshold", "max_post_steps", "num_to_transfer", "top_k"} <= set(DinferFields.model_fields)


def test_server_block_diffusion_request(model):
    """/v1/completions with the block-diffusion body fields gives generate()'s tokens; a block-only
    knob with another cache answers 400 naming it."""
    from fastapi.testclient import TestClient

    from dinfer_jax.server import ServerConfig, create_app
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
    from dinfer_jax.decoding.block_loop import transfer_schedule
    from dinfer_jax.engine import InvalidParam
    sched = lambda B, steps: np.asarray(transfer_schedule(jnp.arange(steps), B, steps)).tolist()  # noqa: E731
    assert sched(8, 3) == [3, 3, 2]
    assert sched(8, 8) == [1] * 8 and sched(8, 1)[0] == 8
    assert sched(4, 6) == [1, 1, 1, 1, 0, 0]
    assert sum(sched(32, 5)) == 32
    with pytest.raises(InvalidParam) as e:
        SamplingParams(gen_length=16, block_length=8, cache="block", steps=4, editing_threshold=0.5).validate()
    assert e.value.field == "steps"
