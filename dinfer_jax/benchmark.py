"""`dinfer-jax bench`: generation throughput of a model for each batch size x strategy x cache
(random seeded prompts; one untimed run, then the median of `repeats`: seconds per batch, tokens/s,
NFE, TPF; docs/internals/demo_model.md).
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

import numpy as np


@dataclasses.dataclass
class BenchRow:
    batch: int
    strategy: str
    cache: str
    seconds: float
    tokens_per_s: float
    nfe: float
    tpf: float
    tokens: int


def random_prompts(cfg, batch: int, length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.RandomState(seed)
    special = {cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.eot_token_id}
    allowed = np.array([t for t in range(min(cfg.vocab_size, 50_000)) if t not in special], np.int32)
    return [rng.choice(allowed, length) for _ in range(batch)]


def run_bench(model, batches=(1,), strategies=("threshold",), caches=("dual",), prompt_len: int = 32,
              base=None, repeats: int = 3, progress: bool = True) -> list[BenchRow]:
    from dinfer_jax.engine import SamplingParams
    base = base or SamplingParams()
    combos = list(itertools.product(batches, strategies, caches))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(combos) * (repeats + 1), desc="bench", unit="run")
    rows = []
    eos = model.config.eos_token_id
    for B, strategy, cache in combos:
        p = dataclasses.replace(base, strategy=strategy, cache=cache)
        if strategy in ("fixed", "random") and p.steps is None:
            p = dataclasses.replace(p, steps=p.gen_length)
        prompts = random_prompts(model.config, B, prompt_len)
        model.generator.generate(prompts, p)  # compile + warm up
        if bar:
            bar.update()
        secs, toks, nfes, tpfs = [], [], [], []
        for _ in range(repeats):
            t = time.perf_counter()
            r = model.generator.generate(prompts, p)
            secs.append(time.perf_counter() - t)
            toks.append(int(np.sum((r.raw_ids != eos) & (r.raw_ids != model.config.mask_token_id))))
            nfes.append(r.batch_nfe_full + r.batch_nfe_window)
            tpfs.append(float(np.mean(r.tpf)))
            if bar:
                bar.update()
        s = statistics.median(secs)
        rows.append(BenchRow(B, strategy, cache, s, statistics.median(toks) / s, statistics.median(nfes),
                             statistics.median(tpfs), int(statistics.median(toks))))
    if bar:
        bar.close()
    return rows


def format_table(rows: list[BenchRow]) -> str:
    lines = ["| batch | strategy | cache | s / batch | tokens/s | forwards | tokens/forward |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.batch} | {r.strategy} | {r.cache} | {r.seconds:.3f} | {r.tokens_per_s:.1f} | "
                     f"{r.nfe:.0f} | {r.tpf:.2f} |")
    return "\n".join(lines)
