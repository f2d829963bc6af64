"""Regular expression (a subset) -> canvas template: one position per character, each taking the
single-character tokens of its set; optional repetitions take the pad (EOS) too. The decoded text
fullmatches the pattern by construction. Supported: literals, escapes, \\d \\w \\s, ".", [...] / [^...],
?, {m}, {m,n}, ^ / $ at the ends; anything else (*, +, {m,}, groups, |, backreferences, lookarounds)
raises SchemaError naming it (docs/structured_output.md).
"""
from __future__ import annotations

import string

from dinfer_jax.canvas_template import TemplateBuilder
from dinfer_jax.json_template import SchemaError
from dinfer_jax.token_classes import VocabClasses

MAX_REPEAT = 64
_PRINTABLE = set(string.printable) - set("\x0b\x0c\r")
_CLASS_ESCAPES = {"d": set(string.digits), "w": set(string.ascii_letters + string.digits + "_"),
                  "s": set(" \t\n")}


def _parse(pattern: str) -> list[tuple[set, int, int]]:
    """pattern -> [(character set, min, max)]."""
    atoms: list = []
    i, n = 0, len(pattern)
    if pattern.startswith("^"):
        i = 1
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        n -= 1
    while i < n:
        c = pattern[i]
        if c in "()":
            raise SchemaError("regex", f"regex groups '(...)' are not supported (position {i})")
        if c == "|":
            raise SchemaError("regex", f"regex alternation '|' is not supported (position {i}); use choice")
        if c in "*+":
            raise SchemaError("regex", f"regex quantifier {c!r} is unbounded (position {i}); write {{0,n}} or {{1,n}}")
        if c in "?{" :
            raise SchemaError("regex", f"regex quantifier {c!r} at position {i} follows nothing")
        if c == "\\":
            if i + 1 >= n:
                raise SchemaError("regex", "regex ends with a lone backslash")
            e = pattern[i + 1]
            if e in _CLASS_ESCAPES:
                chars = set(_CLASS_ESCAPES[e])
            elif e.isalnum():
                raise SchemaError("regex", f"regex escape \\{e} is not supported (position {i})")
            else:
                chars = {e}
            i += 2
        elif c == ".":
            chars = _PRINTABLE - {"\n"}
            i += 1
        elif c == "[":
            chars, i = _char_class(pattern, i)
        else:
            chars = {c}
            i += 1
        lo = hi = 1
        if i < n and pattern[i] == "?":
            lo, i = 0, i + 1
        elif i < n and pattern[i] in "*+":
            raise SchemaError("regex", f"regex quantifier {pattern[i]!r} is unbounded (position {i}); write "
                                       f"{{0,n}} or {{1,n}}")
        elif i < n and pattern[i] == "{":
            j = pattern.find("}", i)
            if j < 0:
                raise SchemaError("regex", f"regex quantifier at position {i} is not closed")
            body = pattern[i + 1:j].split(",")
            try:
                lo = int(body[0])
                hi = lo if len(body) == 1 else int(body[1])
            except ValueError:
                raise SchemaError("regex", f"regex quantifier {pattern[i:j + 1]!r} needs {{m}} or {{m,n}} "
                                           f"(unbounded {{m,}} is not supported)") from None
            if len(body) > 2 or not 0 <= lo <= hi <= MAX_REPEAT:
                raise SchemaError("regex", f"regex quantifier {pattern[i:j + 1]!r}: need 0 <= m <= n <= {MAX_REPEAT}")
            i = j + 1
        if i < n and pattern[i] in "?+*{":
            raise SchemaError("regex", f"stacked regex quantifier at position {i}")
        atoms.append((chars, lo, hi))
    return atoms


def _char_class(p: str, i: int) -> tuple[set, int]:
    j = i + 1
    negate = j < len(p) and p[j] == "^"
    j += negate
    chars: set = set()
    first = True
    while j < len(p) and (p[j] != "]" or first):
        first = False
        if p[j] == "\\" and j + 1 < len(p):
            e = p[j + 1]
            if e in _CLASS_ESCAPES:
                chars |= _CLASS_ESCAPES[e]
                j += 2
                continue
            c, j = e, j + 2
        else:
            c, j = p[j], j + 1
        if j + 1 < len(p) and p[j] == "-" and p[j + 1] != "]":
            end = p[j + 1]
            if end == "\\" and j + 2 < len(p):
                end, j = p[j + 2], j + 3
            else:
                j += 2
            if ord(end) < ord(c):
                raise SchemaError("regex", f"regex range {c}-{end} is reversed")
            chars |= {chr(k) for k in range(ord(c), ord(end) + 1)}
        else:
            chars.add(c)
    if j >= len(p):
        raise SchemaError("regex", f"regex character class at position {i} is not closed")
    return ((_PRINTABLE - chars) if negate else chars), j + 1


def regex_template(pattern: str, vocab: VocabClasses, max_positions: int):
    """-> (CanvasTemplate, render(ids) -> text) for `pattern` (module doc), or SchemaError."""
    if not isinstance(pattern, str) or not pattern:
        raise SchemaError("regex", "regex must be a non-empty string")
    atoms = _parse(pattern)
    b = TemplateBuilder()
    for chars, lo, hi in atoms:
        ids = vocab.ids_of_chars(chars)
        if not ids:
            raise SchemaError("regex", f"no single-character token of the vocabulary matches {sorted(chars)[:8]}")
        if lo == hi == 1 and len(ids) == 1:
            b.fixed(ids)
            continue
        b.slot([ids] * lo + [ids | {vocab.pad}] * (hi - lo))
    template = b.build()
    if len(template) > max_positions:
        raise SchemaError("regex", f"the regex needs {len(template)} tokens, more than the {max_positions} available")
    if not template.slots:
        raise SchemaError("regex", f"the regex {pattern!r} matches one fixed text only; nothing to decode")

    def render(ids) -> str:
        return "".join(vocab.texts[t] if f < 0 else vocab.texts[f] for t, f in zip(ids, template.tokens)
                       if f >= 0 or t != vocab.pad)
    return template, render
