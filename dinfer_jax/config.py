"""ModelConfig: one frozen, family-free description of a dLLM, and the helpers that read config.json
(family specifics live in dinfer_jax/families/; this file imports nothing of ours)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model."""


ROUTERS = ("softmax", "sigmoid_group")
ATTENTION_MASKS = ("full", "block_causal")
SPECIAL_IDS = ("mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one model (letters: docs/facts/conventions.md; V vocab, D hidden, N / K
    query / kv heads, H head dim, F ffn width (per expert when num_experts > 0), E experts, X top-k).
    router: "softmax" | "sigmoid_group"; attention_mask: "full" | "block_causal" (blocks of
    `block_size`). Field meanings: docs/internals/runtime.md (ModelConfig).
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
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2-style attention)
    num_experts: int = 0  # E; 0 -> dense SwiGLU MLP
    num_experts_per_tok: int = 0  # X
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    router: str = "softmax"  # ROUTERS
    n_group: int = 1  # sigmoid_group: expert groups
    topk_group: int = 1  # sigmoid_group: groups kept per token
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    num_shared_experts: int = 0  # always-on experts (one SwiGLU of width F * num_shared_experts)
    first_k_dense: int = 0  # leading layers with a dense SwiGLU (MoE models)
    dense_intermediate_size: int = 0  # F of those leading dense layers
    attention_mask: str = "full"  # ATTENTION_MASKS
    block_size: int = 0  # block_causal: positions per attention block (also the default decode block)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    mask_token_id: int = 0
    eos_token_id: int | None = 0  # None: the folder names no EOS (no early stop at EOS)
    pad_token_id: int | None = None
    eot_token_id: int | None = None
    extra_token_ids: tuple = ()  # (name, id) pairs a family declares, e.g. LLaDA2.2's edit-control tokens
    # 1: the model keeps an AR-style next-token head, so the logits that decode position i are the
    # raw output row i - 1 (position 0 uses its own row); 0: row i decodes position i. The decoding
    # loop honours it for every strategy and cache (decoding/loop.py).
    logit_shift: int = 0

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
            if self.router not in ROUTERS:
                problems.append(f"router={self.router!r} is not one of {ROUTERS}")
            if self.router == "sigmoid_group":
                if self.n_group <= 0 or self.num_experts % self.n_group:
                    problems.append(f"n_group={self.n_group} must divide num_experts={self.num_experts}")
                elif not 0 < self.topk_group <= self.n_group:
                    problems.append(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
                elif self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
                    problems.append(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in "
                                    f"topk_group={self.topk_group} groups")
                elif self.num_experts // self.n_group < 2:
                    problems.append("sigmoid_group scores a group by its two best experts: "
                                    "num_experts / n_group must be >= 2")
            if not 0 <= self.first_k_dense < self.num_layers:
                problems.append(f"first_k_dense={self.first_k_dense} must be in [0, num_layers={self.num_layers})")
            if self.first_k_dense and self.dense_intermediate_size <= 0:
                problems.append("first_k_dense > 0 needs dense_intermediate_size > 0")
            if self.num_shared_experts < 0:
                problems.append(f"num_shared_experts={self.num_shared_experts} must be >= 0")
        elif self.first_k_dense or self.num_shared_experts:
            problems.append("first_k_dense / num_shared_experts need num_experts > 0")
        if self.logit_shift not in (0, 1):
            problems.append(f"logit_shift={self.logit_shift!r} must be 0 or 1")
        if self.attention_mask not in ATTENTION_MASKS:
            problems.append(f"attention_mask={self.attention_mask!r} is not one of {ATTENTION_MASKS}")
        elif self.attention_mask == "block_causal" and self.block_size <= 0:
            problems.append("attention_mask='block_causal' needs block_size > 0")
        for name in SPECIAL_IDS:
            v = getattr(self, name)
            if (v is not None or name == "mask_token_id") and not 0 <= v < self.vocab_size:
                problems.append(f"{name}={getattr(self, name)} outside the vocabulary [0, {self.vocab_size})")
        for name, v in self.extra_token_ids:
            if not 0 <= v < self.vocab_size:
                problems.append(f"{name}={v} outside the vocabulary [0, {self.vocab_size})")
        if problems:
            raise ConfigError("invalid ModelConfig: " + "; ".join(problems))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def num_scanned_layers(self) -> int:
        """Layers in the main scanned stack (`layers/...`): all but the leading dense ones."""
        return self.num_layers - self.first_k_dense

    @property
    def stop_ids(self) -> frozenset:
        """Token ids that end a generation (EOS, end-of-turn)."""
        return frozenset(i for i in (self.eos_token_id, self.eot_token_id) if i is not None)

    @property
    def pad_id(self) -> int:
        """The id written into left padding (never attended, never decoded)."""
        for i in (self.pad_token_id, self.eos_token_id):
            if i is not None:
                return i
        return 0

    @property
    def eos_id(self) -> int:
        """EOS for the decoding loop; -1 (never matches) when the folder names none."""
        return -1 if self.eos_token_id is None else self.eos_token_id

    @property
    def filler_id(self) -> int:
        """The smallest id that is neither the mask nor EOS: the token of warm-up prompts."""
        return next(t for t in range(self.vocab_size) if t not in (self.mask_token_id, self.eos_token_id))

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _count(self, experts: int) -> int:
        D, N, K, H, F, V = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                            self.intermediate_size, self.vocab_size)
        attn = (D * N * H * 2 + D * K * H * 2 + (2 * H if self.qk_norm else 0)
                + ((N + 2 * K) * H if self.qkv_bias else 0))
        if self.is_moe:
            router = D * self.num_experts + (self.num_experts if self.router == "sigmoid_group" else 0)
            mlp = (experts + self.num_shared_experts) * 3 * D * F + router
            dense = self.first_k_dense * (attn + 3 * D * self.dense_intermediate_size + 2 * D)
            layers = self.num_scanned_layers * (attn + mlp + 2 * D) + dense
        else:
            layers = self.num_layers * (attn + 3 * D * F + 2 * D)
        return layers + V * D * (1 if self.tie_word_embeddings else 2) + D

    @property
    def num_params(self) -> int:
        """Total parameter count (embeddings and LM head included)."""
        return self._count(self.num_experts)

    @property
    def num_active_params(self) -> int:
        """Parameters one token touches (top-k routed experts + shared ones + everything else)."""
        return self._count(self.num_experts_per_tok if self.is_moe else 0)


