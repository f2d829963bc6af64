"""LLaDA2.x (2.0 / 2.1 / 2.2, mini and flash): `LLaDA2MoeModelLM`, model_type `llada2_moe`.
Block-causal attention (blocks of 32), fused query_key_value, q/k RMSNorm, partial RoPE, a dense
first layer, then sigmoid group-limited MoE layers with one shared expert. A config asking for
another router / no expert bias is refused. Facts: docs/facts/llada2_and_dream.md §1-4;
docs/internals/families.md (LLaDA2.x)."""
from __future__ import annotations

from converters.mappings import Entry
from dinfer_jax.config import ConfigError, ModelConfig, need, partial_rotary_factor, rope_theta
from dinfer_jax.families import Family, llama_fields
from dinfer_jax.families.llada_moe import CHAT_TEMPLATE as LLADA_MOE_CHAT_TEMPLATE

# Token ids (docs/facts/llada2_and_dream.md §1.1): <|mask|> 156895, <|endoftext|> 156892 = eos = pad.
DEFAULT_IDS = dict(mask_token_id=156895, eos_token_id=156892, pad_token_id=156892, eot_token_id=None)
# LLaDA2.2 edit-control tokens (2nd-hand, fluxserve defaults; read from config.json when present).
EDIT_TOKENS = (("delete_token_id", 156930), ("split_token_id", 156931))
BLOCK_SIZE = 32  # generate()'s block_length default; the attention block of the block-causal mask
# generation_config.json keys read over the defaults: the HF generate() keyword arguments that are
# decoding settings (LLaDA2.0 / 2.1 share the names; 2.1 adds the editing ones).
GENERATION_FIELDS = ("gen_length", "block_length", "steps", "threshold", "editing_threshold", "max_post_steps",
                     "num_to_transfer", "temperature", "top_k", "top_p")


def read_config(hf, ids_for_vocab, where) -> ModelConfig:
    score = hf.get("score_function", "sigmoid")
    if score != "sigmoid":
        raise ConfigError(f"{where}: score_function={score!r}: the LLaDA2 router is sigmoid only")
    if hf.get("moe_router_enable_expert_bias") is False:
        raise ConfigError(f"{where}: moe_router_enable_expert_bias=false: the LLaDA2 router always has an "
                          f"expert bias (checkpoints carry mlp.gate.expert_bias)")
    if hf.get("use_qkv_bias") or hf.get("use_bias"):
        raise ConfigError(f"{where}: use_qkv_bias / use_bias=true: biases are not supported")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported")
    if (hf.get("rope_scaling") or {}).get("type", (hf.get("rope_scaling") or {}).get("rope_type", "default")) \
            not in ("default", None):
        raise ConfigError(f"{where}: rope_scaling={hf['rope_scaling']} is not supported")
    D = int(need(hf, "hidden_size", where=where))
    N = int(need(hf, "num_attention_heads", where=where))
    H = int(hf.get("head_dim") or D // N)
    rot = int(H * partial_rotary_factor(hf))
    V = int(need(hf, "vocab_size", where=where))
    k = int(need(hf, "num_experts_per_tok", where=where))
    ids = ids_for_vocab(V)
    extra = tuple((name, int(hf.get(name, default))) for name, default in EDIT_TOKENS
                  if (hf.get(name) is not None or default < V))
    return ModelConfig(
        family="llada2", vocab_size=V, hidden_size=D, num_layers=int(need(hf, "num_hidden_layers", where=where)),
        num_heads=N, num_kv_heads=int(hf.get("num_key_value_heads") or N), head_dim=H,
        intermediate_size=int(need(hf, "moe_intermediate_size", where=where)),
        rope_theta=rope_theta(hf, 600000.0), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rotary_dim=None if rot == H else rot,
        # The 2.0-era training configs omit use_qk_norm and the HF code then still applies it.
        qk_norm=bool(hf.get("use_qk_norm", True)),
        num_experts=int(need(hf, "num_experts", where=where)), num_experts_per_tok=k,
        norm_topk_prob=k > 1, router="sigmoid_group", n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        num_shared_experts=int(hf.get("num_shared_experts") or 0),
        first_k_dense=int(hf.get("first_k_dense_replace") or 0),
        dense_intermediate_size=int(hf.get("intermediate_size") or 0),
        attention_mask="block_causal", block_size=int(hf.get("block_size") or BLOCK_SIZE),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)), extra_token_ids=extra, **ids)


def write_config(cfg: ModelConfig) -> dict:
    out = dict(
        architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", **llama_fields(cfg),
        intermediate_size=cfg.dense_intermediate_size,
        moe_intermediate_size=cfg.intermediate_size, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, num_shared_experts=cfg.num_shared_experts,
        first_k_dense_replace=cfg.first_k_dense, n_group=cfg.n_group, topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor, score_function="sigmoid",
        moe_router_enable_expert_bias=True, norm_topk_prob=True, router_dtype="fp32",
        partial_rotary_factor=cfg.rotary / cfg.head_dim, rotary_dim=cfg.rotary, rope_scaling=None,
        use_qk_norm=cfg.qk_norm, use_qkv_bias=False, use_bias=False, use_rmsnorm=True, use_sliding_window=False,
        use_cache=False)
    if cfg.block_size != BLOCK_SIZE:
        out["block_size"] = cfg.block_size
    out.update(dict(cfg.extra_token_ids))
    return out


