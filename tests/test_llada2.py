"""LLaDA2.x (LLaDA2MoeModelLM): config, converter both ways, router, and logits parity with an
independent PyTorch implementation (transformers Glm4MoeForCausalLM, same router family; bridges
listed in tests/hf_reference.py) on a tiny random HF folder, with the block-causal mask imposed
explicitly. fp32; tolerance max|diff| <= 1e-4 * max|ref logit| and identical argmax (as in
test_parity_transformers.py: fp32 accumulation-order noise here is ~1e-6 relative).
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch  # noqa: E402
from hf_reference import (block_causal_logits, bidirectional_logits, causal_logits, glm4_moe_reference,  # noqa: E402
                          llada2_state_dict, write_hf_folder)

from converters import ConversionError, convert  # noqa: E402
from dinfer_jax.config import ConfigError  # noqa: E402
from dinfer_jax.families import from_hf_dict, load_hf_config, preset  # noqa: E402
from dinfer_jax.models.moe import route_sigmoid_group  # noqa: E402

REL_TOL = 1e-4
CFG = preset("tiny-llada2")  # 1 dense + 2 MoE layers, 16 experts in 4 groups, top-4 of 2 groups, block 8

# The LLaDA2.1-mini config.json fields (docs/facts/llada2_and_dream.md §1).
LLADA21_MINI = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "num_hidden_layers": 20, "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120,
    "first_k_dense_replace": 1, "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1,
    "moe_intermediate_size": 512, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "norm_topk_prob": True, "router_dtype": "fp32",
    "partial_rotary_factor": 0.5, "rotary_dim": 64, "rope_theta": 600000, "rope_scaling": None, "rms_norm_eps": 1e-6,
    "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False, "vocab_size": 157184, "pad_token_id": 156892,
    "tie_word_embeddings": False, "max_position_embeddings": 32768, "sliding_window": 4096,
    "use_sliding_window": False, "use_cache": False, "dtype": "bfloat16", "max_window_layers": 28,
    "norm_head": False, "norm_softmax": False, "output_router_logits": False, "use_rmsnorm": True,
}


@pytest.fixture(scope="module")
def ref():
    model = glm4_moe_reference(CFG, seed=3)
    return model, llada2_state_dict(model, CFG)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, ref):
    d = str(tmp_path_factory.mktemp("llada2_hf"))
    write_hf_folder(d, CFG, ref[1])
    return d


@pytest.fixture(scope="module")
def model(hf_dir):
    from dinfer_jax import load_model
    return load_model(hf_dir)


def _rel(ref, ours):
    return float(np.abs(ref - ours).max() / np.abs(ref).max())


def _check(ref, ours):
    rel = _rel(ref, ours)
    assert rel <= REL_TOL, f"max |logit diff| / max |logit| = {rel:.2e}"
    np.testing.assert_array_equal(ref.argmax(-1), ours.argmax(-1))
    return rel


# ------------------------------------------------------------------------------------ config
@pytest.mark.smoke
def test_real_config_reads_as_preset_with_published_sizes():
    cfg = from_hf_dict(LLADA21_MINI)
    assert cfg == preset("llada2-mini")
    assert cfg.rotary == 64 and cfg.router == "sigmoid_group" and cfg.attention_mask == "block_causal"
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.block_size) == (156895, 156892, 32)
    assert dict(cfg.extra_token_ids) == {"delete_token_id": 156930, "split_token_id": 156931}
    # Published safetensors totals (reference §1): every tensor bf16 except the fp32 expert_bias buffers.
    for name, total_bytes in (("llada2-mini", 32_511_296_512), ("llada2-flash", 205_779_426_304)):
        c = preset(name)
        fp32_bias = c.num_scanned_layers * c.num_experts
        assert 2 * c.num_params + 2 * fp32_bias == total_bytes, name
    assert round(preset("llada2-mini").num_active_params / 1e9, 1) == 1.4  # "16B-A1.4B"
    assert round(preset("llada2-flash").num_active_params / 1e9, 1) == 6.2  # "~6.1B active" (2nd-hand)


@pytest.mark.smoke
def test_abstract_params_at_full_mini_shapes_match_the_count():
    from dinfer_jax.models import abstract_params
    cfg = preset("llada2-mini")
    shapes = abstract_params(cfg, jnp.bfloat16)
    assert sum(int(np.prod(s.shape)) for s in shapes.values()) == cfg.num_params
    assert shapes["layers/mlp/gate_proj"].shape == (19, 256, 2048, 512)
    assert shapes["dense_layers/mlp/gate_proj"].shape == (1, 2048, 5120)
    assert shapes["layers/mlp/shared/down_proj"].shape == (19, 512, 2048)


@pytest.mark.smoke
@pytest.mark.parametrize("bad,msg", [
    ({"score_function": "softmax"}, "score_function='softmax'"),
    ({"moe_router_enable_expert_bias": False}, "expert_bias"),
    ({"n_group": 7}, "n_group=7 must divide num_experts=256"),
    ({"topk_group": 9}, r"topk_group=9 must be in \[1, n_group=8\]"),
    ({"use_qkv_bias": True}, "biases"),
    ({"first_k_dense_replace": 20}, "first_k_dense=20"),
])
def test_bad_llada2_configs_name_the_problem(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        from_hf_dict({**LLADA21_MINI, **bad})


@pytest.mark.smoke
def test_family_defaults_that_do_not_fit_the_vocabulary_are_not_applied(tmp_path):
    """A small LLaDA-format checkpoint (300 tokens): the LLaDA defaults (eot 126348, ...) do not
    fit, so only the folder's own ids count; a missing mask id is the one error, naming where to add it."""
    hf = {"architectures": ["LLaDAModelLM"], "d_model": 32, "n_heads": 4, "n_layers": 1, "mlp_hidden_size": 64,
          "vocab_size": 300}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match="no mask token id.*mask_token_id.*config.json or generation_config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"mask_token_id": 5, "eos_token_id": 2}))
    cfg = load_hf_config(tmp_path)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.eot_token_id) == (5, 2, None, None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"mask_token_id": 5}))
    cfg = load_hf_config(tmp_path)  # no EOS anywhere: allowed (no early stop at EOS)
    assert cfg.eos_token_id is None and cfg.eos_id == -1 and cfg.pad_id == 0 and not cfg.stop_ids


