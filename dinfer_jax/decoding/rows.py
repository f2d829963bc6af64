"""A row on the host: its prompt laid out on the canvas, the per-row knob values a SamplingParams
puts into the loop, and once decoded its answer ids (cut at the first stop id), tokens per forward
and commit record. Used by engine.py, decoding/segments.py and the server alike."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only (engine imports this module)
    from dinfer_jax.engine import SamplingParams


def place_row(canvas, pad, plen, b: int, ids, gen_start: int, gen_length: int, mask_id: int):
    """Lay prompt `ids` out as row b of a canvas (B, Lc): left-padded to end at gen_start, then
    gen_length masks; pad[b] / plen[b] its left pad and prompt length (all host arrays, in place)."""
    n = len(ids)
    canvas[b, gen_start - n:gen_start] = ids
    canvas[b, gen_start:gen_start + gen_length] = mask_id
    pad[b], plen[b] = gen_start - n, n


def knob_value(p: SamplingParams, k: str) -> float:
    """The per-row value of knob `k` (decoding/spec.ROW_KNOBS) for SamplingParams p."""
    v = getattr(p, k)
    if v is None:  # editing_threshold None: no editing (unused), or with indel SGLang's edit_threshold 0
        return 0.0 if p.indel else 1.0
    return v


def ids_until_stop(gen_G, stop_ids, mask_id: int) -> tuple[list[int], bool]:
    """A generation region -> (its ids before the first stop id or undecoded (mask) position,
    whether a stop id ended them)."""
    out = []
    for t in gen_G:
        t = int(t)
        if t == mask_id:
            return out, False
        if t in stop_ids:
            return out, True
        out.append(t)
    return out, False


def row_output(raw_G, nfe: int, cfg, ignore_eos: bool = False) -> tuple[list[int], float]:
    """One row's generation region -> (ids cut before the first stop id unless ignore_eos, tokens
    per forward: its non-EOS, non-mask tokens / nfe)."""
    toks = raw_G.tolist()
    cut = len(toks) if ignore_eos else next((i for i, t in enumerate(toks) if t in cfg.stop_ids), len(toks))
    real = int(np.sum((raw_G != cfg.eos_id) & (raw_G != cfg.mask_token_id)))
    return toks[:cut], real / max(1, nfe)


def row_record(rec, b: int, n: int, top_n: int | None):
    """Row b's commit record (a CommitRecord from decoding/row_state.record_region, host arrays over
    the generation region) for its first n tokens -> (commit steps, token logprobs | None, top
    logprobs | None); top_n: the request's SamplingParams.logprobs (None: no logprobs)."""
    steps = [int(v) for v in rec.commit_it[b, :n]]
    if top_n is None or rec.commit_lp is None:
        return steps, None, None
    written = rec.commit_it[b, :n] >= 0
    lps = [float(v) if w else float("nan") for v, w in zip(rec.commit_lp[b, :n], written)]
    tops = [[] for _ in range(n)]
    if top_n > 0:
        ids, vals = rec.top_ids[b, :n, :top_n], rec.top_lp[b, :n, :top_n]
        tops = [[(int(i), float(v)) for i, v in zip(ids[j], vals[j])] if written[j] else [] for j in range(n)]
    return steps, lps, tops
