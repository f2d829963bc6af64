"""Independent PyTorch references from `transformers`, and tiny HF checkpoint folders on disk.

- LLaDA-MoE  <->  Qwen3MoeForCausalLM: same block (pre-norm, per-head q/k RMSNorm before NeoX RoPE,
  fp32-softmax router over all experts then top-k, norm_topk_prob=False, SwiGLU experts).
- LLaDA dense <-> LlamaForCausalLM (GQA allowed).

Bidirectionality: both reference models are run with attn_implementation="eager" and an explicit
4-D additive attention mask of shape (B, 1, L, L). transformers returns a 4-D mask unchanged
(masking_utils._preprocess_mask_arguments), so no causal triangle is added; the mask is 0 for
attended keys and -inf-like for padded keys. `tests/test_parity_transformers.py` asserts the
reference really is bidirectional (a later token changes an earlier position's logits) and that a
causal run disagrees with ours.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from dinfer_jax.config import ModelConfig
from dinfer_jax.families import to_hf_dict


def _randomize(model: torch.nn.Module, seed: int, std: float = 0.1):
    """Re-draw every weight ~ N(0, std); norm weights ~ 1 + N(0, std) so they matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
            p.copy_((1.0 + noise) if "norm" in name else noise)


def qwen3_moe_reference(cfg: ModelConfig, seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    hf = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=4 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, moe_intermediate_size=cfg.intermediate_size,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False, attention_bias=False,
        use_sliding_window=False, attn_implementation="eager")
    assert cfg.rotary == cfg.head_dim and cfg.qk_norm and not cfg.tie_word_embeddings
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf).eval()
    _randomize(model, seed)
    return model


def llama_reference(cfg: ModelConfig, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    hf = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=False, mlp_bias=False, attn_implementation="eager")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf).eval()
    _randomize(model, seed)
    return model


def llada_moe_state_dict(model) -> dict[str, torch.Tensor]:
    """Qwen3Moe state dict (transformers fuses experts as gate_up_proj (E, 2F, D), down_proj
    (E, D, F)) -> LLaDA-MoE HF names with per-expert tensors."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            F = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :F].clone()
                out[f"{pre}{e}.up_proj.weight"] = v[e, F:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e].clone()
        else:
            out[k] = v.clone()
    return out


def fuse_experts(sd: dict[str, torch.Tensor], num_layers: int, num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert LLaDA-MoE names -> dInfer's fused mlp.w1 (E, 2F, D) / mlp.w2 (E, D, F)."""
    out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    for l in range(num_layers):
        p = f"model.layers.{l}.mlp."
        out[p + "w1"] = torch.stack([torch.cat([sd[f"{p}experts.{e}.gate_proj.weight"],
                                                sd[f"{p}experts.{e}.up_proj.weight"]], 0)
                                     for e in range(num_experts)])
        out[p + "w2"] = torch.stack([sd[f"{p}experts.{e}.down_proj.weight"] for e in range(num_experts)])
    return out


_LLAMA_TO_LLADA = [
    ("model.embed_tokens.weight", "model.transformer.wte.weight"),
    ("model.norm.weight", "model.transformer.ln_f.weight"),
    ("lm_head.weight", "model.transformer.ff_out.weight"),
]
_LLAMA_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm", "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj", "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "ff_out",
}


def llada_state_dict(model, tied: bool = False) -> dict[str, torch.Tensor]:
    """Llama state dict -> LLaDA (dense) HF names."""
    out = {}
    for k, v in model.state_dict().items():
        if tied and k == "lm_head.weight":
            continue
        for a, b in _LLAMA_TO_LLADA:
            if k == a:
                out[b] = v.clone()
                break
        else:
            parts = k.split(".")  # model.layers.{i}.<sub>.weight
            sub = ".".join(parts[3:-1])
            out[f"model.transformer.blocks.{parts[2]}.{_LLAMA_LAYER[sub]}.weight"] = v.clone()
    return out


