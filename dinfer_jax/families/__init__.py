"""Model families: one module per family declares everything specific to it (a `Family`); shared
code looks families up here by `ModelConfig.family` or architecture name. Adding a family = a new
module + one line in `_MODULES` (docs/internals/families.md)."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any, Callable, Mapping

from dinfer_jax.config import (ConfigError, ModelConfig, _bad_field, read_json, resolve_special_ids,
                               special_ids_from_files)

# ChatML turns (Qwen-based families: Dream, SDAR, Fast-dLLM v2), the plain-message path of their
# templates. A model folder's own chat_template (tokenizer_config.json) always wins.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_MODULES = ("llada", "llada_moe", "llada2", "dream", "sdar", "fast_dllm_v2")


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: HF architectures, config.json reader / writer, weight table, default ids,
    chat template, presets, decoding defaults and the generation_config.json fields it reads
    (docs/internals/families.md)."""
    name: str
    architectures: tuple[str, ...]
    read_config: Callable[[Mapping[str, Any], Callable[[int], dict], str], Any]
    write_config: Callable[[Any], dict]
    weights: Callable[[Any], list]
    default_ids: Mapping[str, int | None]
    chat_template: str
    bos_token: str = ""
    presets: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    decoding: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    generation_fields: tuple[str, ...] = ()


_REGISTRY: dict[str, Family] = {}


def _load():
    if not _REGISTRY:
        for m in _MODULES:
            fam = importlib.import_module(f"dinfer_jax.families.{m}").FAMILY
            _REGISTRY[fam.name] = fam
    return _REGISTRY


def all_families() -> list[Family]:
    return list(_load().values())


def get(name: str) -> Family:
    reg = _load()
    if name not in reg:
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(reg)}")
    return reg[name]


def architectures() -> dict[str, str]:
    """HF architecture name -> family name."""
    return {a: f.name for f in _load().values() for a in f.architectures}


def by_architecture(arch: str) -> Family | None:
    name = architectures().get(arch)
    return None if name is None else _load()[name]


GENERATION_CONFIG = "generation_config.json"
# A default `steps` (LLaDA2.0's per-block transfer schedule) gives way to a later layer that turns
# on one of these (LLaDA2.1's generate() has no schedule: its `steps` argument is unused).
_NO_SCHEDULE = (("editing_threshold", None), ("indel", False), ("sub_block_length", 0))
# Fields that mean something under one cache / strategy only: a lower layer's value is dropped
# when a later layer switches to another (e.g. --cache dual on a Fast-dLLM v2 folder drops its
# sub-blocks; --strategy threshold on a Dream folder drops Dream's alg).
_SCOPED = {
    ("cache", "block"): ("steps", "editing_threshold", "max_post_steps", "num_to_transfer", "sub_block_length",
                         "sub_block_cache", "indel", "confidence_before_filter", "top_k", "top_p"),
    ("strategy", "dream"): ("alg", "alg_temp", "eps", "top_k", "top_p"),
    ("strategy", "entropy_bounded"): ("eb_threshold",),
}


def read_generation_config(folder: str | os.PathLike | None) -> dict:
    """The folder's generation_config.json as a dict ({} when there is none)."""
    if folder is None:
        return {}
    path = os.path.join(folder, GENERATION_CONFIG)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def folder_decoding(cfg, folder: str | os.PathLike | None) -> dict:
    """What a model folder sets over its family's decoding defaults: the model's attention block
    (block-causal models: config.json's block_size), then from generation_config.json the fields
    the family's authors' generate() reads (`Family.generation_fields`; null = absent), then our own
    "dinfer_jax" entry (gen_length / block_length, written by dinfer_jax.train)."""
    fam = get(cfg.family)
    out = {}
    if cfg.attention_mask == "block_causal":
        out["block_length"] = cfg.block_size
    gen = read_generation_config(folder)
    out.update({k: gen[k] for k in fam.generation_fields if gen.get(k) is not None})
    ours = gen.get("dinfer_jax") or {}
    if not isinstance(ours, dict):
        raise ConfigError(f"{os.path.join(folder, GENERATION_CONFIG)}: \"dinfer_jax\" must be an object")
    out.update({k: ours[k] for k in ("gen_length", "block_length") if ours.get(k) is not None})
    return out


def whole_canvas(fam: Family) -> bool:
    """Whether the family decodes the whole canvas as one block (Dream: block_length == gen_length)."""
    return fam.decoding.get("block_length") is not None and fam.decoding.get("block_length") == fam.decoding.get(
        "gen_length")


