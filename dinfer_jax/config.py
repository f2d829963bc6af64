"""ModelConfig: one frozen description of a dLLM, read from a Hugging Face `config.json`.

Both supported families (LLaDA dense, LLaDA-MoE) are described by the same fields; the layers
read only these fields, never the family name. The family decides the checkpoint's weight names
(see `converters/`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model."""


# architecture name (config.json "architectures"[0]) -> family
ARCHITECTURES = {
    "LLaDAModelLM": "llada",
    "LLaDAMoEModelLM": "llada_moe",
    "FusedLLaDAMoEModelLM": "llada_moe",  # dInfer's fused-expert layout (converters/ reads mlp.w1/w2)
}

# Documented defaults when config.json omits the special ids (shared/reference/models.md).
_FAMILY_DEFAULT_IDS = {
    "llada": dict(mask_token_id=126336, eos_token_id=126081, pad_token_id=126081, eot_token_id=126348),
    "llada_moe": dict(mask_token_id=156895, eos_token_id=156892, pad_token_id=156892, eot_token_id=None),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one model.

    Letters (DESIGN.md): V vocab, D hidden, N query heads, K kv heads, H head dim,
    F dense ffn width (or expert ffn width when `num_experts > 0`), E experts, X top-k.
    """

    family: str
    vocab_size: int  # V
    hidden_size: int  # D
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    intermediate_size: int  # F (dense MLP width, or per-expert width when num_experts > 0)
    rope_theta: float
    rms_norm_eps: float = 1e-5
    rotary_dim: int | None = None  # None -> H (full rotary); else the first rotary_dim dims rotate
    qk_norm: bool = False  # per-head RMSNorm over H on q and k, before RoPE
    num_experts: int = 0  # E; 0 -> dense SwiGLU MLP
    num_experts_per_tok: int = 0  # X
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    mask_token_id: int = 0
    eos_token_id: int = 0
    pad_token_id: int | None = None
    eot_token_id: int | None = None

    def __post_init__(self):
        problems = []
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rotary_dim is not None and (self.rotary_dim <= 0 or self.rotary_dim > self.head_dim
                                            or self.rotary_dim % 2):
            problems.append(f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                problems.append(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                                f"[1, num_experts={self.num_experts}]")
        for name in ("mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id"):
            v = getattr(self, name)
            if (v is not None or name in ("mask_token_id", "eos_token_id")) and not 0 <= v < self.vocab_size:
                problems.append(f"{name}={getattr(self, name)} outside the vocabulary [0, {self.vocab_size})")
        if problems:
            raise ConfigError("invalid ModelConfig: " + "; ".join(problems))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def num_params(self) -> int:
        """Total parameter count (embeddings and LM head included)."""
        D, N, K, H, F, V = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                            self.intermediate_size, self.vocab_size)
        attn = D * N * H * 2 + D * K * H * 2 + (2 * H if self.qk_norm else 0)
        mlp = (self.num_experts * 3 * D * F + D * self.num_experts) if self.is_moe else 3 * D * F
        per_layer = attn + mlp + 2 * D
        return self.num_layers * per_layer + V * D * (1 if self.tie_word_embeddings else 2) + D


# ---------------------------------------------------------------------------------------------
# Reading a Hugging Face config.json


def _need(cfg: Mapping[str, Any], *keys: str, where: str):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    raise ConfigError(f"{where}: config.json has none of the keys {list(keys)}")


def _rope_theta(cfg: Mapping[str, Any], default: float) -> float:
    if cfg.get("rope_theta") is not None:
        return float(cfg["rope_theta"])
    rp = cfg.get("rope_parameters") or {}
    if rp.get("rope_theta") is not None:
        return float(rp["rope_theta"])
    return default


def family_of(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        raise ConfigError("config.json has no 'architectures' entry; supported: "
                          + ", ".join(sorted(ARCHITECTURES)))
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {arch!r} in config.json; supported: "
                          + ", ".join(sorted(ARCHITECTURES)))
    return ARCHITECTURES[arch]


def from_hf_dict(hf: Mapping[str, Any], file_ids: Mapping[str, int] | None = None) -> ModelConfig:
    """ModelConfig from the contents of a Hugging Face config.json (either family).

    Special ids: config.json first, then `file_ids` (read from the folder's generation_config.json
    and tokenizer files by `special_ids_from_files`), then the family's documented defaults."""
    family = family_of(hf)
    where = f"{hf['architectures'][0]} config"
    ids = dict(_FAMILY_DEFAULT_IDS[family])
    for k in ids:
        if hf.get(k) is not None:
            ids[k] = int(hf[k])
        elif k in hf and k in ("pad_token_id", "eot_token_id"):
            ids[k] = None  # explicitly null in config.json
        elif file_ids and file_ids.get(k) is not None:
            ids[k] = int(file_ids[k])
    if family == "llada":
        if hf.get("attention_layer_norm"):
            raise ConfigError(f"{where}: attention_layer_norm=true (qk-norm over the full width) is not supported")
        if hf.get("alibi"):
            raise ConfigError(f"{where}: alibi=true is not supported")
        if hf.get("include_bias") or hf.get("include_qkv_bias"):
            raise ConfigError(f"{where}: biases (include_bias / include_qkv_bias) are not supported")
        D = int(_need(hf, "d_model", where=where))
        N = int(_need(hf, "n_heads", where=where))
        K = int(hf.get("n_kv_heads") or N)
        F = hf.get("mlp_hidden_size") or int(hf.get("mlp_ratio", 4)) * D
        V = int(hf.get("embedding_size") or _need(hf, "vocab_size", where=where))
        return ModelConfig(
            family=family, vocab_size=V, hidden_size=D, num_layers=int(_need(hf, "n_layers", where=where)),
            num_heads=N, num_kv_heads=K, head_dim=D // N, intermediate_size=int(F),
            rope_theta=_rope_theta(hf, 10000.0), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("weight_tying", False)),
            max_position_embeddings=int(hf.get("max_sequence_length", 4096)), **ids)
    # llada_moe
    if hf.get("moe_router_enable_expert_bias"):
        raise ConfigError(f"{where}: moe_router_enable_expert_bias=true is not supported yet")
    if hf.get("shared_expert_intermediate_size"):
        raise ConfigError(f"{where}: shared experts are not supported yet")
    freq = hf.get("moe_layer_freq")
    if freq is not None and not all(int(f) == 1 for f in (freq if isinstance(freq, list) else [freq])):
        raise ConfigError(f"{where}: moe_layer_freq={freq}: only all-MoE layer stacks are supported")
    D = int(_need(hf, "hidden_size", where=where))
    N = int(_need(hf, "num_attention_heads", where=where))
    H = int(hf.get("head_dim") or D // N)
    prf = float(hf.get("partial_rotary_factor") or 1.0)
    rot = int(H * prf)
    return ModelConfig(
        family=family, vocab_size=int(_need(hf, "vocab_size", where=where)), hidden_size=D,
        num_layers=int(_need(hf, "num_hidden_layers", where=where)), num_heads=N,
        num_kv_heads=int(hf.get("num_key_value_heads") or N), head_dim=H,
        intermediate_size=int(_need(hf, "expert_intermediate_size", "moe_intermediate_size", where=where)),
        rope_theta=_rope_theta(hf, 50000.0), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rotary_dim=None if rot == H else rot, qk_norm=bool(hf.get("qk_layernorm", True)),
        num_experts=int(_need(hf, "num_experts", where=where)),
        num_experts_per_tok=int(_need(hf, "num_experts_per_tok", where=where)),
        # The reference modeling code hard-codes norm_topk_prob=False; honour an explicit true.
        norm_topk_prob=bool(hf.get("norm_topk_prob") or False),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)), **ids)