# ------------------------------------------------------------------------------------ router
def _route_loop(logits, bias, top_k, n_group, topk_group, norm, scale):
    """The router formula, one token at a time, ties to the lower index (reference §3)."""
    T, E = logits.shape
    per = E // n_group
    W, I = np.zeros((T, top_k)), np.zeros((T, top_k), int)
    for t in range(T):
        s = 1.0 / (1.0 + np.exp(-logits[t].astype(np.float64)))
        r = s + bias
        gscore = [sum(sorted(r[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
        eligible = [e for e in range(E) if e // per in groups]
        chosen = sorted(eligible, key=lambda e: (-r[e], e))[:top_k]
        w = np.array([s[e] for e in chosen])
        if norm:
            w = w / (w.sum() + 1e-20)
        W[t], I[t] = w * scale, chosen
    return W, I


@pytest.mark.smoke
@pytest.mark.parametrize("norm,scale", [(True, 2.5), (False, 1.0), (True, 1.0)])
def test_router_matches_the_per_token_formula(norm, scale):
    rng = np.random.RandomState(7)
    T, E, G, Y, X = 12, 16, 4, 2, 4
    logits = rng.randn(T, E).astype(np.float32)
    bias = (rng.randn(E) * 0.3).astype(np.float32)
    # Ties: token 0 has two groups with exactly equal group scores (groups 1 and 3 identical logits,
    # zero bias there), token 1 identical experts inside a group.
    logits[0, 12:16] = logits[0, 4:8]
    bias[12:16] = bias[4:8]
    logits[1, 9] = logits[1, 8]
    w, i = route_sigmoid_group(jnp.asarray(logits), jnp.asarray(bias), X, G, Y, norm, scale)
    w_ref, i_ref = _route_loop(logits, bias.astype(np.float64), X, G, Y, norm, scale)
    np.testing.assert_array_equal(np.asarray(i), i_ref)
    np.testing.assert_allclose(np.asarray(w), w_ref, rtol=2e-6, atol=1e-7)
    if norm:
        np.testing.assert_allclose(np.asarray(w).sum(-1), scale, rtol=1e-6)


def test_router_matches_transformers_and_the_bias_only_selects(ref):
    """Our router vs Glm4MoeTopkRouter on the same inputs: same experts, same weights; weights
    taken from the BIASED scores would differ by far more than the tolerance (so this test fails
    if the bias leaks into the weights)."""
    model, _ = ref
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(20, CFG.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits_t, w_t, i_t = gate(x)
    order = torch.argsort(i_t, dim=1)
    i_t, w_t = torch.gather(i_t, 1, order).numpy(), torch.gather(w_t, 1, order).numpy()
    bias = gate.e_score_correction_bias.numpy()
    w, i = route_sigmoid_group(jnp.asarray(logits_t.numpy()), jnp.asarray(bias), CFG.num_experts_per_tok,
                               CFG.n_group, CFG.topk_group, True, CFG.routed_scaling_factor)
    order = np.argsort(np.asarray(i), axis=1)
    i, w = np.take_along_axis(np.asarray(i), order, 1), np.take_along_axis(np.asarray(w), order, 1)
    np.testing.assert_array_equal(i, i_t)
    np.testing.assert_allclose(w, w_t, rtol=1e-5)
    s_biased = 1 / (1 + np.exp(-logits_t.numpy())) + bias
    wb = np.take_along_axis(s_biased, i, 1)
    wb = wb / wb.sum(-1, keepdims=True) * CFG.routed_scaling_factor
    assert np.abs(wb - w_t).max() > 100 * 1e-5 * np.abs(w_t).max()


# ------------------------------------------------------------------------------------ parity
def test_logits_match_transformers_block_causal(ref, model):
    rng = np.random.RandomState(5)
    ids = rng.randint(0, 120, (2, 28))  # 3.5 blocks of 8: the last block is partial
    rel = _check(block_causal_logits(ref[0], ids, CFG.block_size), model.logits(ids))
    print(f"LLaDA2 parity vs Glm4MoeForCausalLM (block-causal, fp32): max rel diff {rel:.2e}")


def test_mask_is_block_causal_not_full_not_causal(ref, model):
    rng = np.random.RandomState(6)
    ids = rng.randint(0, 120, (1, 24))
    ids2 = ids.copy()
    ids2[0, 20] = (ids2[0, 20] + 1) % 120  # a token in block 2 (positions 16..23)
    a, b = model.logits(ids)[0], model.logits(ids2)[0]
    assert np.abs(a[:16] - b[:16]).max() == 0.0  # earlier blocks never see a later block
    assert np.abs(a[16] - b[16]).max() > 1e-3  # position 16 sees position 20 (same block)
    ra = block_causal_logits(ref[0], ids, CFG.block_size)
    # Full bidirectional and plain causal references disagree with us: the test fails if our mask is either.
    assert np.abs(bidirectional_logits(ref[0], ids)[0] - a).max() > 1e-2
    assert np.abs(causal_logits(ref[0], ids)[0] - a).max() > 1e-2
    _check(ra, a[None])


def test_left_padding_with_shifted_positions(ref, model):
    """A left-padded row (positions = index - pad, pads masked out) gives the unpadded row's logits."""
    rng = np.random.RandomState(8)
    ids = rng.randint(0, 120, (1, 19))
    pad = 5
    padded = np.concatenate([np.full((1, pad), CFG.pad_id), ids], 1)
    key_mask = np.arange(24)[None] >= pad
    pos = np.maximum(np.arange(24)[None] - pad, 0)
    ours = model.module.apply({"params": model.params}, jnp.asarray(padded), positions_BS=jnp.asarray(pos),
                              key_mask_BL=jnp.asarray(key_mask))[0]
    ref_l = block_causal_logits(ref[0], ids, CFG.block_size)
    _check(ref_l, np.asarray(ours)[:, pad:])


def test_cached_window_equals_full_block_causal_forward(model):
    """A window forward over block 2 reading the prefix K/V from a full forward's cache gives the
    full block-causal forward's logits for that block (the exact-prefix property of block diffusion)."""
    rng = np.random.RandomState(9)
    ids = jnp.asarray(rng.randint(0, 120, (2, 32)))
    m, p = model.module, model.params
    full, kv = m.apply({"params": p}, ids)
    B, L = ids.shape
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    win, _ = m.apply({"params": p}, ids[:, 16:24], positions_BS=pos[:, 16:24], kv=kv, window_start=16,
                     key_positions_BL=pos)
    assert _rel(np.asarray(full[:, 16:24]), np.asarray(win)) <= 1e-5


# ------------------------------------------------------------------------------------ converters
def test_convert_export_round_trip_bit_exact(hf_dir, ref, tmp_path):
    from hf_reference import assert_bit_exact, convert_export_round_trip
    back, got = convert_export_round_trip(hf_dir, tmp_path)
    assert_bit_exact(got, ref[1])
    assert load_hf_config(back) == load_hf_config(hf_dir)


def test_bad_checkpoints_give_one_clear_error(ref, tmp_path):
    sd = dict(ref[1])
    sd.pop("model.layers.2.mlp.shared_experts.up_proj.weight")
    qkv = "model.layers.1.attention.query_key_value.weight"
    sd[qkv] = sd[qkv][: -CFG.head_dim]  # one value head short: a wrong fused head layout
    write_hf_folder(str(tmp_path / "src"), CFG, sd)
    with pytest.raises(ConversionError) as e:
        convert(str(tmp_path / "src"), str(tmp_path / "out"), progress=False)
    msg = str(e.value)
    assert "1 missing tensors" in msg and "model.layers.2.mlp.shared_experts.up_proj.weight" in msg
    assert f"{qkv}: expected shape [{(4 + 2 * 2) * 16}, 64], found [{(4 + 2 * 2) * 16 - 16}, 64]" in msg


# ------------------------------------------------------------------------------------ decoding
def test_full_canvas_decoding_runs_block_causal(model):
    """The existing full-canvas loop on a block-causal model: with cache "none" every forward is a
    full block-causal forward, so it equals the host-loop reference token for token (the dedicated
    block-diffusion mode with its exact prefix cache is a separate piece of work)."""
    from decoding_reference import reference_generate

    from dinfer_jax.engine import SamplingParams, generate
    prompts = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 2]]
    p = SamplingParams(gen_length=16, block_length=8, strategy="threshold", threshold=0.2, cache="none")
    r = generate(model, prompts, p)
    for i, prompt in enumerate(prompts):
        want, nfe = reference_generate(model, prompt, p)
        assert r.raw_ids[i].tolist() == want and r.nfe[i] == nfe
    d = generate(model, prompts, SamplingParams(gen_length=16, block_length=8, threshold=0.2, cache="dual"))
    assert not (d.raw_ids == CFG.mask_token_id).any()


def test_one_bf16_forward_at_full_mini_widths(tmp_path):
    """bench/llada2_full_width.py: the dense first layer + one MoE layer of LLaDA2-mini at full
    widths (1.5 B params incl. the 157184-token embedding and LM head), bf16, on CPU. In a
    subprocess: it sets XLA flags and holds ~5 GB."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "row.json"
    p = subprocess.run([sys.executable, os.path.join(root, "bench", "llada2_full_width.py"), "--repeats", "1",
                        "--tokens", "16", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    row = json.loads(out.read_text())
    assert row["finite"] and row["params_run"] == preset("llada2-mini").replace(num_layers=2).num_params
