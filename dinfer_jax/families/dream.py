"""Dream-7B (Dream-v0-Base / Instruct) and DiffuCoder-7B: `DreamModel`, model_type "Dream".

A Qwen2.5-7B block (pre-norm RMSNorm, GQA 28/4, head_dim 128, full NeoX RoPE theta 1e6, SwiGLU,
q/k/v projections WITH biases, o_proj without), run with full bidirectional attention, and an
AR-style head: the logits that decode position i are the raw output row i - 1 (`logit_shift=1`).
Facts: shared/reference/llada2_and_dream.md §13 (config §13.1, state dict §13.2, forward §13.3,
shift §13.4, sampler §13.5; DiffuCoder §13.6 shares the architecture and, assumed, the sampler).
DiffuCoder's sampler, what is public [apple/ml-diffucoder @ f735e01, inference_demo.py and README]:
it is called as `model.diffusion_generate(input_ids, attention_mask, max_new_tokens, steps,
temperature, top_p, alg, alg_temp)`, Dream's argument set, with alg "entropy", alg_temp 0,
temperature 0.2-0.4, top_p 0.95 and steps = max_new_tokens (one token per step); the Instruct
model's answer is the text before the first `<|dlm_pad|>` (its padding token; the Base model's
before EOS). Here: strategy="dream", alg="entropy"; the answer is cut at EOS or at the folder's
end-of-turn token (`<|im_end|>` found in tokenizer.json: ModelConfig.eot_token_id), the chat
turn's end. Its generation_utils.py itself was not read.

The HF files are remote code (no AutoModelForCausalLM); their names are Qwen2's, so a transformers
`Qwen2ForCausalLM` with the same weights and an explicit bidirectional 4-D mask computes the same
logits (tests/test_dream.py checks ours against it).
"""
from __future__ import annotations

from converters.mappings import Entry, decoder_entries
from dinfer_jax.config import ConfigError, ModelConfig, need, rope_theta
from dinfer_jax.families import CHATML_TEMPLATE, Family

# Qwen2.5 tokenizer ids (§13.1): <|mask|> 151666; <|endoftext|> 151643 = eos = pad = bos.
DEFAULT_IDS = dict(mask_token_id=151666, eos_token_id=151643, pad_token_id=151643, eot_token_id=None)


def read_config(hf, ids_for_vocab, where) -> ModelConfig:
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported (Dream attends the whole canvas)")
    if hf.get("use_mrope"):
        raise ConfigError(f"{where}: use_mrope=true (multimodal RoPE) is not supported")
    rs = hf.get("rope_scaling") or {}
    if rs and rs.get("rope_type", rs.get("type", "default")) not in ("default", None):
        raise ConfigError(f"{where}: rope_scaling={hf['rope_scaling']} is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported")
    D = int(need(hf, "hidden_size", where=where))
    N = int(need(hf, "num_attention_heads", where=where))
    V = int(need(hf, "vocab_size", where=where))
    return ModelConfig(
        family="dream", vocab_size=V, hidden_size=D, num_layers=int(need(hf, "num_hidden_layers", where=where)),
        num_heads=N, num_kv_heads=int(hf.get("num_key_value_heads") or N), head_dim=int(hf.get("head_dim") or D // N),
        intermediate_size=int(need(hf, "intermediate_size", where=where)), rope_theta=rope_theta(hf, 1000000.0),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=True, logit_shift=1,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)), **ids_for_vocab(V))


def write_config(cfg: ModelConfig) -> dict:
    if not (cfg.qkv_bias and cfg.logit_shift == 1 and cfg.rotary == cfg.head_dim and not cfg.qk_norm
            and not cfg.is_moe and cfg.attention_mask == "full"):
        raise ConfigError("a dream config needs qkv_bias, logit_shift=1, full rotary, no qk_norm, dense MLP, "
                          "full attention (the DreamModel architecture)")
    return dict(
        architectures=["DreamModel"], model_type="Dream",
        auto_map={"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        hidden_act="silu", vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling=None, tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings, use_cache=False, use_sliding_window=False,
        sliding_window=None, max_window_layers=cfg.num_layers, attention_dropout=0.0,
        mask_token_id=cfg.mask_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.eos_token_id)


def weights(cfg: ModelConfig) -> list[Entry]:
    """Qwen2 names with q/k/v biases (reference §13.2)."""
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
