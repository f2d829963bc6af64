"""Stop strings (the OpenAI / vLLM `stop` field) on decoded text: looked for in the row's committed
left-to-right prefix; the answer's text ends before the first stop string, its ids run through the
token that completed it, finish reason "stop"; streams hold back a tail that could become one
(docs/openai_fields.md).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256


def check_stop(stop) -> tuple[str, ...]:
    """The request's `stop` (None, a string or a list of strings) -> a tuple; ValueError naming
    the problem (at most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS characters)."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")
    return tuple(dict.fromkeys(stops))


def find_stop(text: str, stops: Sequence[str]) -> Optional[tuple[int, int]]:
    """(start, end) of the earliest stop string in text (the longest one at that start), or None."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and i + len(s) > best[1])):
            best = (i, i + len(s))
    return best


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of text a stream must hold back: the longest suffix that is a
    proper prefix of some stop string (it may still grow into one)."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


def ids_through(ids: Sequence[int], decode: Callable[[list[int]], str], end: int) -> int:
    """The fewest leading ids whose text reaches character `end` (so it holds the stop string that
    ends there): a binary search over prefixes (decoding a longer prefix never shortens the text)."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(list(ids[:mid]))) >= end:
            hi = mid
        else:
            lo = mid + 1
    return hi