def layer(base: Mapping[str, Any], upd: Mapping[str, Any], whole: bool = False) -> dict:
    """`upd` over `base` (dicts of SamplingParams fields), keeping the default consistent: block
    length vs gen_length, `steps` vs editing / sub-blocks, fields scoped to a replaced cache or
    strategy (rules: docs/decoding_defaults.md, docs/internals/families.md)."""
    out = {**base, **upd}
    for (key, value), names in _SCOPED.items():
        if base.get(key) == value and upd.get(key, value) != value:
            for n in names:
                if n not in upd:
                    out.pop(n, None)
    if "gen_length" in upd and "block_length" not in upd and base.get("block_length") is not None:
        if whole and base.get("block_length") == base.get("gen_length"):
            out["block_length"] = upd["gen_length"]
        elif out.get("cache") != "block" and base["block_length"] > upd["gen_length"]:
            out["block_length"] = upd["gen_length"]
    if "steps" not in upd and any(k in upd and upd[k] != off for k, off in _NO_SCHEDULE):
        out.pop("steps", None)
    return out


# ---- config.json -> ModelConfig (any registered family), and the presets

# DiffusionGemma is no registered (masked-diffusion) family: its own loop, families/diffusion_gemma.py
DIFFUSION_GEMMA_ARCHITECTURES = ("DiffusionGemmaForBlockDiffusion",)


def family_of(hf: Mapping[str, Any]):
    """The `Family` whose architecture names config.json's architectures[0]."""
    if not isinstance(hf, Mapping):
        raise ConfigError(f"config.json must hold a JSON object, found {type(hf).__name__}")
    archs = hf.get("architectures") or []
    if not archs:
        raise ConfigError("config.json has no 'architectures' entry; supported: "
                          + ", ".join(sorted(architectures())))
    fam = by_architecture(archs[0])
    if fam is None and archs[0] in DIFFUSION_GEMMA_ARCHITECTURES:
        raise ConfigError(f"{archs[0]} is a DiffusionGemma model (uniform-noise diffusion, families/diffusion_gemma.py): "
                          "generate, chat, plan, convert and export take it; this command is not built for it yet")
    if fam is None:
        raise ConfigError(f"unknown architecture {archs[0]!r} in config.json; supported: "
                          + ", ".join(sorted(architectures())))
    return fam


def from_hf_dict(hf: Mapping[str, Any], file_ids: Mapping[str, int] | None = None) -> ModelConfig:
    """ModelConfig from the contents of a Hugging Face config.json (any registered family).

    Special ids: see `resolve_special_ids` (`file_ids` come from `special_ids_from_files`)."""
    fam = family_of(hf)
    where = f"{hf['architectures'][0]} config"
    try:
        return fam.read_config(hf, lambda vocab: resolve_special_ids(hf, file_ids, fam.default_ids, vocab, where),
                               where)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: {_bad_field(hf, e)}") from None


def llama_fields(cfg: ModelConfig) -> dict:
    """The config.json fields every Llama-style writer shares (Qwen2 / Qwen3 / Qwen3-MoE / LLaDA2
    names): sizes, norm, RoPE, vocabulary, special ids."""
    return dict(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
                vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
                rope_theta=cfg.rope_theta, mask_token_id=cfg.mask_token_id, eos_token_id=cfg.eos_token_id,
                pad_token_id=cfg.pad_token_id)


def to_hf_dict(cfg: ModelConfig) -> dict:
    """A config.json for `cfg` in its family's Hugging Face format (used by export and tests)."""
    return get(cfg.family).write_config(cfg)


def load_hf_config(folder: str | os.PathLike) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        if os.path.isdir(os.path.join(folder, "params")):
            raise ConfigError(f"{folder}: incomplete dinfer-jax checkpoint (conversion did not finish): params/ but "
                              "no config.json; delete the folder and convert again")
        raise ConfigError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    hf = read_json(path)
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object {{...}}, got a {type(hf).__name__}")
    return from_hf_dict(hf, special_ids_from_files(folder))


# ---------------------------------------------------------------------------------------------
# Presets: each family module declares its own


def presets() -> dict[str, ModelConfig]:
    """Every family's presets by name."""
    return {name: cfg for fam in all_families() for name, cfg in fam.presets.items()}


def preset(name: str) -> ModelConfig:
    table = presets()
    if name not in table:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(table)}")
    return table[name]
