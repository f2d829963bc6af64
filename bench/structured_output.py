"""Structured output and infilling on the demo tasks: accuracy and tokens per forward with and
without a canvas template, and the constrained program's cost per forward.

  python bench/structured_output.py [--n 64] [--repeats 5] [--out bench/structured_output.json]

Modes (the built-in demo model, its default decoding: threshold 0.9, dual cache, gen 16, block 16):
  free     plain generation; the answer is the text before EOS
  regex    add: \\d{4}; sort: \\d{4,12}            (the answer's own format)
  json     add: {"sum": integer}; sort: {"sorted": string, maxLength 12}  (a format the model never saw)
  infill   add only: the sum's 1st and 3rd digits given, the 2nd and 4th filled
Accuracy: exact match (json: the value equals the answer; add's as an integer). Tokens per forward:
slot tokens written (pads and fixed tokens excluded) / forwards. Cost per forward: one batch of
--batch prompts, the unconstrained program vs the regex-constrained one at the same shapes
(gen 16, block 16), median over --repeats timed runs of seconds / batch forwards.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dinfer_jax import load_model  # noqa: E402
from dinfer_jax.canvas_template import infill_template  # noqa: E402
from dinfer_jax.checkpoint import DEMO_MODEL_DIR  # noqa: E402
from dinfer_jax.engine import SamplingParams, generate  # noqa: E402
from dinfer_jax.structured import StructuredOutput, build_constraint  # noqa: E402
from dinfer_jax.tasks import sample  # noqa: E402
from dinfer_jax.tokenizer import load_tokenizer  # noqa: E402


def constraint_for(mode: str, task: str):
    if mode == "regex":
        return StructuredOutput(regex=r"\d{4}" if task == "add" else r"\d{4,12}")
    if mode == "json":
        key, schema = ("sum", {"type": "integer"}) if task == "add" else ("sorted", {"type": "string", "maxLength": 12})
        return StructuredOutput(json={"type": "object", "properties": {key: schema}, "required": [key]})
    return None


def correct(mode: str, task: str, text: str, answer: str) -> bool:
    if mode != "json":
        return text == answer
    try:
        v = list(json.loads(text).values())[0]
    except (ValueError, IndexError):
        return False
    return (v == int(answer)) if task == "add" else (v == answer)


def run_mode(model, tok, probs, mode, params):
    cfg = model.config
    ids = [tok.encode(p["prompt"]) for p in probs]
    if mode == "free":
        r = generate(model, ids, params)
        texts = [tok.decode(t) for t in r.token_ids]
        written = [len(t) for t in r.token_ids]
    else:
        if mode == "infill":
            built = None
            templates = [infill_template([tok.encode(p["answer"][0]), 1, tok.encode(p["answer"][2]), 1])
                         for p in probs]
        else:
            built = [build_constraint(constraint_for(mode, p["task"]), tok, cfg, 256) for p in probs]
            templates = [b.template for b in built]
        r = generate(model, ids, params, templates=templates)
        texts = ([tok.decode(t) for t in r.token_ids] if built is None
                 else [b.render(t) for b, t in zip(built, r.token_ids)])
        written = [sum(1 for t, c in zip(ids_, tm.classes) if c >= 0 and t != cfg.eos_id)
                   for ids_, tm in zip(r.token_ids, templates)]
    acc = [correct(mode, p["task"], t, p["answer"]) for p, t in zip(probs, texts)]
    return {"mode": mode, "n": len(probs), "accuracy": round(sum(acc) / len(acc), 4),
            "tokens_per_forward": round(sum(written) / max(1, sum(r.nfe)), 3),
            "mean_forwards": round(sum(r.nfe) / len(r.nfe), 2), "examples": texts[:3]}


def cost_per_forward(model, tok, params, batch: int, repeats: int):
    probs = sample(batch, seed=99, tasks=("add",))
    ids = [tok.encode(p["prompt"]) for p in probs]
    built = [build_constraint(constraint_for("regex", "add"), tok, model.config, 256) for _ in probs]
    out = {}
    for name, templates in (("unconstrained", None), ("constrained", [b.template for b in built])):
        generate(model, ids, params, templates=templates)  # compile
        per = []
        for _ in range(repeats):
            t = time.perf_counter()
            r = generate(model, ids, params, templates=templates)
            per.append((time.perf_counter() - t) / max(1, r.batch_nfe_full + r.batch_nfe_window))
        out[name] = round(statistics.median(per) * 1e3, 4)
    out["ratio"] = round(out["constrained"] / out["unconstrained"], 3)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model, tok = load_model(DEMO_MODEL_DIR), load_tokenizer(DEMO_MODEL_DIR)
    params = SamplingParams.for_model(model.config, DEMO_MODEL_DIR)
    rows = []
    for task in ("add", "sort"):
        probs = sample(a.n, seed=7, tasks=(task,))
        for mode in ("free", "regex", "json") + (("infill",) if task == "add" else ()):
            row = {"task": task, **run_mode(model, tok, probs, mode, params)}
            rows.append(row)
            print(f"| {task} | {mode} | {row['accuracy']:.3f} | {row['tokens_per_forward']:.2f} | "
                  f"{row['mean_forwards']:.2f} | {row['examples'][0]!r} |", flush=True)
    cost = cost_per_forward(model, tok, params, a.batch, a.repeats)
    print(f"ms per forward (batch {a.batch}, gen 16): unconstrained {cost['unconstrained']}, constrained "
          f"{cost['constrained']} (x{cost['ratio']})")
    res = {"rows": rows, "cost_per_forward_ms": cost, "params": {"n": a.n, "batch": a.batch, "repeats": a.repeats},
           "jax": __import__("jax").__version__}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
