"""The demo task suite: short text problems with exactly one correct answer, generated from a seed
(add, sort, next in the default mix `TASKS`; reverse is valid but not trained). `solve(prompt)`
answers any well-formed prompt. Formats and why these tasks: docs/internals/demo_model.md.
"""
from __future__ import annotations

import random
import string

TASKS = ("add", "sort", "next")  # the default mix
ALL_TASKS = ("add", "sort", "next", "reverse")
ADD_DIGITS = 3  # operand width; the sum has ADD_DIGITS + 1 digits
NEXT_LEN = 8
MIN_LEN, MAX_LEN = 4, 12  # list lengths for sort
REV_MIN, REV_MAX = 3, 12
_KEYWORD = {"add": "add", "sort": "sort", "reverse": "rev", "next": "next"}
_TASK_OF = {v: k for k, v in _KEYWORD.items()}
_LETTERS = string.ascii_lowercase


def _make(task: str, rng: random.Random) -> str:
    if task == "add":
        # each operand has 1..ADD_DIGITS significant digits, zero-padded to ADD_DIGITS: the short ones
        # make parts of the sum plain copies, which is what lets the model find the digits to add
        a, b = (rng.randrange(10 ** rng.randint(1, ADD_DIGITS)) for _ in range(2))
        return f"add {a:0{ADD_DIGITS}d}+{b:0{ADD_DIGITS}d}="
    if task == "sort":
        return "sort " + "".join(rng.choice(string.digits) for _ in range(rng.randint(MIN_LEN, MAX_LEN))) + "="
    if task == "next":
        return "next " + "".join(rng.choice(_LETTERS) for _ in range(NEXT_LEN)) + "="
    if task == "reverse":
        return "rev " + "".join(rng.choice(_LETTERS) for _ in range(rng.randint(REV_MIN, REV_MAX))) + "="
    raise ValueError(f"unknown task {task!r}; tasks: {ALL_TASKS}")


def task_of(prompt: str) -> str:
    """The task a prompt belongs to (by its keyword)."""
    kw = prompt.split(" ", 1)[0]
    if kw not in _TASK_OF:
        raise ValueError(f"not a demo-task prompt: {prompt!r} (keywords: {', '.join(_TASK_OF)})")
    return _TASK_OF[kw]


def solve(prompt: str) -> str:
    """The correct answer of a demo-task prompt (raises ValueError on a malformed one)."""
    task = task_of(prompt)
    body = prompt.split(" ", 1)[1] if " " in prompt else ""
    if not body.endswith("="):
        raise ValueError(f"demo-task prompts end with '=': {prompt!r}")
    body = body[:-1]
    if task == "add":
        a, sep, b = body.partition("+")
        if not (sep and a.isdigit() and b.isdigit()):
            raise ValueError(f"expected 'add A+B=': {prompt!r}")
        # the sum is zero-padded to one digit more than the wider operand (fixed width)
        return f"{int(a) + int(b):0{max(len(a), len(b)) + 1}d}"
    if task == "sort":
        if not body.isdigit():
            raise ValueError(f"expected 'sort DIGITS=': {prompt!r}")
        return "".join(sorted(body))
    if not (body and all(c in _LETTERS for c in body)):
        raise ValueError(f"expected '{_KEYWORD[task]} lowercase-letters=': {prompt!r}")
    if task == "reverse":
        return body[::-1]
    return "".join(_LETTERS[(_LETTERS.index(c) + 1) % 26] for c in body)


def sample(n: int, seed: int = 0, tasks=TASKS, weights: dict | None = None) -> list[dict]:
    """n fresh problems [{task, prompt, answer}], tasks drawn uniformly (or with relative `weights`
    {task: w}). Deterministic in seed."""
    rng = random.Random(seed)
    if weights:
        unknown = set(weights) - set(ALL_TASKS)
        if unknown:
            raise ValueError(f"unknown tasks {sorted(unknown)}; tasks: {ALL_TASKS}")
        tasks = [t for t in weights if weights[t] > 0]
        cum, acc = [], 0.0
        for t in tasks:
            acc += weights[t]
            cum.append(acc)
    out = []
    for _ in range(n):
        if weights:
            u = rng.random() * acc
            task = tasks[next(i for i, c in enumerate(cum) if u < c)]
        else:
            task = tasks[rng.randrange(len(tasks))]
        p = _make(task, rng)
        out.append({"task": task, "prompt": p, "answer": solve(p)})
    return out


def max_prompt_chars() -> int:
    return max(len("sort ") + MAX_LEN + 1, len("next ") + NEXT_LEN + 1, len("add ") + 2 * ADD_DIGITS + 2,
               len("rev ") + REV_MAX + 1)


def max_answer_chars() -> int:
    return max(MAX_LEN, NEXT_LEN, ADD_DIGITS + 1, REV_MAX)
