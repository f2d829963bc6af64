"""Fast-dLLM v2 (Fast_dLLM_QwenForCausalLM, dinfer_jax/families/fast_dllm_v2.py): config, converters
both ways, logits parity with transformers' Qwen2ForCausalLM (Fast-dLLM v2's network is Qwen2's;
the block-causal mask is imposed as an explicit 4-D additive mask, eager attention), fp32,
max|diff| <= 1e-4 * max|ref logit| and identical argmax; and Fast-dLLM v2's sub-block threshold
decoder with shifted logits on our block loop (cache="block", sub_block_length) against a slow
host-loop reference written from the facts (no cache: a full block-causal forward over
[0, block end) at every step).
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.config import ConfigError
from dinfer_jax.families import from_hf_dict, load_hf_config, preset, to_hf_dict
from dinfer_jax.engine import InvalidParam, SamplingParams, generate

REL_TOL = 1e-4
CFG = preset("tiny-fast-dllm-v2")  # block 8, GQA 4/2, q/k/v biases, logit_shift 1
SUB = 4


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(torch reference, HF state dict, HF folder, our model loaded from that folder)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_reference import qwen2_reference, write_hf_folder
    from dinfer_jax import load_model
    ref = qwen2_reference(CFG, seed=31)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    d = str(tmp_path_factory.mktemp("fdllm2_hf"))
    write_hf_folder(d, CFG, sd)
    return ref, sd, d, load_model(d)


# ------------------------------------------------------------------------------------ config
@pytest.mark.smoke
def test_config_presets_and_family():
    from converters.mappings import table
    from dinfer_jax import families
    from dinfer_jax.chat import render
    hf = to_hf_dict(CFG)
    assert hf["architectures"] == ["Fast_dLLM_QwenForCausalLM"] and hf["bd_size"] == 8
    for name in ("fast-dllm-v2-7b", "fast-dllm-v2-1.5b", "tiny-fast-dllm-v2"):
        c = preset(name)
        assert from_hf_dict(to_hf_dict(c)) == c, name
        assert (c.logit_shift, c.attention_mask, c.qkv_bias, c.qk_norm) == (1, "block_causal", True, False)
    assert round(preset("fast-dllm-v2-7b").num_params / 1e9, 2) == 7.62  # Qwen2.5-7B: 7.61B
    assert round(preset("fast-dllm-v2-1.5b").num_params / 1e9, 2) == 1.54  # Qwen2.5-1.5B: 1.54B
    assert "lm_head.weight" not in {e.hf for e in table(preset("fast-dllm-v2-1.5b"))}  # tied
    assert "model.layers.{l}.self_attn.q_proj.bias" in {e.hf for e in table(CFG)}
    fam = families.by_architecture("Fast_dLLM_QwenForCausalLM")
    assert fam.name == "fast_dllm_v2" and fam.decoding["sub_block_length"] == 8
    text = render(fam.chat_template, [{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # Absent bd_size: the default 32; bad: named.
    assert from_hf_dict({k: v for k, v in to_hf_dict(preset("fast-dllm-v2-7b")).items() if k != "bd_size"}
                        ).block_size == 32
    with pytest.raises(ConfigError, match="bd_size=0"):
        from_hf_dict({**hf, "bd_size": 0})


@pytest.mark.smoke
def test_sub_block_length_validation_names_the_field():
    with pytest.raises(InvalidParam, match="sub_block_length=3 must divide block_length=8"):
        SamplingParams(gen_length=16, block_length=8, cache="block", sub_block_length=3).validate()
    with pytest.raises(InvalidParam, match="sub_block_length"):
        SamplingParams(gen_length=16, block_length=8, cache="dual", sub_block_length=4).validate()
    with pytest.raises(InvalidParam, match="sub_block_length"):
        SamplingParams(sub_block_length=-1)
    with pytest.raises(InvalidParam, match="steps"):
        SamplingParams(gen_length=16, block_length=8, cache="block", sub_block_length=4, steps=2).validate()


@pytest.mark.smoke
def test_sub_block_candidates_on_hand_built_masks():
    """The positions a step may commit: the masked first position alone (shifted logits), else the
    masks of the first sub-block holding one; rows independent."""
    from dinfer_jax.decoding.block_strategies import sub_block_candidates
    m = np.array([[1, 1, 1, 1, 1, 1, 1, 1],   # head masked -> only position 0
                  [0, 0, 1, 0, 1, 1, 0, 1],   # sub-block 0 holds masks 2
                  [0, 0, 0, 0, 0, 1, 0, 1],   # sub-block 0 done -> masks 5, 7
                  [0, 0, 0, 0, 0, 0, 0, 0]], bool)
    got = np.asarray(sub_block_candidates(jnp.asarray(m), 4, 1)).astype(int)
    np.testing.assert_array_equal(got, [[1, 0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0],
                                        [0, 0, 0, 0, 0, 1, 0, 1], [0] * 8])
    no_shift = np.asarray(sub_block_candidates(jnp.asarray(m), 4, 0)).astype(int)
    np.testing.assert_array_equal(no_shift[0], [1, 1, 1, 1, 0, 0, 0, 0])


# ------------------------------------------------------------------------------------ parity
def _rel(ref, ours):
    return float(np.abs(ref - ours).max() / np.abs(ref).max())


def test_logits_match_transformers_block_causal(case):
    from hf_reference import bidirectional_logits, block_causal_logits
    ref, _, d, model = case
    assert load_hf_config(d) == CFG and model.config == CFG
    ids = np.random.RandomState(5).randint(0, 125, (2, 21))  # 2.6 blocks of 8: the last is partial
    ours = model.logits(ids)
    want = block_causal_logits(ref, ids, CFG.block_size)
    rel = _rel(want, ours)
    print(f"Fast-dLLM v2 parity vs transformers Qwen2 (block-causal 4-D mask, fp32): max rel diff {rel:.2e}")
    assert rel <= REL_TOL, rel
    np.testing.assert_array_equal(want.argmax(-1), ours.argmax(-1))
    assert np.abs(bidirectional_logits(ref, ids) - ours).max() > 1e-2  # the mask really is block-causal


def test_convert_export_round_trip_bit_exact(case, tmp_path):
    from hf_reference import assert_bit_exact, convert_export_round_trip
    _, sd, d, _ = case
    back, got = convert_export_round_trip(d, tmp_path)
    assert_bit_exact(got, sd)
    assert load_hf_config(back) == CFG
    assert json.load(open(os.path.join(back, "config.json")))["architectures"] == ["Fast_dLLM_QwenForCausalLM"]


# ------------------------------------------------------------------------------------ decoding
_REF_CACHE = {}


def reference_fast_dllm_v2(model, prompt, B: int, b: int, G: int, threshold: float):
    key = (id(model), tuple(prompt), B, b, G, threshold)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = _reference(model, prompt, B, b, G, threshold)
    return _REF_CACHE[key]


def _reference(model, prompt, B: int, b: int, G: int, threshold: float):
    """Fast-dLLM v2's generate() at temperature 0 without the sub-block cache, written from the
    facts (families/fast_dllm_v2.py): one prompt, canvas = prompt + masks up to whole blocks, blocks
    from floor(P / B); NO cache: every step a full block-causal forward over [0, block end); logits
    shifted (position i decoded from row i - 1); a masked first position of the block is committed
    alone by argmax (the AR step); else in the first sub-block of b holding a mask, the masks whose
    argmax probability > threshold, plus the most probable one; after a block, stop if the stop id
    is in the generated part. Returns (canvas[P:P+G] cut before the stop id, forwards, commits)."""
    cfg = model.config
    M, stops = cfg.mask_token_id, cfg.stop_ids
    fwd = jax.jit(lambda params, ids: model.module.apply({"params": params}, ids)[0])
    P = len(prompt)
    nb = -(-(P + G) // B)
    x = list(prompt) + [M] * (nb * B - P)
    nfe = commits = 0
    for k in range(P // B, nb):
        s, e = k * B, (k + 1) * B
        while any(x[i] == M for i in range(s, e)):
            rows = np.asarray(fwd(model.params, jnp.asarray([x[:e]], jnp.int32)))[0].astype(np.float64)
            nfe += 1
            # shifted: position s + j <- row s + j - 1 (position 0 is prompt: any row)
            lg = rows[s - 1:e - 1] if s else np.concatenate([rows[:1], rows[:e - 1]])
            prob = np.exp(lg - lg.max(-1, keepdims=True))
            prob /= prob.sum(-1, keepdims=True)
            v = lg.argmax(-1)
            pv = prob[np.arange(B), v]
            if x[s] == M:
                chosen = [s]
            else:
                j = next(j for j in range(B // b) if any(x[i] == M for i in range(s + j * b, s + (j + 1) * b)))
                cand = [i for i in range(s + j * b, s + (j + 1) * b) if x[i] == M]
                best = max(cand, key=lambda i: (pv[i - s], -i))
                chosen = sorted({best} | {i for i in cand if pv[i - s] > threshold})
            for i in chosen:
                x[i] = int(v[i - s])
            commits += len(chosen)
        if any(t in stops for t in x[P:e]):
            break
    gen = x[P:P + G]
    cut = next((i for i, t in enumerate(gen) if t in stops), len(gen))
    return gen[:cut], nfe, commits


PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14], [60, 61, 62, 70, 71, 72, 73, 74, 75, 76, 77]]


@pytest.fixture(scope="module")
def dec_model(case):
    """The parity model with an untied LM head whose mask-id column is zero (a random tiny model
    otherwise sometimes predicts the mask id, which trained models do not), and whose EOS column is
    1.05 x the column of the token most often generated for PROMPTS[0] when EOS is never predicted,
    so the stop is exercised mid-generation."""
    from dinfer_jax.model import Model
    model = case[3]
    params = dict(model.params)
    head = params["lm_head"]["unembedding"].at[CFG.mask_token_id].set(0.0)
    params["lm_head"] = {"unembedding": head.at[CFG.eos_token_id].set(0.0)}
    p = SamplingParams(gen_length=24, block_length=CFG.block_size, cache="block", sub_block_length=SUB)
    out = generate(Model(CFG, params), PROMPTS[:1], p).token_ids[0]
    vals, counts = np.unique(out, return_counts=True)
    j = int(vals[np.argmax(counts)])
    params["lm_head"] = {"unembedding": head.at[CFG.eos_token_id].set(1.05 * head[j])}
    return Model(CFG, params)


@pytest.mark.parametrize("threshold", [0.9, 0.03])
def test_sub_block_decoding_matches_reference(dec_model, threshold):
    G = 24
    p = SamplingParams(gen_length=G, block_length=CFG.block_size, cache="block", sub_block_length=SUB,
                       threshold=threshold)
    r = generate(dec_model, PROMPTS, p)
    multi, stopped = False, 0
    for i, prompt in enumerate(PROMPTS):
        want, nfe, commits = reference_fast_dllm_v2(dec_model, prompt, CFG.block_size, SUB, G, threshold)
        assert r.token_ids[i] == want, f"prompt {i}"
        assert r.nfe[i] == nfe, f"prompt {i}: {r.nfe[i]} forwards, reference {nfe}"
        multi |= commits > nfe
        stopped += len(want) < G
    print(f"Fast-dLLM v2 sub-block decoding threshold={threshold}: nfe {r.nfe}, lengths "
          f"{[len(t) for t in r.token_ids]}")
    if threshold < 0.5:
        assert multi, "no step committed more than one token: threshold too high for this model"
    assert stopped, "the EOS stop was not exercised"


def test_unshifted_logits_decode_differently(dec_model):
    """The same weights read WITHOUT the shift (logit_shift forced to 0) do not reproduce the
    reference: the shift is load-bearing."""
    from dinfer_jax.model import Model
    G = 24
    p = SamplingParams(gen_length=G, block_length=CFG.block_size, cache="block", sub_block_length=SUB, threshold=0.9)
    unshifted = Model(dataclasses.replace(CFG, logit_shift=0), dec_model.params)
    r = generate(unshifted, PROMPTS, p)
    want = [reference_fast_dllm_v2(dec_model, q, CFG.block_size, SUB, G, 0.9)[0] for q in PROMPTS]
    assert all(a != b for a, b in zip(r.token_ids, want))
