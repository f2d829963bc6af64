"""Model families: one module per family declares everything that is specific to it.

A `Family` holds: its Hugging Face architecture names, a config.json -> ModelConfig reader and the
reverse writer, its weight-name table (converters/mappings.py `Entry` list, used both ways), its
documented default special ids, its chat template (and BOS text), its presets, and its decoding
defaults. Shared code (config dataclass, converter engine, chat renderer, layers) looks families
up here by `ModelConfig.family` or by architecture name and holds no family names itself.

Adding a family = a new module here + one line in `_MODULES`.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping

# ChatML turns (Qwen-based families: Dream, SDAR, Fast-dLLM v2), the plain-message path of their
# templates. A model folder's own chat_template (tokenizer_config.json) always wins.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_MODULES = ("llada", "llada_moe", "llada2", "dream", "sdar", "fast_dllm_v2")


@dataclasses.dataclass(frozen=True)
class Family:
    """What one model family is (see the module doc).

    read_config(hf, ids_for_vocab, where) -> ModelConfig: `ids_for_vocab(V)` resolves the special ids
    (config.json > folder files > `default_ids` that fit V). decoding: SamplingParams defaults."""
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
        from dinfer_jax.config import ConfigError
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(reg)}")
    return reg[name]


def architectures() -> dict[str, str]:
    """HF architecture name -> family name."""
    return {a: f.name for f in _load().values() for a in f.architectures}


def by_architecture(arch: str) -> Family | None:
    name = architectures().get(arch)
    return None if name is None else _load()[name]
