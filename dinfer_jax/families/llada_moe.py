"""LLaDA-MoE (7B-A1B): `LLaDAMoEModelLM` (and dInfer's `FusedLLaDAMoEModelLM` layout, which the
converter reads as per-expert names), Qwen3-MoE-style names, softmax top-k router, per-head q/k
RMSNorm, full bidirectional attention. Facts: docs/facts/models.md (B)."""
from __future__ import annotations

from converters.mappings import Entry, decoder_entries
from dinfer_jax.config import ConfigError, ModelConfig, need, partial_rotary_factor, rope_theta
from dinfer_jax.families import Family, llama_fields

DEFAULT_IDS = dict(mask_token_id=156895, eos_token_id=156892, pad_token_id=156892, eot_token_id=None)


def read_config(hf, ids_for_vocab, where) -> ModelConfig:
    if hf.get("moe_router_enable_expert_bias"):
        raise ConfigError(f"{where}: moe_router_enable_expert_bias=true is not supported yet")
    if hf.get("shared_expert_intermediate_size"):
        raise ConfigError(f"{where}: shared experts are not supported yet")
    freq = hf.get("moe_layer_freq")
    if freq is not None and not all(int(f) == 1 for f in (freq if isinstance(freq, list) else [freq])):
        raise ConfigError(f"{where}: moe_layer_freq={freq}: only all-MoE layer stacks are supported")
    D = int(need(hf, "hidden_size", where=where))
    N = int(need(hf, "num_attention_heads", where=where))
    H = int(hf.get("head_dim") or D // N)
    rot = int(H * partial_rotary_factor(hf))
    V = int(need(hf, "vocab_size", where=where))
    return ModelConfig(
        family="llada_moe", vocab_size=V, hidden_size=D,
        num_layers=int(need(hf, "num_hidden_layers", where=where)), num_heads=N,
        num_kv_heads=int(hf.get("num_key_value_heads") or N), head_dim=H,
        intermediate_size=int(need(hf, "expert_intermediate_size", "moe_intermediate_size", where=where)),
        rope_theta=rope_theta(hf, 50000.0), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rotary_dim=None if rot == H else rot, qk_norm=bool(hf.get("qk_layernorm", True)),
        num_experts=int(need(hf, "num_experts", where=where)),
        num_experts_per_tok=int(need(hf, "num_experts_per_tok", where=where)),
        # The reference modeling code hard-codes norm_topk_prob=False; honour an explicit true.
        norm_topk_prob=bool(hf.get("norm_topk_prob") or False),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)), **ids_for_vocab(V))


def write_config(cfg: ModelConfig) -> dict:
    return dict(architectures=["LLaDAMoEModelLM"], model_type="llada", **llama_fields(cfg),
                expert_intermediate_size=cfg.intermediate_size, num_experts=cfg.num_experts,
                num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                qk_layernorm=cfg.qk_norm, partial_rotary_factor=cfg.rotary / cfg.head_dim,
                moe_layer_freq=[1] * cfg.num_layers, moe_router_score_function="softmax",
                moe_router_enable_expert_bias=False, attention_bias=False)


def weights(cfg: ModelConfig) -> list[Entry]:
    """Qwen3-MoE tensor names (models.md B)."""
    return decoder_entries(cfg)


CHAT_TEMPLATE = (
    "{% set names = {'system': 'SYSTEM', 'user': 'HUMAN', 'assistant': 'ASSISTANT'} %}"
    "{% for m in messages %}<role>{{ names[m['role']] }}</role>{{ m['content'] }}<|role_end|>{% endfor %}"
    "{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}")

PRESETS = {
    # A few-hundred-kB LLaDA-MoE-shaped model for tests and demos (8 experts, top-2, GQA 4/2).
    "tiny": ModelConfig(
        family="llada_moe", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=32, rope_theta=50000.0, qk_norm=True, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=512, mask_token_id=127, eos_token_id=126,
        pad_token_id=126),
    "llada-moe-7b-a1b": ModelConfig(
        family="llada_moe", vocab_size=157184, hidden_size=2048, num_layers=16, num_heads=16,
        num_kv_heads=16, head_dim=128, intermediate_size=1024, rope_theta=50000.0, qk_norm=True,
        num_experts=64, num_experts_per_tok=8, max_position_embeddings=8192, **DEFAULT_IDS),
}

FAMILY = Family(
    name="llada_moe", architectures=("LLaDAMoEModelLM", "FusedLLaDAMoEModelLM"), read_config=read_config,
    write_config=write_config, weights=weights, default_ids=DEFAULT_IDS, chat_template=CHAT_TEMPLATE,
    bos_token="", presets=PRESETS,
    # dInfer's defaults for LLaDA-MoE (decoding.md 2.3): threshold 0.9, dual cache
    decoding=dict(block_length=64, strategy="threshold", threshold=0.9, cache="dual"),
)
