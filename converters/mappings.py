"""The weight-name table engine: dinfer-jax param path <-> Hugging Face tensor names, both ways.
Each family declares `Entry`s: one param (stacked over layers `{l}` / experts `{e}`) assembled from
HF pieces, copied, reshaped (`hf_flat`) or a torch Linear (out, in) transposed (`in_axes` leading
piece axes form `in`), possibly a row range of a fused tensor (`rows`). docs/internals/converters.md.
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
    layer_offset: int = 0  # HF layer of stack index l is l + layer_offset
    rows: tuple[int, int] | None = None  # this piece = rows [a, b) (torch `out` axis) of the HF tensor
    hf_rows: int = 0  # with rows: the fused HF tensor's row count
    hf_flat: bool = False  # copied piece stored flat in HF (a (N, H) bias is a [N*H] vector there)

    def pieces(self, cfg: ModelConfig):
        """Yield (index tuple into the stacked axes, HF tensor name)."""
        sizes = {"l": stack_layers(self.path, cfg), "e": cfg.num_experts}
        for idx in itertools.product(*(range(sizes[a]) for a in self.stack)):
            names = dict(zip(self.stack, idx))
            if "l" in names:
                names["l"] += self.layer_offset
            yield idx, self.hf.format(**names)

    def hf_shape(self, piece_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the whole HF tensor (the fused one, for a row range)."""
        if not self.in_axes:
            return (int(np.prod(piece_shape)),) if self.hf_flat else tuple(piece_shape)
        k = self.in_axes
        out = int(np.prod(piece_shape[k:]))
        if self.rows is not None:
            if self.rows[1] - self.rows[0] != out:
                raise AssertionError(f"{self.path}: rows {self.rows} do not match the piece's {out} outputs")
            out = self.hf_rows
        return (out, int(np.prod(piece_shape[:k])))

    def to_ours(self, hf_arr: np.ndarray, piece_shape) -> np.ndarray:
        if self.rows is not None:
            hf_arr = hf_arr[self.rows[0]:self.rows[1]]
        return hf_arr.T.reshape(piece_shape) if self.in_axes else hf_arr.reshape(piece_shape)

    def to_hf(self, piece: np.ndarray) -> np.ndarray:
        if not self.in_axes:
            return piece.reshape(-1) if self.hf_flat else piece
        k = self.in_axes
        return np.ascontiguousarray(piece.reshape(int(np.prod(piece.shape[:k])), -1).T)


# HF tensors that carry no learned weights and are skipped silently.
IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.attn\.bias|\.masked_bias)$")


def stack_layers(path: str, cfg: ModelConfig) -> int:
    """Layers in the stack a param path belongs to: `dense_layers/` (the leading dense layers of a
    MoE model) or `layers/` (all the others)."""
    return cfg.first_k_dense if path.startswith("dense_layers/") else cfg.num_scanned_layers


def table(cfg: ModelConfig) -> list[Entry]:
    """The weight table of cfg's family (dinfer_jax/families/)."""
    from dinfer_jax import families
    return families.get(cfg.family).weights(cfg)


def fused_groups(entries: list[Entry]) -> list[list[Entry]]:
    """Entries grouped by the HF tensors they name (template and layer offset), in table order: a
    group of several is one fused HF tensor (row ranges, in row order)."""
    groups: dict[tuple, list[Entry]] = {}
    for e in entries:
        groups.setdefault((e.hf, e.layer_offset), []).append(e)
    out = []
    for g in groups.values():
        if len(g) > 1:
            g = sorted(g, key=lambda e: e.rows[0])
            if g[0].rows[0] != 0 or any(a.rows[1] != b.rows[0] for a, b in zip(g, g[1:])) or g[-1].rows[1] != g[0].hf_rows:
                raise AssertionError(f"fused tensor {g[0].hf}: row ranges {[e.rows for e in g]} do not tile it")
        out.append(g)
    return out


def decoder_entries(cfg: ModelConfig) -> list[Entry]:
    """The Llama / Qwen2 / Qwen3 / Qwen3-MoE tensor names (`model.layers.{l}.self_attn.q_proj`, ...),
    shared by the families that keep them: q/k/v biases when cfg.qkv_bias, per-head q/k norms when
    cfg.qk_norm, `mlp.gate` + `mlp.experts.{e}.*` when cfg.is_moe (else a dense `mlp.*`), and
    `lm_head` unless the embeddings are tied."""
    L = "model.layers.{l}."
    out = [
        Entry("embed/embedding", "model.embed_tokens.weight"),
        Entry("final_norm/scale", "model.norm.weight"),
        Entry("layers/attn_norm/scale", L + "input_layernorm.weight", ("l",)),
        Entry("layers/mlp_norm/scale", L + "post_attention_layernorm.weight", ("l",)),
        Entry("layers/attn/o_proj", L + "self_attn.o_proj.weight", ("l",), 2),
    ]
    for p in "qkv":
        out.append(Entry(f"layers/attn/{p}_proj", L + f"self_attn.{p}_proj.weight", ("l",), 1))
        if cfg.qkv_bias:
            out.append(Entry(f"layers/attn/{p}_bias", L + f"self_attn.{p}_proj.bias", ("l",), hf_flat=True))
    if cfg.qk_norm:
        out += [Entry("layers/attn/q_norm/scale", L + "self_attn.q_norm.weight", ("l",)),
                Entry("layers/attn/k_norm/scale", L + "self_attn.k_norm.weight", ("l",))]
    mlp = ("gate_proj", "up_proj", "down_proj")
    if cfg.is_moe:
        out.append(Entry("layers/mlp/router", L + "mlp.gate.weight", ("l",), 1))
        out += [Entry(f"layers/mlp/{p}", L + f"mlp.experts.{{e}}.{p}.weight", ("l", "e"), 1) for p in mlp]
    else:
        out += [Entry(f"layers/mlp/{p}", L + f"mlp.{p}.weight", ("l",), 1) for p in mlp]
    if not cfg.tie_word_embeddings:
        out.append(Entry("lm_head/unembedding", "lm_head.weight"))
    return out
