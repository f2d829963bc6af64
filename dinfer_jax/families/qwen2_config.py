"""The Qwen2 config.json reader and writer shared by the Qwen2-based families (Dream, Fast-dLLM v2);
not a family itself."""
from __future__ import annotations

from dinfer_jax.config import ConfigError, ModelConfig, need, rope_theta
from dinfer_jax.families import llama_fields


def read_qwen2(hf, ids_for_vocab, where, *, max_position_default: int, sliding_window_note: str = "",
               **family_fields) -> ModelConfig:
    """config.json of a Qwen2 decoder (SwiGLU, q/k/v biases, shifted logits) -> ModelConfig with
    `family_fields` (family, attention_mask, block_size, ...). Unsupported Qwen2 options are refused."""
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported{sliding_window_note}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported")
    rs = hf.get("rope_scaling") or {}
    if rs and rs.get("rope_type", rs.get("type", "default")) not in ("default", None):
        raise ConfigError(f"{where}: rope_scaling={hf['rope_scaling']} is not supported")
    D = int(need(hf, "hidden_size", where=where))
    N = int(need(hf, "num_attention_heads", where=where))
    V = int(need(hf, "vocab_size", where=where))
    return ModelConfig(
        vocab_size=V, hidden_size=D, num_layers=int(need(hf, "num_hidden_layers", where=where)), num_heads=N,
        num_kv_heads=int(hf.get("num_key_value_heads") or N), head_dim=int(hf.get("head_dim") or D // N),
        intermediate_size=int(need(hf, "intermediate_size", where=where)), rope_theta=rope_theta(hf, 1000000.0),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=True, logit_shift=1,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", max_position_default)),
        **family_fields, **ids_for_vocab(V))


def qwen2_fields(cfg: ModelConfig, family: str, attention_mask: str, arch: str) -> dict:
    """The Qwen2 fields of config.json for cfg (checked to be a Qwen2 decoder with `attention_mask`);
    the caller adds architectures, model_type, auto_map, bos and its own fields."""
    if not (cfg.qkv_bias and cfg.logit_shift == 1 and cfg.rotary == cfg.head_dim and not cfg.qk_norm
            and not cfg.is_moe and cfg.attention_mask == attention_mask):
        raise ConfigError(f"a {family} config needs qkv_bias, logit_shift=1, full rotary, no qk_norm, dense "
                          f"MLP, {attention_mask.replace('_', '-')} attention (the {arch} architecture)")
    return dict(
        **llama_fields(cfg), intermediate_size=cfg.intermediate_size, rope_scaling=None, use_cache=False,
        use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers, attention_dropout=0.0)
