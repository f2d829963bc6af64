import json

import pytest

from dinfer_jax.config import ConfigError
from dinfer_jax.families import from_hf_dict, load_hf_config, preset, to_hf_dict

pytestmark = pytest.mark.smoke

# Real LLaDA-8B-Instruct config.json keys (docs/facts/models.md A1).
LLADA_8B = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 4096, "n_layers": 32, "n_heads": 32,
    "n_kv_heads": 32, "mlp_hidden_size": 12288, "mlp_ratio": 4, "activation_type": "silu", "block_type": "llama",
    "layer_norm_type": "rms", "rms_norm_eps": 1e-5, "rope": True, "rope_theta": 500000.0, "alibi": False,
    "attention_layer_norm": False, "include_bias": False, "include_qkv_bias": False, "vocab_size": 126464,
    "embedding_size": 126464, "weight_tying": False, "max_sequence_length": 4096, "mask_token_id": 126336,
    "eos_token_id": 126081, "pad_token_id": 126081,
}
# LLaDA-MoE-7B-A1B keys as documented (models.md B1); the mask id is absent from the real file.
LLADA_MOE = {
    "architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 16, "expert_intermediate_size": 1024,
    "dense_intermediate_size": 8192, "shared_expert_intermediate_size": None, "moe_layer_freq": [1] * 16,
    "num_experts": 64, "num_experts_per_tok": 8, "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False, "norm_topk_prob": None, "qk_layernorm": True, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "rope_theta": 50000, "rope_scaling": None, "max_position_embeddings": 8192,
    "vocab_size": 157184, "attention_bias": False, "tie_word_embeddings": False, "eos_token_id": 156892,
    "pad_token_id": 156892,
}


def test_llada_8b_config_matches_preset_and_param_count():
    cfg = from_hf_dict(LLADA_8B)
    assert cfg == preset("llada-8b")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (32, 32, 128, 12288)
    # 16,031,162,368 bytes of bf16 in the real checkpoint -> 8,015,581,184 params.
    assert cfg.num_params == 16_031_162_368 // 2


def test_llada_moe_config_matches_preset_and_param_count():
    cfg = from_hf_dict(LLADA_MOE)
    assert cfg == preset("llada-moe-7b-a1b")
    assert cfg.mask_token_id == 156895 and cfg.eos_token_id == 156892  # documented default mask id
    assert not cfg.norm_topk_prob and cfg.qk_norm and cfg.rotary == 128
    assert round(cfg.num_params / 1e9, 3) == 7.357  # reported 7.36B total


def test_fused_architecture_and_explicit_ids():
    cfg = from_hf_dict({**LLADA_MOE, "architectures": ["FusedLLaDAMoEModelLM"], "mask_token_id": 5})
    assert cfg.family == "llada_moe" and cfg.mask_token_id == 5  # iLLaDA-style override honoured


def test_partial_rotary_and_rope_parameters():
    cfg = from_hf_dict({**LLADA_MOE, "partial_rotary_factor": 0.5, "rope_theta": None,
                        "rope_parameters": {"rope_theta": 600000.0}})
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 600000.0


@pytest.mark.parametrize("name", ["tiny", "tiny-dense", "llada-8b", "llada-moe-7b-a1b"])
def test_to_hf_round_trip(name):
    cfg = preset(name)
    assert from_hf_dict(json.loads(json.dumps(to_hf_dict(cfg)))) == cfg


def test_unknown_architecture_names_it():
    with pytest.raises(ConfigError, match=r"unknown architecture 'MistralForCausalLM'.*supported: .*LLaDAMoEModelLM"):
        from_hf_dict({"architectures": ["MistralForCausalLM"], "hidden_size": 8})
    with pytest.raises(ConfigError, match="no 'architectures'"):
        from_hf_dict({"hidden_size": 8})


@pytest.mark.parametrize("bad,msg", [
    ({"moe_router_enable_expert_bias": True}, "expert_bias"),
    ({"num_key_value_heads": 3}, "not a multiple of num_kv_heads=3"),
    ({"num_experts_per_tok": 65}, "num_experts_per_tok=65"),
    ({"num_experts": None}, r"none of the keys \['num_experts'\]"),
    ({"mask_token_id": 157184}, "mask_token_id=157184 outside the vocabulary"),
])
def test_invalid_config_messages(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        from_hf_dict({**LLADA_MOE, **bad})


def test_missing_and_invalid_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_config(tmp_path)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")


@pytest.mark.smoke
def test_special_ids_come_from_the_folder_files(tmp_path):
    """config.json without special ids: generation_config.json and the tokenizer files name them;
    config.json still wins where it has them; the family defaults fill the rest."""
    import json

    from dinfer_jax.families import load_hf_config, preset, to_hf_dict
    hf = to_hf_dict(preset("tiny"))
    for k in ("mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id"):
        hf.pop(k, None)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 120, "content": "<|endoftext|>"}, {"id": 121, "content": "<|mdm_mask|>"},
        {"id": 122, "content": "<|pad|>"}]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                "pad_token": {"content": "<|pad|>"}}))
    cfg = load_hf_config(tmp_path)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (121, 120, 122)
    assert cfg.eot_token_id is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [119, 120]}))
    assert load_hf_config(tmp_path).eos_token_id == 119
    # ChatML's end of turn (Qwen folders) is an end-of-turn id like Llama-3's <|eot_id|>
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 120, "content": "<|endoftext|>"}, {"id": 121, "content": "<|mdm_mask|>"},
        {"id": 117, "content": "<|im_end|>"}]}))
    cfg = load_hf_config(tmp_path)
    assert cfg.eot_token_id == 117 and cfg.stop_ids == {119, 117}
    hf["mask_token_id"] = 5
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert load_hf_config(tmp_path).mask_token_id == 5
