"""Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B and _1.5B): `Fast_dLLM_QwenForCausalLM`,
Qwen2.5 (q/k/v biases, Qwen2 tensor names) fine-tuned into block diffusion: block-causal attention
(blocks of `bd_size` = 32), logits shifted by one (`logit_shift=1`). Sources [F1]-[F2], its decoder
(sub-blocks, block cache) mapped onto SamplingParams, and what is assumed:
docs/internals/families.md (Fast-dLLM v2)."""
from __future__ import annotations

from converters.mappings import Entry, decoder_entries
from dinfer_jax.config import ConfigError, ModelConfig
from dinfer_jax.families import CHATML_TEMPLATE, Family
from dinfer_jax.families.qwen2_config import qwen2_fields, read_qwen2

# [F2] generate(): mask_id 151665, stop_token 151645 (<|im_end|>); Qwen2.5 <|endoftext|> 151643 = pad.
DEFAULT_IDS = dict(mask_token_id=151665, eos_token_id=151645, pad_token_id=151643, eot_token_id=None)
BLOCK_SIZE, SUB_BLOCK = 32, 8  # [F1] block_size, small_block_size
ARCH = "Fast_dLLM_QwenForCausalLM"


def read_config(hf, ids_for_vocab, where) -> ModelConfig:
    block = hf.get("bd_size", BLOCK_SIZE)
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ConfigError(f"{where}: bd_size={block!r} must be a positive integer (Fast-dLLM v2's block)")
    return read_qwen2(hf, ids_for_vocab, where, max_position_default=32768, family="fast_dllm_v2",
                      attention_mask="block_causal", block_size=block)


def write_config(cfg: ModelConfig) -> dict:
    out = dict(
        architectures=[ARCH], model_type="Fast_dLLM_Qwen",
        auto_map={"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                  "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        **qwen2_fields(cfg, "fast_dllm_v2", "block_causal", ARCH), bd_size=cfg.block_size,
        bos_token_id=cfg.pad_token_id)
    if cfg.eot_token_id is not None:
        out["eot_token_id"] = cfg.eot_token_id
    return out


def weights(cfg: ModelConfig) -> list[Entry]:
    """Qwen2 names with q/k/v biases [F2]; no lm_head when tied (1.5B, assumed)."""
    return decoder_entries(cfg)


# Qwen2.5 ChatML (docs/internals/families.md). A model folder's own chat_template (tokenizer_config.json) always wins.
CHAT_TEMPLATE = CHATML_TEMPLATE

_QWEN = dict(family="fast_dllm_v2", head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True,
             logit_shift=1, attention_mask="block_causal", block_size=BLOCK_SIZE, max_position_embeddings=32768,
             **DEFAULT_IDS)
PRESETS = {
    # Qwen2.5-7B-Instruct's shapes; layers / heads confirmed by [F2]'s README (ASSUMED: the rest).
    "fast-dllm-v2-7b": ModelConfig(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
                                   num_kv_heads=4, intermediate_size=18944, **_QWEN),
    # ASSUMED: Qwen2.5-1.5B-Instruct's shapes, tied embeddings.
    "fast-dllm-v2-1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
                                     num_kv_heads=2, intermediate_size=8960, tie_word_embeddings=True, **_QWEN),
    # Tiny Fast-dLLM-v2-shaped model for tests: GQA 4/2, biases, shifted logits, block 8.
    "tiny-fast-dllm-v2": ModelConfig(
        family="fast_dllm_v2", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True, logit_shift=1,
        attention_mask="block_causal", block_size=8, max_position_embeddings=512, mask_token_id=127,
        eos_token_id=126, pad_token_id=125),
}

FAMILY = Family(
    name="fast_dllm_v2", architectures=(ARCH,), read_config=read_config, write_config=write_config,
    weights=weights, default_ids=DEFAULT_IDS, chat_template=CHAT_TEMPLATE, bos_token="", presets=PRESETS,
    # [F1] run_chatbot.py: block 32, small block 8, threshold 0.9 (greedy: generate()'s temperature 0).
    decoding=dict(block_length=BLOCK_SIZE, sub_block_length=SUB_BLOCK, strategy="threshold", threshold=0.9,
                  cache="block"),
)
