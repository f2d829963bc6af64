"""Dream-7B (Dream-v0-Base / Instruct) and DiffuCoder-7B: `DreamModel`, model_type "Dream".

A Qwen2.5-7B block (q/k/v biases) with full bidirectional attention and shifted logits
(`logit_shift=1`). Facts: docs/facts/llada2_and_dream.md §13; DiffuCoder's sampler and the parity
check: docs/internals/families.md (Dream)."""
from __future__ import annotations

from converters.mappings import Entry, decoder_entries
from dinfer_jax.config import ConfigError, ModelConfig
from dinfer_jax.families import CHATML_TEMPLATE, Family
from dinfer_jax.families.qwen2_config import qwen2_fields, read_qwen2

# Qwen2.5 tokenizer ids (§13.1): <|mask|> 151666; <|endoftext|> 151643 = eos = pad = bos.
DEFAULT_IDS = dict(mask_token_id=151666, eos_token_id=151643, pad_token_id=151643, eot_token_id=None)


def read_config(hf, ids_for_vocab, where) -> ModelConfig:
    if hf.get("use_mrope"):
        raise ConfigError(f"{where}: use_mrope=true (multimodal RoPE) is not supported")
    return read_qwen2(hf, ids_for_vocab, where, max_position_default=131072,
                      sliding_window_note=" (Dream attends the whole canvas)", family="dream")


def write_config(cfg: ModelConfig) -> dict:
    return dict(
        architectures=["DreamModel"], model_type="Dream",
        auto_map={"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        **qwen2_fields(cfg, "dream", "full", "DreamModel"), bos_token_id=cfg.eos_token_id)


def weights(cfg: ModelConfig) -> list[Entry]:
    """Qwen2 names with q/k/v biases (docs/facts/llada2_and_dream.md §13.2)."""
    return decoder_entries(cfg)


# Qwen's ChatML turn format. A model folder's own chat_template (tokenizer_config.json) always wins.
CHAT_TEMPLATE = CHATML_TEMPLATE

_QWEN = dict(family="dream", rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True, logit_shift=1)
PRESETS = {
    # §13.1 (DiffuCoder-7B-Instruct config.json, 2nd-hand; Dream-v0 assumed the same shapes)
    "dream-7b": ModelConfig(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                            head_dim=128, intermediate_size=18944, max_position_embeddings=131072,
                            **_QWEN, **DEFAULT_IDS),
    # A tiny Dream-shaped model for tests (GQA 4/2, biases, shifted logits).
    "tiny-dream": ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                              intermediate_size=128, max_position_embeddings=512, mask_token_id=127,
                              eos_token_id=126, pad_token_id=126, **_QWEN),
}

FAMILY = Family(
    name="dream", architectures=("DreamModel",), read_config=read_config, write_config=write_config,
    weights=weights, default_ids=DEFAULT_IDS, chat_template=CHAT_TEMPLATE, bos_token="", presets=PRESETS,
    # Dream's own sampler over the whole canvas (one block), the README example's alg "entropy" with
    # steps = gen_length and eps 1e-3, greedy (the README samples at temperature 0.2, top_p 0.95;
    # generation_config.json's alg is "origin"). Cache none: every step is a full forward, as in Dream.
    # steps: None = gen_length (the README's steps = max_new_tokens).
    decoding=dict(gen_length=128, block_length=128, strategy="dream", alg="entropy", eps=1e-3, alg_temp=0.0,
                  cache="none"),
)
