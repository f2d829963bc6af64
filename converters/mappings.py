"""One weight-name table per model family: dinfer-jax param path <-> Hugging Face tensor names.

Each `Entry` says how one dinfer-jax parameter (possibly stacked over layers `{l}` and experts `{e}`)
is assembled from per-layer/per-expert HF tensors ("pieces"). A piece is either copied as is, or is
a torch Linear weight (out, in) that is transposed to (in, out) and reshaped to the piece's shape:
`in_axes` says how many leading piece axes form `in` (q_proj (D, N, H): 1; o_proj (N, H, D): 2).
The same table drives both directions (import and export).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import numpy as np

from dinfer_jax.config import ModelConfig


@dataclass(frozen=True)
class Entry:
    path: str  # '/'-joined dinfer-jax param path, e.g. "layers/attn/q_proj"
    hf: str  # HF name template with {l} (layer) and {e} (expert) fields
    stack: tuple[str, ...] = ()  # leading stacked axes of the param: ("l",) or ("l", "e")
    in_axes: int = 0  # 0: copy; k > 0: torch Linear (out, in) with `in` = first k piece axes

    def pieces(self, cfg: ModelConfig):
        """Yield (index tuple into the stacked axes, HF tensor name)."""
        sizes = {"l": cfg.num_layers, "e": cfg.num_experts}
        for idx in itertools.product(*(range(sizes[a]) for a in self.stack)):
            yield idx, self.hf.format(**dict(zip(self.stack, idx)))

    def hf_shape(self, piece_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not self.in_axes:
            return tuple(piece_shape)
        k = self.in_axes
        return (int(np.prod(piece_shape[k:])), int(np.prod(piece_shape[:k])))

    def to_ours(self, hf_arr: np.ndarray, piece_shape) -> np.ndarray:
        return hf_arr.T.reshape(piece_shape) if self.in_axes else hf_arr.reshape(piece_shape)

    def to_hf(self, piece: np.ndarray) -> np.ndarray:
        if not self.in_axes:
            return piece
        k = self.in_axes
        return np.ascontiguousarray(piece.reshape(int(np.prod(piece.shape[:k])), -1).T)


def _llada_moe(cfg: ModelConfig) -> list[Entry]:
    L = "model.layers.{l}."
    out = [
        Entry("embed/embedding", "model.embed_tokens.weight"),
        Entry("final_norm/scale", "model.norm.weight"),
        Entry("layers/attn_norm/scale", L + "input_layernorm.weight", ("l",)),
        Entry("layers/mlp_norm/scale", L + "post_attention_layernorm.weight", ("l",)),
        Entry("layers/attn/q_proj", L + "self_attn.q_proj.weight", ("l",), 1),
        Entry("layers/attn/k_proj", L + "self_attn.k_proj.weight", ("l",), 1),
        Entry("layers/attn/v_proj", L + "self_attn.v_proj.weight", ("l",), 1),
        Entry("layers/attn/o_proj", L + "self_attn.o_proj.weight", ("l",), 2),
        Entry("layers/mlp/router", L + "mlp.gate.weight", ("l",), 1),
        Entry("layers/mlp/gate_proj", L + "mlp.experts.{e}.gate_proj.weight", ("l", "e"), 1),
        Entry("layers/mlp/up_proj", L + "mlp.experts.{e}.up_proj.weight", ("l", "e"), 1),
        Entry("layers/mlp/down_proj", L + "mlp.experts.{e}.down_proj.weight", ("l", "e"), 1),
    ]
    if cfg.qk_norm:
        out += [Entry("layers/attn/q_norm/scale", L + "self_attn.q_norm.weight", ("l",)),
                Entry("layers/attn/k_norm/scale", L + "self_attn.k_norm.weight", ("l",))]
    if not cfg.tie_word_embeddings:
        out.append(Entry("lm_head/kernel", "lm_head.weight", (), 1))
    return out


def _llada(cfg: ModelConfig) -> list[Entry]:
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
        out.append(Entry("lm_head/kernel", "model.transformer.ff_out.weight", (), 1))
    return out


TABLES = {"llada_moe": _llada_moe, "llada": _llada}

# HF tensors that carry no learned weights and are skipped silently.
IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.attn\.bias|\.masked_bias)$")


def table(cfg: ModelConfig) -> list[Entry]:
    return TABLES[cfg.family](cfg)