def to_hf_dict(cfg: ModelConfig) -> dict:
    """A config.json for `cfg` in its family's Hugging Face format (used by export and tests)."""
    common = dict(mask_token_id=cfg.mask_token_id, eos_token_id=cfg.eos_token_id,
                  pad_token_id=cfg.pad_token_id, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta)
    if cfg.family == "llada":
        return dict(architectures=["LLaDAModelLM"], model_type="llada", d_model=cfg.hidden_size,
                    n_layers=cfg.num_layers, n_heads=cfg.num_heads, n_kv_heads=cfg.num_kv_heads,
                    mlp_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                    embedding_size=cfg.vocab_size, weight_tying=cfg.tie_word_embeddings,
                    max_sequence_length=cfg.max_position_embeddings, rope=True, block_type="llama",
                    activation_type="silu", layer_norm_type="rms", attention_layer_norm=False,
                    include_bias=False, eot_token_id=cfg.eot_token_id, **common)
    if cfg.family == "llada_moe":
        return dict(architectures=["LLaDAMoEModelLM"], model_type="llada", hidden_size=cfg.hidden_size,
                    num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                    num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    expert_intermediate_size=cfg.intermediate_size, num_experts=cfg.num_experts,
                    num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                    qk_layernorm=cfg.qk_norm, partial_rotary_factor=cfg.rotary / cfg.head_dim,
                    vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                    max_position_embeddings=cfg.max_position_embeddings, hidden_act="silu",
                    moe_layer_freq=[1] * cfg.num_layers, moe_router_score_function="softmax",
                    moe_router_enable_expert_bias=False, attention_bias=False, **common)
    raise ConfigError(f"unknown family {cfg.family!r}")


