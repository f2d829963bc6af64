"""Structured output and infilling, the front door: a request's constraint -> (CanvasTemplate,
render(ids) -> text), and `generate_structured` for the library. Constraints: StructuredOutput(json=
| json_object= | regex= | choice=), Infill(suffix, span), InfillSpans(pieces); what each lays out
and answers: docs/structured_output.md.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Optional, Sequence

from dinfer_jax.canvas_template import CanvasTemplate, Slot, TemplateBuilder, infill_template
from dinfer_jax.engine import SamplingParams, generate
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
class InfillSpans:
    """The generation region as pieces in order: text (fixed) and ints (spans of that many
    positions to fill), e.g. ["0", 1, "6", 1]. The answer is the whole region's text, each span
    cut at its first EOS; `Constrained.parts` gives the spans' texts."""
    pieces: tuple


@dataclasses.dataclass(frozen=True)
class Constrained:
    """A built constraint: the template, the function from its T decoded ids to the answer text,
    and the answer's token ids (default: every slot id but the pad, in canvas order)."""
    template: CanvasTemplate
    render: Callable[[Sequence[int]], str]
    ids: Optional[Callable[[Sequence[int]], list]] = None
    pad: int = -1
    parts: Optional[Callable[[Sequence[int]], list]] = None  # InfillSpans: each span's text

    def answer_ids(self, region: Sequence[int]) -> list:
        if self.ids is not None:
            return self.ids(region)
        return [int(region[p]) for s in self.template.slots for p in range(s.start, s.start + s.length)
                if region[p] != self.pad]


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

        def filled(out) -> list:
            return _until_stop(out, template.slots[0], eos)
        return Constrained(template, lambda out: tokenizer.decode(filled(out)), filled)
    if isinstance(constraint, InfillSpans):
        return _infill_spans(constraint.pieces, tokenizer, cfg, max_positions)
    if not isinstance(constraint, StructuredOutput):
        raise TypeError(f"constraint must be StructuredOutput, Infill or InfillSpans, got "
                        f"{type(constraint).__name__}")
    kind = constraint.kind()
    vocab = vocab_classes(tokenizer, cfg.vocab_size, cfg.eos_id, cfg.mask_token_id)
    if kind == "choice":
        return dataclasses.replace(choice_template(constraint.choice, vocab, encode, max_positions), pad=vocab.pad)
    if kind == "regex":
        return Constrained(*regex_template(constraint.regex, vocab, max_positions), pad=vocab.pad)
    return Constrained(*json_schema_template(constraint.json if kind == "json" else None, vocab, encode,
                                             max_positions), pad=vocab.pad)


MAX_INFILL_PIECES = 64


def _until_stop(ids: Sequence[int], slot: Slot, stop_ids) -> list:
    """A slot's decoded ids up to its first stop id (an infill span ends early with EOS)."""
    got = []
    for t in ids[slot.start:slot.start + slot.length]:
        if t in stop_ids:
            break
        got.append(int(t))
    return got


def _infill_spans(pieces, tokenizer, cfg, max_positions: int) -> Constrained:
    if not isinstance(pieces, (list, tuple)) or not pieces or len(pieces) > MAX_INFILL_PIECES:
        raise SchemaError("infill", f"infill must be a list of 1..{MAX_INFILL_PIECES} pieces: text (kept) and "
                                    f"positive integers (spans to fill)")
    layout = []
    for i, p in enumerate(pieces):
        if isinstance(p, bool) or not isinstance(p, (int, str)) or (isinstance(p, int) and p <= 0) or p == "":
            raise SchemaError("infill", f"infill[{i}] = {p!r}: a piece is non-empty text or a positive integer")
        layout.append(p if isinstance(p, int) else tokenizer.encode(p))
    if not any(isinstance(p, int) for p in layout):
        raise SchemaError("infill", "infill has no span to fill (give at least one integer)")
    template = infill_template(layout)
    if len(template) > max_positions:
        raise SchemaError("infill", f"the infill region needs {len(template)} tokens, more than the "
                                    f"{max_positions} available")
    eos = set(cfg.stop_ids)

    def region_ids(ids) -> list:
        out, k = [], 0
        for s in template.slots:
            out += [int(t) for t in ids[k:s.start]]
            out += _until_stop(ids, s, eos)
            k = s.start + s.length
        return out + [int(t) for t in ids[k:len(template)]]
    return Constrained(template, lambda ids: tokenizer.decode(region_ids(ids)), region_ids,
                       parts=lambda ids: [tokenizer.decode(_until_stop(ids, s, eos)) for s in template.slots])