# ---------------------------------------------------------------------------------------------
# Reading a Hugging Face config.json: the family module reads its shapes; ids are resolved here.


def need(cfg: Mapping[str, Any], *keys: str, where: str):
    """The first of `keys` present (not null) in a config.json, else a ConfigError naming them."""
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    raise ConfigError(f"{where}: config.json has none of the keys {list(keys)}")


def rope_theta(cfg: Mapping[str, Any], default: float) -> float:
    """rope_theta at top level or inside rope_parameters (newer transformers), else `default`."""
    if cfg.get("rope_theta") is not None:
        return float(cfg["rope_theta"])
    rp = cfg.get("rope_parameters") or {}
    if rp.get("rope_theta") is not None:
        return float(rp["rope_theta"])
    return default


def partial_rotary_factor(cfg: Mapping[str, Any]) -> float:
    """partial_rotary_factor at top level or inside rope_parameters; 1.0 (full rotary) if absent."""
    v = cfg.get("partial_rotary_factor")
    if v is None:
        v = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
    return float(v or 1.0)


def resolve_special_ids(hf: Mapping[str, Any], file_ids: Mapping[str, int] | None, defaults: Mapping[str, Any],
                        vocab_size: int, where: str) -> dict:
    """Special ids: config.json, then `file_ids`, then the family's defaults that fit the vocabulary.
    Only a missing mask id is an error."""
    ids = {}
    for k in SPECIAL_IDS:
        if hf.get(k) is not None:
            ids[k] = int(hf[k])
        elif k in hf and k in ("pad_token_id", "eot_token_id"):
            ids[k] = None  # explicitly null in config.json
        elif file_ids and file_ids.get(k) is not None:
            ids[k] = int(file_ids[k])
        elif defaults.get(k) is not None and 0 <= defaults[k] < vocab_size:
            ids[k] = int(defaults[k])
        else:
            ids[k] = None
    if ids["mask_token_id"] is None:
        raise ConfigError(f"{where}: no mask token id: add \"mask_token_id\" to config.json or "
                          f"generation_config.json, or name the mask token in tokenizer.json's added_tokens "
                          f"(one of {', '.join(MASK_TOKEN_NAMES)})")
    return ids


def _bad_field(hf: Mapping[str, Any], e: Exception) -> str:
    """A reader's int() / float() failure -> which config.json field holds the bad value."""
    bad = [k for k, v in hf.items() if isinstance(v, (str, list, dict, bool)) and (
        repr(v) in str(e) or (isinstance(v, (list, dict)) and type(v).__name__ in str(e)))]
    if bad:
        return f"{bad[0]}={hf[bad[0]]!r} is not a valid value ({type(e).__name__}: {e})"
    return f"a field has a value of the wrong type ({type(e).__name__}: {e})"


MASK_TOKEN_NAMES = ("<|mdm_mask|>", "<|mask|>", "<mask>", "[MASK]", "<MASK>")
# End-of-turn tokens: Llama-3's (LLaDA) and ChatML's (Qwen: Dream, DiffuCoder, SDAR, Fast-dLLM v2).
EOT_TOKEN_NAMES = ("<|eot_id|>", "<|im_end|>")


def special_ids_from_files(folder: str | os.PathLike) -> dict[str, int]:
    """Special token ids named by a model folder's generation_config.json, tokenizer_config.json and
    tokenizer.json (rules: docs/internals/runtime.md)."""
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
    for tok in EOT_TOKEN_NAMES:
        if tok in added and added[tok] != out.get("eos_token_id"):
            out.setdefault("eot_token_id", added[tok])
            break
    return out


def read_json(path: str, damaged: str = ""):
    """json.load(path) with one clear ConfigError naming the file (invalid JSON: the message ends with
    `damaged`, e.g. a hint to convert again; unreadable file: the OS reason)."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e}){damaged}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