def write_hf_folder(folder: str, cfg: ModelConfig, sd: dict[str, torch.Tensor], fmt: str = "safetensors",
                    shards: int = 1, dtype: torch.dtype | None = None, hf_config: dict | None = None):
    """Write a real HF checkpoint folder: config.json + model.safetensors / sharded with index / .bin."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    sd = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in sd.items()}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config or to_hf_dict(cfg), f, indent=1)
    names = sorted(sd)
    ext = "safetensors" if fmt == "safetensors" else "bin"
    if shards == 1:
        fname = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
        groups = {fname: names}
    else:
        groups = {f"{'model' if ext == 'safetensors' else 'pytorch_model'}-{i + 1:05d}-of-{shards:05d}.{ext}":
                  names[i::shards] for i in range(shards)}
    for fname, keys in groups.items():
        part = {k: sd[k] for k in keys}
        if fmt == "safetensors":
            save_file(part, os.path.join(folder, fname), metadata={"format": "pt"})
        else:
            torch.save(part, os.path.join(folder, fname))
    if shards > 1:
        index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
        wm = {k: fname for fname, keys in groups.items() for k in keys}
        with open(os.path.join(folder, index), "w") as f:
            json.dump({"metadata": {}, "weight_map": wm}, f)


def bidirectional_logits(model, ids: np.ndarray, key_mask: np.ndarray | None = None) -> np.ndarray:
    """Reference logits with a full (non-causal) additive 4-D mask; padded keys get -1e30."""
    ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    B, L = ids_t.shape
    add = torch.zeros(B, 1, L, L, dtype=torch.float32)
    if key_mask is not None:
        km = torch.as_tensor(np.asarray(key_mask, bool))
        add = add.masked_fill(~km[:, None, None, :], -1e30)
    with torch.no_grad():
        return model(input_ids=ids_t, attention_mask=add).logits.float().numpy()


def causal_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


# ------------------------------------------------------------------------------------------- LLaDA2
# LLaDA2.x  <->  Glm4MoeForCausalLM: same block (pre-norm, per-head q/k RMSNorm before partial NeoX
# RoPE on the first head_dim * partial_rotary_factor dims, GQA), same leading dense layers
# (first_k_dense_replace), same router (fp32 sigmoid scores, e_score_correction_bias for the
# selection only, group-limited top-k on the sum of each group's two best biased scores, -inf for
# excluded groups, weights from unbiased scores renormalised + 1e-20, times routed_scaling_factor),
# same shared experts (one SwiGLU of width moe_intermediate_size * n_shared_experts, unweighted).
# Bridged differences (each checked by tests/test_llada2.py):
#   - names: embed_tokens -> word_embeddings, self_attn.o_proj -> attention.dense, q/k_norm ->
#     attention.query/key_layernorm, gate.e_score_correction_bias -> gate.expert_bias;
#   - q_proj/k_proj/v_proj -> one fused attention.query_key_value, rows [q heads | k heads | v heads];
#   - transformers' fused 3-D experts (gate_up_proj (E, 2F, D), down_proj (E, D, F)) -> per-expert;
#   - config keys: n_routed_experts / n_shared_experts -> num_experts / num_shared_experts;
#   - attention: Glm4Moe is causal; the block-causal mask is imposed as an explicit 4-D additive mask.


def glm4_moe_reference(cfg: ModelConfig, seed: int = 0, bias_std: float = 0.05):
    """A transformers Glm4MoeForCausalLM with cfg's shapes, random weights and a random expert bias."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    hf = Glm4MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.dense_intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, moe_intermediate_size=cfg.intermediate_size, n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, n_shared_experts=cfg.num_shared_experts, n_group=cfg.n_group,
        topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
        first_k_dense_replace=cfg.first_k_dense, rms_norm_eps=cfg.rms_norm_eps, use_qk_norm=cfg.qk_norm,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.rotary / cfg.head_dim},
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False, attention_bias=False,
        attn_implementation="eager")
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(hf).eval()
    _randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * bias_std)
    return model


