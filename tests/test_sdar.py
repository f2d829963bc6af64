"""SDAR (SDARForCausalLM / SDARMoeForCausalLM, dinfer_jax/families/sdar.py): config, converters
both ways, logits parity with transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM (SDAR's network is
Qwen3's; the block-causal mask is imposed as an explicit 4-D additive mask, eager attention), fp32,
max|diff| <= 1e-4 * max|ref logit| and identical argmax, also with left padding; and SDAR's decoding
rule on our block loop (cache="block") against a slow host-loop reference written from SDAR's
generate() (no cache: a full block-causal forward over [0, block end) at every step).

torch is imported lazily: the smoke tests run on python3.12 without it.
"""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.config import ConfigError
from dinfer_jax.families import from_hf_dict, load_hf_config, preset, to_hf_dict
from knobs_helper import row_knobs  # noqa: E402

REL_TOL = 1e-4
CFG_DENSE = preset("tiny-sdar")  # tied embeddings, GQA 4/2, block 4
CFG_MOE = preset("tiny-sdar-moe")  # 8 experts top-2, norm_topk_prob, block 4

# JetAstra/SDAR training/model/SDAR-4B-Chat/config.json (@ c2041a8), every field.
SDAR_4B = {
    "architectures": ["SDARForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                 "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "attn_implementation": "flex_attention",
    "bos_token_id": 151643, "debug": False, "eos_token_id": 151643, "block_size": 4, "mask_token_id": 151669,
    "ep_size": 1, "fuse_cross_entropy": True, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
    "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 32768,
    "max_window_layers": 36, "micro_forward": False, "model_type": "sdar", "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "skip_checkpoint": False, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.52.4", "use_cache": False, "use_deepep": False,
    "use_sliding_window": False, "vocab_size": 151936,
}
SDAR_8B = {**SDAR_4B, "hidden_size": 4096, "intermediate_size": 12288}
# Qwen3-MoE fields of an SDARMoeForCausalLM config (field names from the remote code, [C3] in sdar.py).
SDAR_MOE = {**SDAR_4B, "architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe", "hidden_size": 2048,
            "num_hidden_layers": 48, "num_key_value_heads": 4, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _tiny_hf_config(cfg):
    """A config.json in the real SDAR format (the 4B file's fields) at cfg's tiny shapes."""
    hf = {**SDAR_4B, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
          "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "intermediate_size": 4 * cfg.hidden_size, "vocab_size": cfg.vocab_size,
          "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
          "mask_token_id": cfg.mask_token_id, "bos_token_id": cfg.eos_token_id, "eos_token_id": cfg.eos_token_id,
          "eot_token_id": cfg.eot_token_id, "pad_token_id": cfg.pad_token_id}
    if cfg.is_moe:
        hf.update(architectures=["SDARMoeForCausalLM"], model_type="sdar_moe", moe_intermediate_size=cfg.intermediate_size,
                  num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                  norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        hf["intermediate_size"] = cfg.intermediate_size
    return hf


# ------------------------------------------------------------------------------------ config
@pytest.mark.smoke
def test_real_configs_read_as_presets_with_published_sizes():
    for hf, name, total in ((SDAR_4B, "sdar-4b", 8_822_848_512), (SDAR_8B, "sdar-8b", 16_381_470_720)):
        cfg = from_hf_dict(hf)
        assert cfg == preset(name), name
        # model.safetensors.index.json total_size (bf16) of the same folder: 2 bytes per parameter.
        assert 2 * cfg.num_params == total, name
    cfg = from_hf_dict(SDAR_4B)
    assert (cfg.attention_mask, cfg.block_size, cfg.qk_norm, cfg.rotary) == ("block_causal", 4, True, 128)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.eot_token_id) == (151669, 151643, 151643, 151645)
    assert cfg.stop_ids == {151643, 151645}
    assert from_hf_dict({k: v for k, v in SDAR_8B.items() if k != "block_size"}) == preset("sdar-8b")
    moe = from_hf_dict(SDAR_MOE)
    assert moe == preset("sdar-30b-a3b")
    assert moe.router == "softmax" and moe.norm_topk_prob and round(moe.num_params / 1e9, 1) == 30.5
    assert int(moe.num_active_params / 1e8) == 33  # Qwen3-30B-A3B: "30.5B total, 3.3B activated"
    # Our writer's config.json reads back to the same config (dense, tied, MoE).
    for c in (cfg, moe, preset("sdar-1.7b"), CFG_DENSE, CFG_MOE):
        assert from_hf_dict(to_hf_dict(c)) == c


@pytest.mark.smoke
@pytest.mark.parametrize("base,bad,msg", [
    (SDAR_4B, {"attention_bias": True}, "attention_bias=true"),
    (SDAR_4B, {"use_sliding_window": True}, "use_sliding_window"),
    (SDAR_4B, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (SDAR_4B, {"block_size": 0}, "block_size=0"),
    (SDAR_4B, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    (SDAR_4B, {"hidden_size": None}, "hidden_size"),
    (SDAR_4B, {"num_key_value_heads": 7}, "num_heads=32 is not a multiple of num_kv_heads=7"),
    (SDAR_4B, {"mask_token_id": 200000}, r"mask_token_id=200000 outside the vocabulary"),
    (SDAR_MOE, {"mlp_only_layers": [0]}, "mlp_only_layers"),
    (SDAR_MOE, {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    (SDAR_MOE, {"num_experts_per_tok": 200}, "num_experts_per_tok=200"),
    (SDAR_MOE, {"moe_intermediate_size": None}, "moe_intermediate_size"),
])
def test_bad_sdar_configs_name_the_field(base, bad, msg):
    with pytest.raises(ConfigError, match=msg):
        from_hf_dict({**base, **bad})


@pytest.mark.smoke
def test_family_table_template_and_defaults():
    from converters.mappings import table
    from dinfer_jax import families
    from dinfer_jax.chat import render
    fam = families.by_architecture("SDARMoeForCausalLM")
    assert fam is families.by_architecture("SDARForCausalLM") and fam.name == "sdar"
    names = {e.hf for e in table(preset("sdar-4b"))}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.{l}.self_attn.q_norm.weight",
            "model.layers.{l}.mlp.gate_proj.weight"} <= names
    assert "lm_head.weight" not in {e.hf for e in table(preset("sdar-1.7b"))}  # tied
    moe = {e.hf for e in table(preset("sdar-30b-a3b"))}
    assert {"model.layers.{l}.mlp.gate.weight", "model.layers.{l}.mlp.experts.{e}.down_proj.weight"} <= moe
    text = render(fam.chat_template, [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert fam.decoding["block_length"] == 4 and fam.decoding["cache"] == "block"


# ------------------------------------------------------------------------------------ fixtures
def _ref_model(cfg, seed):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_reference import qwen3_moe_reference, qwen3_reference, sdar_state_dict
    model = qwen3_moe_reference(cfg, seed) if cfg.is_moe else qwen3_reference(cfg, seed)
    return model, sdar_state_dict(model, cfg)


@pytest.fixture(scope="module", params=["dense", "moe"])
def case(request, tmp_path_factory):
    """(cfg, torch reference, HF state dict, HF folder, our model loaded from that folder)."""
    from hf_reference import write_hf_folder

    from dinfer_jax import load_model
    cfg = CFG_DENSE if request.param == "dense" else CFG_MOE
    ref, sd = _ref_model(cfg, seed=21 if cfg.is_moe else 20)
    d = str(tmp_path_factory.mktemp(f"sdar_{request.param}"))
    write_hf_folder(d, cfg, sd, hf_config=_tiny_hf_config(cfg))
    return cfg, ref, sd, d, load_model(d)


def _rel(ref, ours):
    return float(np.abs(ref - ours).max() / np.abs(ref).max())


def _check(ref, ours):
    rel = _rel(ref, ours)
    assert rel <= REL_TOL, f"max |logit diff| / max |logit| = {rel:.2e}"
    np.testing.assert_array_equal(ref.argmax(-1), ours.argmax(-1))
    return rel


# ------------------------------------------------------------------------------------ parity
def test_folder_reads_as_the_tiny_preset(case):
    cfg, _, _, d, model = case
    assert load_hf_config(d) == cfg and model.config == cfg


def test_logits_match_transformers_block_causal(case):
    from hf_reference import bidirectional_logits, block_causal_logits, causal_logits
    cfg, ref, _, _, model = case
    rng = np.random.RandomState(5)
    ids = rng.randint(0, 125, (2, 22))  # 5.5 blocks of 4: the last block is partial
    ours = model.logits(ids)
    rel = _check(block_causal_logits(ref, ids, cfg.block_size), ours)
    print(f"SDAR {'MoE' if cfg.is_moe else 'dense'} parity vs transformers (block-causal, fp32): max rel diff {rel:.2e}")
    # The mask really is block-causal: full and causal references disagree with us.
    assert np.abs(bidirectional_logits(ref, ids) - ours).max() > 1e-2
    assert np.abs(causal_logits(ref, ids) - ours).max() > 1e-2


def test_left_padding_matches_transformers(case):
    """A left-padded batch (positions = index - pad, pads masked out of the keys) against the reference
    run on the same padded batch with the same positions and key mask, and against each row unpadded."""
    from hf_reference import block_causal_logits
    cfg, ref, _, _, model = case
    rng = np.random.RandomState(8)
    lens, L = (19, 13), 22
    rows = [rng.randint(0, 125, n) for n in lens]
    pads = [L - n for n in lens]
    padded = np.stack([np.concatenate([np.full(p, cfg.pad_id), r]) for p, r in zip(pads, rows)])
    key_mask = np.arange(L)[None] >= np.asarray(pads)[:, None]
    pos = np.maximum(np.arange(L)[None] - np.asarray(pads)[:, None], 0)
    ours = np.asarray(model.module.apply({"params": model.params}, jnp.asarray(padded), positions_BS=jnp.asarray(pos),
                                         key_mask_BL=jnp.asarray(key_mask))[0])
    want = block_causal_logits(ref, padded, cfg.block_size, key_mask=key_mask, positions=pos)
    rels = []
    for b, p in enumerate(pads):
        rels.append(_check(want[b:b + 1, p:], ours[b:b + 1, p:]))
        _check(block_causal_logits(ref, rows[b][None], cfg.block_size), ours[b:b + 1, p:])
    print(f"SDAR {'MoE' if cfg.is_moe else 'dense'} left-padded parity: max rel diff {max(rels):.2e}")


# ------------------------------------------------------------------------------------ converters
def test_convert_export_round_trip_bit_exact(case, tmp_path):
    from hf_reference import assert_bit_exact, convert_export_round_trip
    cfg, _, sd, d, _ = case
    back, got = convert_export_round_trip(d, tmp_path)
    assert_bit_exact(got, sd)
    assert load_hf_config(back) == load_hf_config(d) == cfg
    hf_back = json.load(open(os.path.join(back, "config.json")))
    assert hf_back["architectures"] == (["SDARMoeForCausalLM"] if cfg.is_moe else ["SDARForCausalLM"])


def test_bad_folder_config_gives_a_config_error_naming_the_field(case, tmp_path):
    from converters import convert
    cfg, _, sd, _, _ = case
    from hf_reference import write_hf_folder
    hf = _tiny_hf_config(cfg)
    hf.pop("num_hidden_layers")
    write_hf_folder(str(tmp_path / "src"), cfg, {k: v for k, v in list(sd.items())[:2]}, hf_config=hf)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        convert(str(tmp_path / "src"), str(tmp_path / "out"), progress=False)


# ------------------------------------------------------------------------------------ decoding
def reference_sdar_generate(model, prompt, B: int, G: int, steps: int, threshold: float):
    """SDAR's block_diffusion_generate() at temperature 0 (greedy: argmax, p = its softmax
    probability), written from JetAstra/SDAR generate.py / huggingface_bd3.py (facts only): one
    prompt, canvas = prompt + masks up to whole blocks, decoding from block floor(P / B); per block
    up to `steps` steps with n_s = B // steps (+1 on the first B % steps); dynamic (threshold < 1):
    masks with p > threshold if at least n_s, else the top-n_s masks; static (threshold >= 1): the
    top-n_s; NO cache: every step a full block-causal forward over [0, block end); after a block,
    stop if a stop id (EOS or <|im_end|>) is in the generated part. Returns (canvas[P:P+G] cut before
    the first stop id, decoder forwards (SDAR's extra K/V-storing forward per block not counted),
    tokens committed, the decoded canvas [P, last block end))."""
    import jax
    cfg = model.config
    M, stops = cfg.mask_token_id, cfg.stop_ids
    fwd = jax.jit(lambda params, ids: model.module.apply({"params": params}, ids)[0])
    P = len(prompt)
    nb = -(-(P + G) // B)
    x = list(prompt) + [M] * (nb * B - P)
    sched = [B // steps + (1 if s < B % steps else 0) for s in range(steps)]
    nfe = commits = 0
    for b in range(P // B, nb):
        s, e = b * B, (b + 1) * B
        for step in range(steps + 1):
            masked = [i for i in range(s, e) if x[i] == M]
            if not masked:
                break
            logits = np.asarray(fwd(model.params, jnp.asarray([x[:e]], jnp.int32)))[0, s:e].astype(np.float64)
            nfe += 1
            prob = np.exp(logits - logits.max(-1, keepdims=True))
            prob /= prob.sum(-1, keepdims=True)
            v = logits.argmax(-1)
            pv = prob[np.arange(B), v]
            n = sched[step]
            high = [i for i in masked if pv[i - s] > threshold]
            if threshold < 1.0 and len(high) >= n:
                chosen = high
            else:
                chosen = sorted(masked, key=lambda i: (-pv[i - s], i))[:n]
            for i in chosen:
                x[i] = int(v[i - s])
            commits += len(chosen)
        if any(t in stops for t in x[P:e]):
            break
    gen = x[P:P + G]
    cut = next((i for i, t in enumerate(gen) if t in stops), len(gen))
    return gen[:cut], nfe, commits, x[P:e]


PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14], [60, 61, 62]]


def _never_predicts_mask(model):
    """The same network with an untied LM head whose mask-id row is zero (logit 0): a random tiny
    model otherwise sometimes predicts the mask id, which SDAR's generate() does not handle (its
    step loop runs past its schedule); trained SDAR models do not predict <MASK>. (The decoding
    tests compare our loop with the reference on this one model; parity is tested above.)"""
    from dinfer_jax.model import Model
    cfg, params = model.config, dict(model.params)
    head = params["lm_head"]["unembedding"] if "lm_head" in params else params["embed"]["embedding"]
    head = head.at[cfg.mask_token_id].set(0.0)
    # Make <|im_end|> (eot) likely somewhere: it takes the LM-head row (x 1.05) of the token the
    # model predicts second most often over a masked canvas, so the end-of-turn stop is exercised.
    canvas = np.array([PROMPTS[0] + [cfg.mask_token_id] * 16])
    pred = model.logits(canvas)[0, len(PROMPTS[0]):].argmax(-1)
    vals, counts = np.unique(pred[pred != cfg.mask_token_id], return_counts=True)
    j = int(vals[np.argsort(-counts, kind="stable")[min(1, len(vals) - 1)]])
    head = head.at[cfg.eot_token_id].set(1.05 * head[j])
    params["lm_head"] = {"unembedding": head}
    return Model(cfg.replace(tie_word_embeddings=False), params)


@pytest.fixture(scope="module")
def dec_model(case):
    return _never_predicts_mask(case[4])


@pytest.mark.parametrize("steps,threshold", [(4, 0.05), (4, 1.0), (2, 0.05)],
                         ids=["dynamic", "static", "dynamic-2-per-step"])
def test_block_decoding_matches_sdar_reference(dec_model, steps, threshold):
    from dinfer_jax.engine import SamplingParams, generate
    model = dec_model
    cfg = model.config
    if cfg.is_moe:
        pytest.skip("decoding runs on the dense model only (the rule and the loop do not depend on the MLP; "
                    "a MoE block-loop compile costs ~1 min of the suite)")
    G = 16
    p = SamplingParams(gen_length=G, block_length=cfg.block_size, cache="block", steps=steps, threshold=threshold)
    r = generate(model, PROMPTS, p)
    multi, stopped = False, set()
    for i, prompt in enumerate(PROMPTS):
        want, nfe, commits, canvas = reference_sdar_generate(model, prompt, cfg.block_size, G, steps, threshold)
        assert r.token_ids[i] == want, f"prompt {i}"
        assert r.nfe[i] == nfe, f"prompt {i}: {r.nfe[i]} forwards, reference {nfe}"
        stopped |= {cfg.eos_token_id, cfg.eot_token_id} & set(canvas)
        multi |= commits > nfe
    if threshold < 1.0 and steps == 4:
        assert multi, "the dynamic rule never committed more than one token per step: threshold too high"
    assert cfg.eot_token_id in stopped, "the end-of-turn stop was not exercised"
    if steps == 4 and threshold < 1.0:
        # SDAR's evaluation setting (huggingface_bd3.py: temperature 1, top_k 1, confidence from the
        # softmax before the top-k filter) is greedy decoding: same tokens and forwards as temperature 0.
        import dataclasses
        ev = generate(model, PROMPTS, dataclasses.replace(p, temperature=1.0, top_k=1, confidence_before_filter=True))
        assert ev.token_ids == r.token_ids and ev.nfe == r.nfe
        # Without the knob, top_k 1 makes every confidence 1.0: each block commits in one step.
        one = generate(model, PROMPTS, dataclasses.replace(p, temperature=1.0, top_k=1))
        assert all(n <= -(-(len(q) + G) // cfg.block_size) - len(q) // cfg.block_size for n, q in zip(one.nfe, PROMPTS))
    print(f"SDAR decoding {cfg.is_moe and 'MoE' or 'dense'} steps={steps} threshold={threshold}: nfe {r.nfe}, "
          f"stopped on {sorted(stopped)}")


@pytest.mark.smoke
def test_confidence_before_filter_on_hand_built_logits():
    """SamplingParams.confidence_before_filter: p of the drawn token under the temperature-scaled
    softmax before top-k / top-p, instead of under the filtered softmax."""
    from dinfer_jax.decoding.block_strategies import sample_tokens
    logits = jnp.asarray([[[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 2.9, 0.1]]])  # (B=1, S=2, V=4)
    key = jax_keys(1)
    base = row_knobs(1, temperature=jnp.ones(1), top_k=jnp.ones(1), top_p=jnp.ones(1))
    v, p = sample_tokens(logits, base.replace(confidence_before_filter=jnp.zeros(1)), key)
    np.testing.assert_array_equal(np.asarray(v), [[0, 1]])
    np.testing.assert_allclose(np.asarray(p), [[1.0, 1.0]])  # top_k 1: the filtered softmax is one-hot
    v2, p2 = sample_tokens(logits, base.replace(confidence_before_filter=jnp.ones(1)), key)
    soft = np.exp(np.asarray(logits[0])) / np.exp(np.asarray(logits[0])).sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(v2), [[0, 1]])
    np.testing.assert_allclose(np.asarray(p2)[0], [soft[0, 0], soft[1, 1]], rtol=1e-6)
    # temperature 0.5, top_p 0.5: the draw is among the kept tokens, p under softmax(l / 0.5) unfiltered.
    knobs = row_knobs(1, temperature=jnp.full(1, 0.5), top_k=jnp.zeros(1), top_p=jnp.full(1, 0.5),
                      confidence_before_filter=jnp.ones(1))
    v3, p3 = sample_tokens(logits, knobs, key)
    scaled = np.exp(2 * np.asarray(logits[0]))
    scaled /= scaled.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(p3)[0], scaled[[0, 1], np.asarray(v3)[0]], rtol=1e-6)
    # Greedy rows (temperature 0) are unaffected by the knob.
    g = row_knobs(1, temperature=jnp.zeros(1), top_k=jnp.ones(1), top_p=jnp.ones(1))
    _, pg0 = sample_tokens(logits, g.replace(confidence_before_filter=jnp.zeros(1)), key)
    _, pg1 = sample_tokens(logits, g.replace(confidence_before_filter=jnp.ones(1)), key)
    np.testing.assert_allclose(np.asarray(pg0), np.asarray(pg1))
    np.testing.assert_allclose(np.asarray(pg0)[0], [soft[0, 0], soft[1, 1]], rtol=1e-6)


def jax_keys(n):
    import jax
    return jax.vmap(jax.random.key)(jnp.arange(n, dtype=jnp.uint32))


@pytest.mark.smoke
def test_real_folder_side_files_give_sdar_ids(tmp_path):
    """A folder with SDAR-4B-Chat's config.json and generation_config.json (eos list [<|im_end|>,
    <|endoftext|>], pad 151643): config.json's EOS wins, <|im_end|> is the end-of-turn id."""
    (tmp_path / "config.json").write_text(json.dumps(SDAR_4B))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95}))
    cfg = load_hf_config(tmp_path)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.eot_token_id) == (151669, 151643, 151643, 151645)
    no_mask = {k: v for k, v in SDAR_4B.items() if k != "mask_token_id"}
    (tmp_path / "config.json").write_text(json.dumps(no_mask))
    assert load_hf_config(tmp_path).mask_token_id == 151669  # the family default (<MASK>)
    # A small SDAR-format checkpoint without mask_token_id: the <MASK> token of tokenizer.json (the
    # family default 151669 does not fit its vocabulary).
    tiny = {k: v for k, v in _tiny_hf_config(CFG_DENSE).items() if k != "mask_token_id"}
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 120, "content": "<MASK>"}]}))
    assert load_hf_config(tmp_path).mask_token_id == 120
