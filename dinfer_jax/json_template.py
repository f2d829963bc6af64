"""JSON schema -> canvas template (structured output that always parses and validates): the skeleton
is fixed text, every value a slot of the tokens its type allows (plus the pad, EOS), and the answer
is re-rendered with json.dumps. What the template cannot express raises SchemaError naming the
keyword. Slot rules per type: docs/structured_output.md.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from dinfer_jax.canvas_template import TemplateBuilder
from dinfer_jax.token_classes import VocabClasses

W_INT, W_FRAC, W_STR, MAX_STR, MAX_ITEMS = 6, 3, 16, 64, 32
# response_format json_object: (members, string tokens) tried in turn, the first that fits is used
FREE_OBJECT_SHAPES = ((4, 16), (3, 12), (2, 8), (1, 8), (1, 4), (1, 1))
_IGNORED = {"title", "description", "$schema", "$id", "default", "examples", "$comment", "additionalProperties",
            "required", "readOnly", "writeOnly", "deprecated"}
_UNSUPPORTED = ("$ref", "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "pattern", "format",
                "patternProperties", "dependentRequired", "dependentSchemas", "dependencies", "propertyNames",
                "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
                "contains", "minContains", "maxContains", "prefixItems", "additionalItems", "unevaluatedItems",
                "unevaluatedProperties", "minProperties", "maxProperties", "$defs", "definitions")


class SchemaError(ValueError):
    """A schema the canvas template cannot express; `.keyword` names the construct."""

    def __init__(self, keyword: str, message: str):
        super().__init__(message)
        self.keyword = keyword


@dataclasses.dataclass
class _Ctx:
    vocab: VocabClasses
    encode: Callable[[str], list]
    b: TemplateBuilder


Render = Callable[[list], "tuple[Any, bool]"]  # template ids -> (value, every slot empty)


def json_schema_template(schema, vocab: VocabClasses, encode, max_positions: int):
    """-> (CanvasTemplate, render(ids) -> JSON text) for `schema` (a dict; None: any JSON object,
    the response_format json_object). encode: text -> ids (the skeleton's tokens). SchemaError
    when the schema cannot be expressed or its template exceeds max_positions."""
    if schema is None:  # any object: the most members / the longest strings that fit max_positions
        for members, width in FREE_OBJECT_SHAPES:
            ctx = _Ctx(vocab, encode, TemplateBuilder())
            render = _free_object(ctx, members, width)
            if len(ctx.b.tokens) <= max_positions:
                break
    else:
        ctx = _Ctx(vocab, encode, TemplateBuilder())
        render = _node(ctx, schema, "$")
    template = ctx.b.build()
    if len(template) > max_positions:
        raise SchemaError("maxLength", f"the schema's template needs {len(template)} tokens, more than the "
                                       f"{max_positions} available (lower maxItems / maxLength, or raise max_tokens)")

    def text(ids) -> str:
        return json.dumps(render(list(ids))[0], ensure_ascii=False)
    return template, text


def _fixed(ctx: _Ctx, text: str):
    ctx.b.fixed(ctx.encode(text))


def _slot_text(ctx: _Ctx, slot, ids) -> tuple[str, bool]:
    got = [t for t in ids[slot.start:slot.start + slot.length] if t != ctx.vocab.pad]
    return "".join(ctx.vocab.texts[t] for t in got), not got


def _node(ctx: _Ctx, schema, path: str) -> Render:
    if not isinstance(schema, dict):
        raise SchemaError("type", f"{path}: a schema must be an object, got {type(schema).__name__}")
    for k in _UNSUPPORTED:
        if k in schema:
            raise SchemaError(k, f"{path}: the JSON-schema keyword {k!r} is not supported by canvas templates")
    if "const" in schema:
        return _enum(ctx, [schema["const"]], path)
    if "enum" in schema:
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise SchemaError("enum", f"{path}: enum must be a non-empty list")
        return _enum(ctx, schema["enum"], path)
    t = schema.get("type")
    if t is None and "properties" in schema:
        t = "object"
    if isinstance(t, list):
        raise SchemaError("type", f"{path}: a list of types ({t}) is not supported; give one type")
    known = {k for k in schema if k not in _IGNORED}
    if t == "object":
        known -= {"type", "properties"}
    elif t == "array":
        known -= {"type", "items", "minItems", "maxItems"}
    elif t == "string":
        known -= {"type", "minLength", "maxLength"}
    elif t in ("integer", "number", "boolean", "null"):
        known -= {"type"}
    else:
        raise SchemaError("type", f"{path}: type {t!r} is not one of object, array, string, integer, number, "
                                  f"boolean, null")
    if known:
        k = sorted(known)[0]
        raise SchemaError(k, f"{path}: the JSON-schema keyword {k!r} is not supported for type {t!r}")
    return {"object": _object, "array": _array, "string": _string, "integer": _integer, "number": _number,
            "boolean": lambda c, s, p: _enum(c, [True, False], p), "null": lambda c, s, p: _enum(c, [None], p),
            }[t](ctx, schema, path)


def _object(ctx: _Ctx, schema, path: str) -> Render:
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise SchemaError("properties", f"{path}: properties must be an object")
    missing = [k for k in schema.get("required", []) if k not in props]
    if missing:
        raise SchemaError("required", f"{path}: required property {missing[0]!r} has no schema in properties")
    _fixed(ctx, "{")
    parts = []
    for i, (k, sub) in enumerate(props.items()):
        _fixed(ctx, (", " if i else "") + json.dumps(k, ensure_ascii=False) + ": ")
        parts.append((k, _node(ctx, sub, f"{path}.{k}")))
    _fixed(ctx, "}")

    def render(ids):
        vals = [(k, r(ids)) for k, r in parts]
        return {k: v for k, (v, _) in vals}, all(e for _, (_, e) in vals)
    return render


def _free_object(ctx: _Ctx, n_members: int, width: int) -> Render:
    """Any JSON object (response_format json_object): up to n_members members, string keys and
    values of at most `width` tokens; a member whose key is empty is dropped."""
    _fixed(ctx, "{")
    members = []
    for i in range(n_members):
        _fixed(ctx, (", " if i else "") + '"')
        key = ctx.b.slot(_string_positions(ctx, 0, width))
        _fixed(ctx, '": ')
        members.append((key, _string(ctx, {"maxLength": width}, "$")))
    _fixed(ctx, "}")

    def render(ids):
        out = {}
        for key, value in members:
            k, empty = _slot_text(ctx, key, ids)
            if not empty:
                out.setdefault(k, value(ids)[0])
        return out, not out
    return render


def _array(ctx: _Ctx, schema, path: str) -> Render:
    if "items" not in schema or not isinstance(schema["items"], dict):
        raise SchemaError("items", f"{path}: an array needs one items schema (an object)")
    lo, hi = schema.get("minItems", 0), schema.get("maxItems")
    if hi is None:
        raise SchemaError("maxItems", f"{path}: an array without maxItems is unbounded; a canvas template needs "
                                      f"maxItems (at most {MAX_ITEMS})")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 0 <= lo <= hi <= MAX_ITEMS:
        raise SchemaError("maxItems", f"{path}: need integers 0 <= minItems <= maxItems <= {MAX_ITEMS}, got "
                                      f"minItems={lo!r}, maxItems={hi!r}")
    _fixed(ctx, "[")
    items = []
    for i in range(hi):
        if i:
            _fixed(ctx, ", ")
        items.append(_node(ctx, schema["items"], f"{path}[{i}]"))
    _fixed(ctx, "]")

    def render(ids):
        out = []
        for i, r in enumerate(items):
            v, empty = r(ids)
            if i < lo or not empty:
                out.append(v)
        return out, not out
    return render


def _string_positions(ctx: _Ctx, lo: int, width: int) -> list:
    s, pad = ctx.vocab.string, ctx.vocab.pad
    if not s:
        raise SchemaError("type", "the tokenizer has no token usable inside a JSON string")
    return [s if i < lo else s | {pad} for i in range(width)]


def _string(ctx: _Ctx, schema, path: str) -> Render:
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    for name, v in (("minLength", lo), ("maxLength", hi)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise SchemaError(name, f"{path}: {name} must be a non-negative integer, got {v!r}")
    width = W_STR if hi is None else min(hi, MAX_STR)
    if lo > width or (hi is not None and lo > hi):
        raise SchemaError("minLength", f"{path}: minLength={lo} exceeds the string's bound ({width} tokens)")
    _fixed(ctx, '"')
    slot = ctx.b.slot(_string_positions(ctx, lo, width))
    _fixed(ctx, '"')

    def render(ids):
        text, empty = _slot_text(ctx, slot, ids)
        return (text if hi is None else text[:hi]), empty
    return render


def _digits(ctx: _Ctx, width: int, signed: bool):
    d, pad = ctx.vocab.digits, ctx.vocab.pad
    if not d:
        raise SchemaError("type", "the tokenizer has no digit token")
    minus = ctx.vocab.ids_of_chars("-")
    first = d | {pad} | (minus if signed else frozenset())
    return ctx.b.slot([first] + [d | {pad}] * (width - 1))


def _integer(ctx: _Ctx, schema, path: str) -> Render:
    slot = _digits(ctx, W_INT, True)

    def render(ids):
        text, empty = _slot_text(ctx, slot, ids)
        return (int(text) if text.strip("-") else 0), empty
    return render


def _number(ctx: _Ctx, schema, path: str) -> Render:
    whole = _digits(ctx, W_INT, True)
    _fixed(ctx, ".")
    frac = _digits(ctx, W_FRAC, False)

    def render(ids):
        a, e1 = _slot_text(ctx, whole, ids)
        f, e2 = _slot_text(ctx, frac, ids)
        sign = "-" if a.startswith("-") else ""
        v = float(f"{sign}{a.strip('-') or '0'}.{f or '0'}")
        return (int(v) if v.is_integer() and not f else v), e1 and e2
    return render


def _enum(ctx: _Ctx, values: list, path: str) -> Render:
    try:
        cands = [ctx.encode(json.dumps(v, ensure_ascii=False)) for v in values]
    except (TypeError, ValueError) as e:
        raise SchemaError("enum", f"{path}: enum values must be JSON values ({e})") from None
    width = max(len(c) for c in cands)
    pad = ctx.vocab.pad
    slot = ctx.b.slot([{c[i] if i < len(c) else pad for c in cands} | {pad} for i in range(width)])

    def render(ids):
        got = ids[slot.start:slot.start + slot.length]
        if all(t == pad for t in got):
            return values[0], True
        score = [sum(g == (c[i] if i < len(c) else pad) for i, g in enumerate(got)) for c in cands]
        return values[score.index(max(score))], False
    return render
