"""SDAR (JetLM/SDAR-{1.7B,4B,8B}-Chat, SDAR-30B-A3B): Qwen3 (`SDARForCausalLM`) and Qwen3-MoE
(`SDARMoeForCausalLM`) converted to block diffusion: Qwen3's network and tensor names, block-causal
attention (blocks of `block_size` = 4), logits NOT shifted. Sources [C1]-[C4], what is assumed, and
SDAR's generate() / remasking rules mapped onto SamplingParams: docs/internals/families.md (SDAR)."""
from __future__ import annotations

from converters.mappings import Entry, decoder_entries
from dinfer_jax.config import ConfigError, ModelConfig, need, rope_theta
from dinfer_jax.families import CHATML_TEMPLATE, Family, llama_fields

# [C1]: <MASK> 151669 (config.json mask_token_id), <|endoftext|> 151643 = bos = eos = pad,
# <|im_end|> 151645 ends a chat turn (generation_config.json's first eos).
DEFAULT_IDS = dict(mask_token_id=151669, eos_token_id=151643, pad_token_id=151643, eot_token_id=151645)
BLOCK_SIZE = 4  # config.json block_size [C1]; SGLang DLLM_PARAMS [C4]
ARCH_DENSE, ARCH_MOE = "SDARForCausalLM", "SDARMoeForCausalLM"


def read_config(hf, ids_for_vocab, where) -> ModelConfig:
    arch = hf["architectures"][0]
    if hf.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true: biases are not supported (SDAR/Qwen3 has none)")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported")
    rs = hf.get("rope_scaling") or {}
    if rs.get("rope_type", rs.get("type", "default")) not in ("default", None):
        raise ConfigError(f"{where}: rope_scaling={hf['rope_scaling']} is not supported")
    D = int(need(hf, "hidden_size", where=where))
    N = int(need(hf, "num_attention_heads", where=where))
    H = int(hf.get("head_dim") or D // N)
    V = int(need(hf, "vocab_size", where=where))
    block = hf.get("block_size")
    block = BLOCK_SIZE if block is None else block  # absent in one 8B config copy [C1]: the default 4
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ConfigError(f"{where}: block_size={block!r} must be a positive integer (SDAR's attention block)")
    moe = {}
    if arch == ARCH_MOE:
        if hf.get("mlp_only_layers"):
            raise ConfigError(f"{where}: mlp_only_layers={hf['mlp_only_layers']}: only all-MoE layer stacks are "
                              f"supported")
        if int(hf.get("decoder_sparse_step", 1)) != 1:
            raise ConfigError(f"{where}: decoder_sparse_step={hf['decoder_sparse_step']}: only all-MoE layer "
                              f"stacks (1) are supported")
        moe = dict(num_experts=int(need(hf, "num_experts", where=where)),
                   num_experts_per_tok=int(need(hf, "num_experts_per_tok", where=where)),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)), router="softmax")
        F = int(need(hf, "moe_intermediate_size", where=where))
    else:
        F = int(need(hf, "intermediate_size", where=where))
    return ModelConfig(
        family="sdar", vocab_size=V, hidden_size=D, num_layers=int(need(hf, "num_hidden_layers", where=where)),
        num_heads=N, num_kv_heads=int(hf.get("num_key_value_heads") or N), head_dim=H, intermediate_size=F,
        rope_theta=rope_theta(hf, 1000000.0), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qk_norm=True,
        attention_mask="block_causal", block_size=block, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)), **moe, **ids_for_vocab(V))


def write_config(cfg: ModelConfig) -> dict:
    out = dict(
        architectures=[ARCH_MOE if cfg.is_moe else ARCH_DENSE], model_type="sdar_moe" if cfg.is_moe else "sdar",
        **llama_fields(cfg), rope_scaling=None, attention_bias=False, attention_dropout=0.0,
        use_sliding_window=False, sliding_window=None, block_size=cfg.block_size, bos_token_id=cfg.eos_token_id,
        use_cache=False)
    if cfg.is_moe:
        out.update(moe_intermediate_size=cfg.intermediate_size, num_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[])
    else:
        out["intermediate_size"] = cfg.intermediate_size
    if cfg.eot_token_id is not None:
        out["eot_token_id"] = cfg.eot_token_id
    return out


def weights(cfg: ModelConfig) -> list[Entry]:
    """Qwen3 / Qwen3-MoE tensor names [C1, C3]."""
    return decoder_entries(cfg)


# Qwen3 ChatML [C1 chat_template.jinja, its plain-message path; tools and <think> handling are in the
# model folder's own template, which always wins].
CHAT_TEMPLATE = CHATML_TEMPLATE

_QWEN = dict(family="sdar", vocab_size=151936, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, qk_norm=True,
             attention_mask="block_causal", block_size=BLOCK_SIZE, max_position_embeddings=32768, **DEFAULT_IDS)
_TINY = dict(family="sdar", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             rope_theta=1000000.0, rms_norm_eps=1e-6, qk_norm=True, attention_mask="block_causal",
             block_size=BLOCK_SIZE, max_position_embeddings=512, mask_token_id=127, eos_token_id=126,
             pad_token_id=126, eot_token_id=125)
PRESETS = {
    # [C1] config.json (verified, also against the safetensors index's total_size)
    "sdar-4b": ModelConfig(hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=9728,
                           **_QWEN),
    "sdar-8b": ModelConfig(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=12288,
                           **_QWEN),
    # ASSUMED: Qwen3-1.7B's shapes (config.json not seen), tied embeddings as Qwen3-1.7B
    "sdar-1.7b": ModelConfig(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=6144,
                             tie_word_embeddings=True, **_QWEN),
    # ASSUMED: Qwen3-30B-A3B's shapes (config.json not seen): 48 layers, 128 experts of width 768, top-8
    "sdar-30b-a3b": ModelConfig(hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, intermediate_size=768,
                                num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, router="softmax",
                                **_QWEN),
    # Tiny SDAR-shaped models for tests: dense with tied embeddings (like 1.7B), and MoE (8 experts, top-2).
    "tiny-sdar": ModelConfig(intermediate_size=128, tie_word_embeddings=True, **_TINY),
    "tiny-sdar-moe": ModelConfig(intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 router="softmax", **_TINY),
}

FAMILY = Family(
    name="sdar", architectures=(ARCH_DENSE, ARCH_MOE), read_config=read_config, write_config=write_config,
    weights=weights, default_ids=DEFAULT_IDS, chat_template=CHAT_TEMPLATE, bos_token="", presets=PRESETS,
    # generate.py's CLI defaults [C2]: block 4, denoising_steps 4, low_confidence_dynamic at 0.85
    # (docs/internals/families.md, SDAR); greedy (temperature 0) here, where generate.py samples at temperature 1.
    decoding=dict(block_length=BLOCK_SIZE, strategy="threshold", threshold=0.85, steps=BLOCK_SIZE, cache="block"),
)
