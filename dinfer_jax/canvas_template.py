"""Canvas templates: the generation region laid out before decoding (infilling, structured output).
A template of T positions is fixed tokens and slots (masks the decoder fills, each position
optionally limited to a token set); `Generator.generate(..., templates=)` applies it inside the
jitted loop (docs/structured_output.md).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dinfer_jax.decoding.constraint import constraint_buckets

ANY = None  # a slot position that takes any token


@dataclasses.dataclass(frozen=True)
class Slot:
    """Positions [start, start + length) of the template the decoder fills."""
    start: int
    length: int


@dataclasses.dataclass(frozen=True)
class CanvasTemplate:
    """tokens (T,): the fixed token ids, -1 at slot positions; classes (T,): -1 fixed, 0 any token,
    c >= 1 the token set sets[c - 1] (sorted id tuples, deduplicated); slots: the filled runs."""
    tokens: tuple[int, ...]
    classes: tuple[int, ...]
    sets: tuple[tuple[int, ...], ...]
    slots: tuple[Slot, ...]

    def __len__(self) -> int:
        return len(self.tokens)

    def allowed_table(self, vocab_size: int, mask_id: int, n_classes: int) -> np.ndarray:
        """-> allowed (n_classes, V) bool: row 0 all True (any), row c the token set c (the mask id
        never allowed: a slot always receives a real token)."""
        if len(self.sets) + 1 > n_classes:
            raise ValueError(f"template needs {len(self.sets) + 1} classes, program has {n_classes}")
        table = np.zeros((n_classes, vocab_size), bool)
        table[0] = True
        for c, ids in enumerate(self.sets, 1):
            table[c, list(ids)] = True
            table[c, mask_id] = False
        return table


class TemplateBuilder:
    """Appends fixed runs and slots; `build()` deduplicates the token sets into classes."""

    def __init__(self):
        self.tokens: list[int] = []
        self.sets: list = []  # per position: None fixed, ANY, or a frozenset of ids
        self.slots: list[Slot] = []

    def fixed(self, ids: Sequence[int]) -> "TemplateBuilder":
        for t in ids:
            self.tokens.append(int(t))
            self.sets.append(None)
        return self

    def slot(self, allowed_per_position: Sequence) -> Slot:
        """A slot of len(allowed_per_position) positions; each entry ANY or an iterable of ids."""
        start = len(self.tokens)
        for allowed in allowed_per_position:
            if allowed is not ANY:
                allowed = frozenset(int(t) for t in allowed)
                if not allowed:
                    raise ValueError(f"slot position {len(self.tokens)} allows no token")
            self.tokens.append(-1)
            self.sets.append(allowed if allowed is not None else ANY)
        s = Slot(start, len(allowed_per_position))
        if s.length:
            self.slots.append(s)
        return s

    def build(self) -> CanvasTemplate:
        index: dict = {}
        classes = []
        for t, allowed in zip(self.tokens, self.sets):
            if t >= 0:
                classes.append(-1)
            elif allowed is ANY:
                classes.append(0)
            else:
                classes.append(index.setdefault(allowed, len(index) + 1))
        sets = tuple(tuple(sorted(a)) for a, _ in sorted(index.items(), key=lambda kv: kv[1]))
        return CanvasTemplate(tuple(self.tokens), tuple(classes), sets, tuple(self.slots))


def infill_template(pieces: Sequence) -> CanvasTemplate:
    """pieces: fixed id lists and span lengths (ints), in canvas order, e.g. [4, [9, 9], 2]: a
    4-token span, two fixed tokens, a 2-token span. Spans take any token."""
    b = TemplateBuilder()
    for p in pieces:
        if isinstance(p, (int, np.integer)) and not isinstance(p, bool):
            if p <= 0:
                raise ValueError(f"an infill span needs a positive length, got {p}")
            b.slot([ANY] * int(p))
        else:
            b.fixed(p)
    if not b.slots:
        raise ValueError("an infill template needs at least one span to fill")
    return b.build()


def template_region(template: CanvasTemplate | None, gen_length: int, mask_id: int, eos_id: int):
    """A row's generation region (G,) int32 and its classes (G,) int32: the template's fixed tokens
    and slot masks, then EOS fixed to the end (no template: all masks, class 0)."""
    tokens = np.full((gen_length,), mask_id, np.int32)
    classes = np.zeros((gen_length,), np.int32)
    if template is None:
        return tokens, classes
    T = len(template)
    if T > gen_length:
        raise ValueError(f"template of {T} positions exceeds the generation region ({gen_length})")
    fixed = np.asarray(template.tokens, np.int32)
    tokens[:T] = np.where(fixed >= 0, fixed, mask_id)
    classes[:T] = template.classes
    tokens[T:] = eos_id
    classes[T:] = -1
    return tokens, classes


def template_gen_length(templates, block_length: int, at_least: int = 0) -> int:
    """The generation region that holds every template: the longest, in whole blocks."""
    T = max([len(t) for t in templates if t is not None] + [at_least, 1])
    return -(-T // block_length) * block_length


def template_classes(templates) -> int:
    """DecodeSpec.constraint_classes for these templates (decoding/constraint.constraint_buckets)."""
    return constraint_buckets(max([len(t.sets) for t in templates if t is not None] + [0]))