def llada2_state_dict(model, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Glm4Moe state dict -> LLaDA2MoeModelLM HF names (fused query_key_value, per-expert tensors)."""
    sd = model.state_dict()
    out = {"model.word_embeddings.weight": sd["model.embed_tokens.weight"].clone(),
           "model.norm.weight": sd["model.norm.weight"].clone(), "lm_head.weight": sd["lm_head.weight"].clone()}
    for l in range(cfg.num_layers):
        s, d = f"model.layers.{l}.", f"model.layers.{l}."
        out[d + "attention.query_key_value.weight"] = torch.cat(
            [sd[s + f"self_attn.{p}_proj.weight"] for p in "qkv"], 0).clone()
        out[d + "attention.dense.weight"] = sd[s + "self_attn.o_proj.weight"].clone()
        if cfg.qk_norm:
            out[d + "attention.query_layernorm.weight"] = sd[s + "self_attn.q_norm.weight"].clone()
            out[d + "attention.key_layernorm.weight"] = sd[s + "self_attn.k_norm.weight"].clone()
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[d + f"{n}.weight"] = sd[s + f"{n}.weight"].clone()
        if l < cfg.first_k_dense:
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[d + f"mlp.{p}.weight"] = sd[s + f"mlp.{p}.weight"].clone()
            continue
        out[d + "mlp.gate.weight"] = sd[s + "mlp.gate.weight"].clone()
        out[d + "mlp.gate.expert_bias"] = sd[s + "mlp.gate.e_score_correction_bias"].clone()
        gu, dn = sd[s + "mlp.experts.gate_up_proj"], sd[s + "mlp.experts.down_proj"]
        F = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            out[d + f"mlp.experts.{e}.gate_proj.weight"] = gu[e, :F].clone()
            out[d + f"mlp.experts.{e}.up_proj.weight"] = gu[e, F:].clone()
            out[d + f"mlp.experts.{e}.down_proj.weight"] = dn[e].clone()
        for p in ("gate_proj", "up_proj", "down_proj"):
            out[d + f"mlp.shared_experts.{p}.weight"] = sd[s + f"mlp.shared_experts.{p}.weight"].clone()
    return out


def block_causal_logits(model, ids: np.ndarray, block: int, key_mask: np.ndarray | None = None,
                        positions: np.ndarray | None = None) -> np.ndarray:
    """Reference logits under the block-causal mask (key block <= query block, over `positions`,
    default arange), as an explicit additive 4-D mask; padded keys get -1e30."""
    ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    B, L = ids_t.shape
    pos = torch.as_tensor(np.broadcast_to(np.arange(L), (B, L)) if positions is None else np.asarray(positions))
    allowed = (pos[:, None, :] // block) <= (pos[:, :, None] // block)  # (B, Lq, Lk)
    if key_mask is not None:
        allowed = allowed & torch.as_tensor(np.asarray(key_mask, bool))[:, None, :]
    add = torch.zeros(B, 1, L, L, dtype=torch.float32).masked_fill(~allowed[:, None], -1e30)
    with torch.no_grad():
        return model(input_ids=ids_t, attention_mask=add, position_ids=pos.long()).logits.float().numpy()


# -------------------------------------------------------------------------------------------- Dream
# Dream (DreamModel)  <->  Qwen2ForCausalLM: the same Qwen2 block and the same tensor names (q/k/v
# with biases, o_proj without); Dream runs it bidirectionally (an explicit 4-D mask here, as above)
# and reads the logits shifted by one position, which is the sampler's business, not the model's.


def qwen2_reference(cfg: ModelConfig, seed: int = 0):
    """A transformers Qwen2ForCausalLM with cfg's shapes and random weights (biases included)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    assert cfg.qkv_bias and cfg.rotary == cfg.head_dim and not cfg.qk_norm and not cfg.is_moe
    hf = Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=cfg.rms_norm_eps, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        use_sliding_window=False, attn_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(hf).eval()
    _randomize(model, seed)
    return model


def dream_logits(model, ids: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
    """Logits the way DreamModel runs (reference §13.3/§13.5): positions cumsum(keep) - 1 (pads 1),
    the bool mask keep[query] & keep[key] as an additive 4-D mask (fully masked pad query rows are
    don't-care)."""
    ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    B, L = ids_t.shape
    keep_t = torch.ones(B, L, dtype=torch.bool) if keep is None else torch.as_tensor(np.asarray(keep, bool))
    pos = (keep_t.long().cumsum(-1) - 1).masked_fill(~keep_t, 1)
    allowed = keep_t[:, None, :, None] & keep_t[:, None, None, :]
    add = torch.zeros(B, 1, L, L).masked_fill(~allowed, -1e30)
    with torch.no_grad():
        return model(input_ids=ids_t, attention_mask=add, position_ids=pos).logits.float().numpy()


# --------------------------------------------------------------------------------------------- SDAR
# SDAR  <->  Qwen3ForCausalLM (dense) / Qwen3MoeForCausalLM (MoE): SDAR's network IS Qwen3's, same
# tensor names (dinfer_jax/families/sdar.py); only the attention mask differs, imposed here as an
# explicit block-causal 4-D additive mask (`block_causal_logits`).


def qwen3_reference(cfg: ModelConfig, seed: int = 0):
    """A transformers Qwen3ForCausalLM with cfg's shapes (tied embeddings allowed) and random weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    hf = Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=False, use_sliding_window=False, attn_implementation="eager")
    assert cfg.rotary == cfg.head_dim and cfg.qk_norm and not cfg.is_moe
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(hf).eval()
    _randomize(model, seed)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def sdar_state_dict(model, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Qwen3 / Qwen3Moe state dict -> SDAR HF names (the same names; experts per expert; a tied LM
    head is not stored, as save_pretrained does)."""
    sd = llada_moe_state_dict(model) if cfg.is_moe else {k: v.clone() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def convert_export_round_trip(hf_dir: str, tmp_dir) -> tuple[str, dict[str, np.ndarray]]:
    """HF folder -> our checkpoint -> HF folder again (converters.convert, then export) under tmp_dir;
    returns the exported folder and its tensors, read by safetensors' own numpy reader (not ours)."""
    from safetensors.numpy import load_file

    from converters import convert, export
    mid, back = os.path.join(str(tmp_dir), "ckpt"), os.path.join(str(tmp_dir), "hf_back")
    convert(hf_dir, mid, progress=False)
    export(mid, back, progress=False)
    got = {}
    for f in sorted(os.listdir(back)):
        if f.endswith(".safetensors"):
            got.update(load_file(os.path.join(back, f)))
    return back, got


def assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, torch.Tensor]):
    """The same tensor names, and per tensor the same dtype and bytes."""
    want = {k: v.numpy() for k, v in want.items()}
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k