def generate_structured(model, tokenizer, prompts: Sequence[Sequence[int]], constraints: Sequence, params=None,
                        max_positions: Optional[int] = None) -> tuple[list[str], Any]:
    """Decode each prompt (token ids) under its constraint (StructuredOutput | Infill | None) ->
    (answers: the rendered text, or for None the plain decoded text; the GenerationResult)."""
    cfg = model.config
    if params is None:
        params = SamplingParams.for_model(cfg, model.folder)
    limit = max_positions or max(1, cfg.max_position_embeddings - max(len(p) for p in prompts))
    built = [None if c is None else build_constraint(c, tokenizer, cfg, limit) for c in constraints]
    result = generate(model, list(prompts), params, templates=[None if b is None else b.template for b in built])
    answers = [tokenizer.decode(ids) if b is None else b.render(ids) for b, ids in zip(built, result.token_ids)]
    return answers, result


REQUEST_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "suffix",
                  "infill")


def constraint_from_request(body: dict, max_tokens: int):
    """The OpenAI / vLLM request fields (response_format, structured_outputs, guided_json / _regex /
    _choice, suffix, infill) -> (StructuredOutput | Infill | None, the field that gave it), or
    SchemaError whose keyword is the request field at fault (docs/structured_output.md)."""
    given = {k: body[k] for k in REQUEST_FIELDS if body.get(k) is not None}
    rf = given.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "text":
        del given["response_format"]
    if len(given) > 1:
        raise SchemaError(sorted(given)[1], f"give one of {', '.join(REQUEST_FIELDS)}, not {sorted(given)}")
    if not given:
        return None, None
    (field, v), = given.items()
    return _constraint(field, v, max_tokens), field


def _constraint(field: str, v, max_tokens: int):
    if field == "infill":
        return InfillSpans(tuple(v) if isinstance(v, list) else v)
    if field == "suffix":
        if not isinstance(v, str) or not v:
            raise SchemaError("suffix", "suffix must be a non-empty string")
        return Infill(suffix=v, span=max_tokens)
    if field == "response_format":
        if not isinstance(v, dict) or v.get("type") not in ("json_object", "json_schema"):
            raise SchemaError("response_format", "response_format.type must be text, json_object or json_schema")
        if v["type"] == "json_object":
            return StructuredOutput(json_object=True)
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise SchemaError("response_format", "response_format json_schema needs json_schema.schema (an object)")
        return StructuredOutput(json=js["schema"])
    if field == "structured_outputs":
        if not isinstance(v, dict):
            raise SchemaError(field, "structured_outputs must be an object")
        unknown = sorted(set(v) - {"json", "regex", "choice", "json_object"})
        if unknown:
            raise SchemaError(field, f"structured_outputs.{unknown[0]} is not supported (json, regex, choice, "
                                     f"json_object are)")
        kw = {k: x for k, x in v.items() if x is not None and x is not False}
        if len(kw) != 1:
            raise SchemaError(field, f"structured_outputs needs exactly one of json, regex, choice, json_object "
                                     f"(got {sorted(kw) or 'none'})")
        (k, x), = kw.items()
    else:
        k, x = field[len("guided_"):], v
    if k == "json":
        if isinstance(x, str):
            try:
                x = json.loads(x)
            except ValueError as e:
                raise SchemaError(field, f"{field}: the JSON schema does not parse ({e})") from None
        return StructuredOutput(json=x)
    if k == "json_object":
        return StructuredOutput(json_object=True)
    if k == "regex":
        return StructuredOutput(regex=x)
    return StructuredOutput(choice=x)
