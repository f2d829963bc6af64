"""LLaDA dense (LLaDA-8B, LLaDA-1.5): `LLaDAModelLM`, OLMo-style names, full bidirectional attention.
Facts: docs/facts/models.md (A)."""
from __future__ import annotations

from converters.mappings import Entry
from dinfer_jax.config import ConfigError, ModelConfig, need, rope_theta
from dinfer_jax.families import Family

DEFAULT_IDS = dict(mask_token_id=126336, eos_token_id=126081, pad_token_id=126081, eot_token_id=126348)


def read_config(hf, ids_for_vocab, where) -> ModelConfig:
    if hf.get("attention_layer_norm"):
        raise ConfigError(f"{where}: attention_layer_norm=true (qk-norm over the full width) is not supported")
    if hf.get("alibi"):
        raise ConfigError(f"{where}: alibi=true is not supported")
    if hf.get("include_bias") or hf.get("include_qkv_bias"):
        raise ConfigError(f"{where}: biases (include_bias / include_qkv_bias) are not supported")
    D = int(need(hf, "d_model", where=where))
    N = int(need(hf, "n_heads", where=where))
    K = int(hf.get("n_kv_heads") or N)
    F = hf.get("mlp_hidden_size") or int(hf.get("mlp_ratio", 4)) * D
    V = int(hf.get("embedding_size") or need(hf, "vocab_size", where=where))
    return ModelConfig(
        family="llada", vocab_size=V, hidden_size=D, num_layers=int(need(hf, "n_layers", where=where)),
        num_heads=N, num_kv_heads=K, head_dim=D // N, intermediate_size=int(F),
        rope_theta=rope_theta(hf, 10000.0), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(hf.get("weight_tying", False)),
        max_position_embeddings=int(hf.get("max_sequence_length", 4096)), **ids_for_vocab(V))


def write_config(cfg: ModelConfig) -> dict:
    return dict(architectures=["LLaDAModelLM"], model_type="llada", d_model=cfg.hidden_size,
                n_layers=cfg.num_layers, n_heads=cfg.num_heads, n_kv_heads=cfg.num_kv_heads,
                mlp_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                embedding_size=cfg.vocab_size, weight_tying=cfg.tie_word_embeddings,
                max_sequence_length=cfg.max_position_embeddings, rope=True, block_type="llama",
                activation_type="silu", layer_norm_type="rms", attention_layer_norm=False,
                include_bias=False, eot_token_id=cfg.eot_token_id, mask_token_id=cfg.mask_token_id,
                eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, rms_norm_eps=cfg.rms_norm_eps,
                rope_theta=cfg.rope_theta)


def weights(cfg: ModelConfig) -> list[Entry]:
    B = "model.transformer.blocks.{l}."
    out = [
        Entry("embed/embedding", "model.transformer.wte.weight"),
        Entry("final_norm/scale", "model.transformer.ln_f.weight"),
        Entry("layers/attn_norm/scale", B + "attn_norm.weight", ("l",)),
        Entry("layers/mlp_norm/scale", B + "ff_norm.weight", ("l",)),
        Entry("layers/attn/q_proj", B + "q_proj.weight", ("l",), 1),
        Entry("layers/attn/k_proj", B + "k_proj.weight", ("l",), 1),
        Entry("layers/attn/v_proj", B + "v_proj.weight", ("l",), 1),
        Entry("layers/attn/o_proj", B + "attn_out.weight", ("l",), 2),
        Entry("layers/mlp/gate_proj", B + "ff_proj.weight", ("l",), 1),
        Entry("layers/mlp/up_proj", B + "up_proj.weight", ("l",), 1),
        Entry("layers/mlp/down_proj", B + "ff_out.weight", ("l",), 1),
    ]
    if not cfg.tie_word_embeddings:
        out.append(Entry("lm_head/unembedding", "model.transformer.ff_out.weight"))
    return out


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

PRESETS = {
    "tiny-dense": ModelConfig(
        family="llada", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=16, intermediate_size=128, rope_theta=500000.0, max_position_embeddings=512,
        mask_token_id=127, eos_token_id=126, pad_token_id=126),
    "llada-8b": ModelConfig(
        family="llada", vocab_size=126464, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
        head_dim=128, intermediate_size=12288, rope_theta=500000.0, max_position_embeddings=4096, **DEFAULT_IDS),
}

FAMILY = Family(
    name="llada", architectures=("LLaDAModelLM",), read_config=read_config, write_config=write_config,
    weights=weights, default_ids=DEFAULT_IDS, chat_template=CHAT_TEMPLATE, bos_token="<|startoftext|>",
    presets=PRESETS,
    # dInfer's defaults, as for LLaDA-MoE (docs/decoding_defaults.md): threshold 0.9, block 64, dual
    # cache. LLaDA's own generate() (gen 128, block 32, steps 128, low-confidence remasking, no cache)
    # is SamplingParams(gen_length=128, block_length=32, strategy="fixed", steps=128, cache="none").
    decoding=dict(block_length=64, strategy="threshold", threshold=0.9, cache="dual"),
)
