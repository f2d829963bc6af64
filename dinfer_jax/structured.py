"""Structured output and infilling, the front door: a request's constraint -> (CanvasTemplate,
render(ids) -> text), and `generate_structured` for the library.

Constraint (one of):
  StructuredOutput(json=schema)        JSON schema (json_template.py); json=None with
                                       json_object=True: any JSON object
  StructuredOutput(regex=pattern)      the regex subset of regex_template.py
  StructuredOutput(choice=[texts])     exactly one of the texts: one slot whose positions take the
                                       candidates' tokens there (or the pad); the answer is the
                                       candidate agreeing with the most decoded positions
  Infill(suffix=text, span=n)          prefix (the prompt) | n free positions | suffix; the answer
                                       is the filled span, cut at its first EOS
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from dinfer_jax.canvas_template import CanvasTemplate, TemplateBuilder, infill_template
from dinfer_jax.json_template import SchemaError, json_schema_template
from dinfer_jax.regex_template import regex_template
from dinfer_jax.token_classes import vocab_classes

MAX_CHOICES = 256


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of json (a schema dict), json_object, regex, choice."""
    json: Any = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None

    def kind(self) -> str:
        given = [k for k, v in (("json", self.json is not None), ("json_object", self.json_object),
                                ("regex", self.regex is not None), ("choice", self.choice is not None)) if v]
        if len(given) != 1:
            raise SchemaError("structured_outputs", f"give exactly one of json, json_object, regex, choice "
                                                    f"(got {given or 'none'})")
        return given[0]


@dataclasses.dataclass(frozen=True)
class Infill:
    """Fill `span` positions between the prompt and `suffix` (token ids or text)."""
    suffix: Any
    span: int


@dataclasses.dataclass(frozen=True)
class Constrained:
    """A built constraint: the template and the function from its T decoded ids to the answer text."""
    template: CanvasTemplate
    render: Callable[[Sequence[int]], str]


def choice_template(choices, vocab, encode, max_positions: int) -> Constrained:
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise SchemaError("choice", "choice must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise SchemaError("choice", f"{len(choices)} choices; at most {MAX_CHOICES}")
    cands = [encode(c) for c in choices]
    width = max(len(c) for c in cands)
    if width > max_positions:
        raise SchemaError("choice", f"the longest choice needs {width} tokens, more than the {max_positions} available")
    pad = vocab.pad
    b = TemplateBuilder()
    slot = b.slot([{c[i] if i < len(c) else pad for c in cands} for i in range(width)])

    def render(ids) -> str:
        got = list(ids[slot.start:slot.start + slot.length])
        score = [sum(g == (c[i] if i < len(c) else pad) for i, g in enumerate(got)) for c in cands]
        return choices[score.index(max(score))]
    return Constrained(b.build(), render)


def build_constraint(constraint, tokenizer, cfg, max_positions: int) -> Constrained:
    """A StructuredOutput or Infill -> Constrained for a model config (vocab size, EOS, mask id) and
    its tokenizer; SchemaError (`.keyword`) when it cannot be expressed in max_positions tokens."""
    encode = tokenizer.encode
    if isinstance(constraint, Infill):
        suffix = constraint.suffix
        ids = list(encode(suffix)) if isinstance(suffix, str) else [int(t) for t in suffix]
        span = constraint.span
        if not isinstance(span, int) or isinstance(span, bool) or span <= 0:
            raise SchemaError("max_tokens", f"the infill span must be a positive number of tokens, got {span!r}")
        if span + len(ids) > max_positions:
            raise SchemaError("suffix", f"span ({span}) + suffix ({len(ids)} tokens) exceed the {max_positions} "
                                        f"positions available")
        template = infill_template([span] + ([ids] if ids else []))
        eos = set(cfg.stop_ids)

        def render(out) -> str:
            filled = []
            for t in out[:span]:
                if t in eos:
                    break
                filled.append(int(t))
            return tokenizer.decode(filled)
        return Constrained(template, render)
    if not isinstance(constraint, StructuredOutput):
        raise TypeError(f"constraint must be StructuredOutput or Infill, got {type(constraint).__name__}")
    kind = constraint.kind()
    vocab = vocab_classes(tokenizer, cfg.vocab_size, cfg.eos_id, cfg.mask_token_id)
    if kind == "choice":
        return choice_template(constraint.choice, vocab, encode, max_positions)
    if kind == "regex":
        return Constrained(*regex_template(constraint.regex, vocab, max_positions))
    return Constrained(*json_schema_template(constraint.json if kind == "json" else None, vocab, encode,
                                             max_positions))


def generate_structured(model, tokenizer, prompts: Sequence[Sequence[int]], constraints: Sequence, params=None,
                        max_positions: Optional[int] = None) -> tuple[list[str], Any]:
    """Decode each prompt (token ids) under its constraint (StructuredOutput | Infill | None) ->
    (answers: the rendered text, or for None the plain decoded text; the GenerationResult)."""
    from dinfer_jax.engine import SamplingParams, generate
    cfg = model.config
    if params is None:
        params = SamplingParams.for_model(cfg, model.folder)
    limit = max_positions or max(1, cfg.max_position_embeddings - max(len(p) for p in prompts))
    built = [None if c is None else build_constraint(c, tokenizer, cfg, limit) for c in constraints]
    result = generate(model, list(prompts), params, templates=[None if b is None else b.template for b in built])
    answers = [tokenizer.decode(ids) if b is None else b.render(ids) for b, ids in zip(built, result.token_ids)]
    return answers, result
