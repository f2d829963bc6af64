"""The token sets a canvas template's slots draw from, read off a tokenizer's vocabulary once:
each id's own decoded text, and which ids are digits, string characters, single characters.
Special tokens (EOS, mask, ...) decode to "" and belong to no set; EOS is the slot pad."""
from __future__ import annotations

import dataclasses
import weakref


@dataclasses.dataclass(frozen=True)
class VocabClasses:
    """texts[i]: id i decoded alone; pad: the id that ends a slot early (EOS); digits: ids whose
    text is only 0-9; string: ids safe inside a JSON string (printable, no quote, backslash or
    control character); char: single-character text -> its id (the first such id)."""
    texts: tuple[str, ...]
    pad: int
    digits: frozenset
    string: frozenset
    char: dict

    def ids_of_chars(self, chars) -> frozenset:
        """The single-character ids whose character is in `chars` (a str or a predicate)."""
        test = chars if callable(chars) else (lambda c: c in chars)
        return frozenset(i for c, i in self.char.items() if test(c))


def _string_safe(text: str) -> bool:
    return bool(text) and "\ufffd" not in text and all(c not in '"\\' and c.isprintable() for c in text)


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def vocab_classes(tokenizer, vocab_size: int, pad_id: int, mask_id: int) -> VocabClasses:
    """The classes of tokenizer's vocabulary (ids below vocab_size; the mask id never belongs to a
    set); cached per tokenizer object."""
    key = (vocab_size, pad_id, mask_id)
    per_tok = _CACHE.setdefault(tokenizer, {})
    if key not in per_tok:
        per_tok[key] = _build(tokenizer, vocab_size, pad_id, mask_id)
    return per_tok[key]


def _build(tokenizer, vocab_size, pad_id, mask_id) -> VocabClasses:
    texts = []
    for i in range(vocab_size):
        try:
            t = tokenizer.decode([i])
        except Exception:  # ids the tokenizer file does not define (padded vocabularies)
            t = ""
        texts.append(t if i not in (mask_id, pad_id) else "")
    digits = frozenset(i for i, t in enumerate(texts) if t and t.isascii() and t.isdigit())
    string = frozenset(i for i, t in enumerate(texts) if _string_safe(t))
    char: dict = {}
    for i, t in enumerate(texts):
        if len(t) == 1:
            char.setdefault(t, i)
    return VocabClasses(tuple(texts), pad_id, digits, string, char)