MASK_TOKEN_NAMES = ("<|mdm_mask|>", "<|mask|>", "<mask>", "[MASK]")


def special_ids_from_files(folder: str | os.PathLike) -> dict[str, int]:
    """Special token ids named by a model folder's side files: generation_config.json
    (eos/pad/mask ids; a list of EOS ids gives the first) and tokenizer_config.json +
    tokenizer.json (eos/pad token names looked up among the added tokens; the mask token by its
    usual names; <|eot_id|>)."""
    out: dict[str, int] = {}

    def read(name):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return {}
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}
        return d if isinstance(d, dict) else {}

    gen = read("generation_config.json")
    for k in ("eos_token_id", "pad_token_id", "mask_token_id"):
        v = gen.get(k)
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int):
            out.setdefault(k, v)
    added = {t.get("content"): t.get("id") for t in read("tokenizer.json").get("added_tokens", [])
             if isinstance(t, dict)}
    tcfg = read("tokenizer_config.json")

    def name_of(key):
        v = tcfg.get(key)
        return v.get("content") if isinstance(v, dict) else v

    for key, field in (("eos_token", "eos_token_id"), ("pad_token", "pad_token_id"), ("mask_token", "mask_token_id")):
        tok = name_of(key)
        if tok in added:
            out.setdefault(field, added[tok])
    for tok in MASK_TOKEN_NAMES:
        if tok in added:
            out.setdefault("mask_token_id", added[tok])
            break
    if "<|eot_id|>" in added:
        out.setdefault("eot_token_id", added["<|eot_id|>"])
    return out


def load_hf_config(folder: str | os.PathLike) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        if os.path.isdir(os.path.join(folder, "params")):
            raise ConfigError(f"{folder}: incomplete dinfer-jax checkpoint (conversion did not finish): params/ but "
                              "no config.json; delete the folder and convert again")
        raise ConfigError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        with open(path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object {{...}}, got a {type(hf).__name__}")
    return from_hf_dict(hf, special_ids_from_files(folder))


# ---------------------------------------------------------------------------------------------
# Presets

PRESETS: dict[str, ModelConfig] = {
    # A few-hundred-kB LLaDA-MoE-shaped model for tests and demos (8 experts, top-2, GQA 4/2).
    "tiny": ModelConfig(
        family="llada_moe", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=32, rope_theta=50000.0, qk_norm=True, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=512, mask_token_id=127, eos_token_id=126,
        pad_token_id=126),
    "tiny-dense": ModelConfig(
        family="llada", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=16, intermediate_size=128, rope_theta=500000.0, max_position_embeddings=512,
        mask_token_id=127, eos_token_id=126, pad_token_id=126),
    "llada-8b": ModelConfig(
        family="llada", vocab_size=126464, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
        head_dim=128, intermediate_size=12288, rope_theta=500000.0, max_position_embeddings=4096,
        **_FAMILY_DEFAULT_IDS["llada"]),
    "llada-moe-7b-a1b": ModelConfig(
        family="llada_moe", vocab_size=157184, hidden_size=2048, num_layers=16, num_heads=16,
        num_kv_heads=16, head_dim=128, intermediate_size=1024, rope_theta=50000.0, qk_norm=True,
        num_experts=64, num_experts_per_tok=8, max_position_embeddings=8192,
        **_FAMILY_DEFAULT_IDS["llada_moe"]),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name]