def weights(cfg: ModelConfig) -> list[Entry]:
    """Fused query_key_value rows are [all N query heads | K key heads | K value heads], head-major,
    H rows each (docs/facts/llada2_and_dream.md §2); layer l of our `layers` stack is HF layer l + first_k_dense."""
    N, K, H, k0 = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.first_k_dense
    qkv_rows = (N + 2 * K) * H

    def attn(prefix, stack, offset):
        L = prefix + ".{l}."
        qkv = L + "attention.query_key_value.weight"
        out = [
            Entry(f"{stack}/attn_norm/scale", L + "input_layernorm.weight", ("l",), layer_offset=offset),
            Entry(f"{stack}/mlp_norm/scale", L + "post_attention_layernorm.weight", ("l",), layer_offset=offset),
            Entry(f"{stack}/attn/q_proj", qkv, ("l",), 1, offset, (0, N * H), qkv_rows),
            Entry(f"{stack}/attn/k_proj", qkv, ("l",), 1, offset, (N * H, (N + K) * H), qkv_rows),
            Entry(f"{stack}/attn/v_proj", qkv, ("l",), 1, offset, ((N + K) * H, qkv_rows), qkv_rows),
            Entry(f"{stack}/attn/o_proj", L + "attention.dense.weight", ("l",), 2, offset),
        ]
        if cfg.qk_norm:
            out += [Entry(f"{stack}/attn/q_norm/scale", L + "attention.query_layernorm.weight", ("l",), layer_offset=offset),
                    Entry(f"{stack}/attn/k_norm/scale", L + "attention.key_layernorm.weight", ("l",), layer_offset=offset)]
        return out

    L = "model.layers.{l}."
    out = [Entry("embed/embedding", "model.word_embeddings.weight"),
           Entry("final_norm/scale", "model.norm.weight")]
    if k0:
        out += attn("model.layers", "dense_layers", 0)
        out += [Entry(f"dense_layers/mlp/{p}", L + f"mlp.{p}.weight", ("l",), 1) for p in ("gate_proj", "up_proj", "down_proj")]
    out += attn("model.layers", "layers", k0)
    out += [Entry("layers/mlp/router", L + "mlp.gate.weight", ("l",), 1, k0),
            Entry("layers/mlp/router_bias", L + "mlp.gate.expert_bias", ("l",), 0, k0)]
    out += [Entry(f"layers/mlp/{p}", L + f"mlp.experts.{{e}}.{p}.weight", ("l", "e"), 1, k0)
            for p in ("gate_proj", "up_proj", "down_proj")]
    if cfg.num_shared_experts:
        out += [Entry(f"layers/mlp/shared/{p}", L + f"mlp.shared_experts.{p}.weight", ("l",), 1, k0)
                for p in ("gate_proj", "up_proj", "down_proj")]
    if not cfg.tie_word_embeddings:
        out.append(Entry("lm_head/unembedding", "lm_head.weight"))
    return out


# LLaDA2 shares LLaDA-MoE's Ling tokenizer (same vocabulary and special ids) and, we assume, its role
# format (models.md B: <role>SYSTEM|HUMAN|ASSISTANT</role>{content}<|role_end|>, then
# <role>ASSISTANT</role>). A model folder's own chat_template (tokenizer_config.json) always wins.
CHAT_TEMPLATE = LLADA_MOE_CHAT_TEMPLATE

_MOE = dict(family="llada2", vocab_size=157184, head_dim=128, rope_theta=600000.0, rms_norm_eps=1e-6,
            rotary_dim=64, qk_norm=True, num_experts=256, num_experts_per_tok=8, norm_topk_prob=True,
            router="sigmoid_group", n_group=8, topk_group=4, routed_scaling_factor=2.5, num_shared_experts=1,
            first_k_dense=1, attention_mask="block_causal", block_size=BLOCK_SIZE,
            max_position_embeddings=32768, extra_token_ids=EDIT_TOKENS, **DEFAULT_IDS)
PRESETS = {
    # docs/facts/llada2_and_dream.md §1 table (2.1-mini config.json, 2nd-hand; dFactory training config, code)
    "llada2-mini": ModelConfig(hidden_size=2048, num_layers=20, num_heads=16, num_kv_heads=4, intermediate_size=512,
                               dense_intermediate_size=5120, **_MOE),
    # flash sizes from the dFactory training config (code); max_position_embeddings 32768 is 2nd-hand
    "llada2-flash": ModelConfig(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=4, intermediate_size=1024,
                                dense_intermediate_size=9216, **_MOE),
    # A tiny LLaDA2-shaped model for tests (16 experts in 4 groups, top-4 of 2 groups, shared expert).
    "tiny-llada2": ModelConfig(
        family="llada2", vocab_size=128, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=32, rope_theta=600000.0, rms_norm_eps=1e-6, rotary_dim=8, qk_norm=True, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, router="sigmoid_group", n_group=4, topk_group=2,
        routed_scaling_factor=2.5, num_shared_experts=1, first_k_dense=1, dense_intermediate_size=96,
        attention_mask="block_causal", block_size=8, max_position_embeddings=512, mask_token_id=127,
        eos_token_id=126, pad_token_id=126),
}

FAMILY = Family(
    name="llada2", architectures=("LLaDA2MoeModelLM",), read_config=read_config, write_config=write_config,
    weights=weights, default_ids=DEFAULT_IDS, chat_template=CHAT_TEMPLATE, bos_token="", presets=PRESETS,
    # LLaDA2.0's HF generate() defaults (docs/decoding_defaults.md): block diffusion, block 32, steps
    # 32 (the per-block transfer schedule), threshold 0.95, temperature 0, no editing. A folder whose
    # generation_config.json names editing_threshold (LLaDA2.1 / 2.2) gets LLaDA2.1's sampler: its
    # values over these, `steps` dropped (2.1's generate() ignores it), max_post_steps 16.
    decoding=dict(block_length=BLOCK_SIZE, strategy="threshold", threshold=0.95, steps=BLOCK_SIZE, cache="block"),
    generation_fields=GENERATION_FIELDS,
)
