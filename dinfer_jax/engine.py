"""generate(model, prompts, SamplingParams) -> GenerationResult: canvas building, shape bucketing,
and a cache of compiled generation programs (one per static spec x bucket).
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Sequence

import jax
import numpy as np

from dinfer_jax.sharding import to_host
from dinfer_jax.decoding.loop import CACHES, KNOBS, DecodeSpec, generate_loop
from dinfer_jax.decoding.strategies import FIXED, STRATEGIES

PROMPT_BUCKET = 32  # prompt lengths are padded up to a multiple of this


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Decoding settings. Static ones select a compiled program; the rest are traced per row.

    Defaults follow dInfer for LLaDA-MoE: threshold 0.9, block 64, dual cache, temperature 0.
    steps: total denoising steps for the fixed/random strategies (LLaDA `steps`), split evenly
    over blocks (steps % num_blocks == 0).
    """
    gen_length: int = 128
    block_length: int = 64
    strategy: str = "threshold"  # fixed | random | threshold | factor | credit | hierarchy
    steps: int | None = None
    cache: str = "dual"  # none | prefix | dual | vicinity
    refresh_every: int = 0
    prefix_look: int = 16
    after_look: int = 16
    warmup_steps: int = 4
    smoothing: bool = False
    early_stop: bool = True
    start_block_align: bool = False
    threshold: float = 0.9
    low_threshold: float = 0.4
    factor: float = 1.0
    temperature: float = 0.0
    seed: int = 0
    cont_weight: float = 0.3
    credit_alpha: float = 0.7
    credit_gamma: float = 0.2
    credit_beta: float = 0.8
    # Block diffusion (cache="block"; LLaDA2.x): LLaDA2's sampler and LLaDA2.1's token editing.
    editing_threshold: float | None = None  # T2T edit threshold; None: no editing (LLaDA2.0 rule)
    max_post_steps: int = 16  # post-fill (edit) forwards per block at most
    num_to_transfer: int = 1  # M2T: at least this many masks per step (the most probable)
    top_k: int = 0  # temperature > 0: keep the k most probable tokens (0: all)
    top_p: float = 1.0  # temperature > 0: nucleus (1.0: off)

    def spec(self, mask_id: int, eos_id: int) -> DecodeSpec:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {STRATEGIES}")
        if self.cache not in CACHES:
            raise ValueError(f"cache={self.cache!r} is not one of {CACHES}")
        if self.gen_length <= 0 or self.block_length <= 0 or self.gen_length % self.block_length:
            raise ValueError(f"gen_length={self.gen_length} must be a positive multiple of "
                             f"block_length={self.block_length}")
        steps_per_block = 0
        if self.strategy in FIXED:
            nb = self.gen_length // self.block_length
            steps = self.gen_length if self.steps is None else self.steps
            if steps <= 0 or steps % nb:
                raise ValueError(f"steps={steps} must be a positive multiple of the number of blocks ({nb})")
            steps_per_block = steps // nb
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed} must be in [0, 2**32)")
        if self.num_to_transfer < 1 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"num_to_transfer={self.num_to_transfer} must be >= 1, top_k={self.top_k} >= 0, "
                             f"top_p={self.top_p} in (0, 1]")
        return DecodeSpec(
            gen_length=self.gen_length, block_length=self.block_length, strategy=self.strategy,
            steps_per_block=steps_per_block, cache=self.cache, refresh_every=self.refresh_every,
            prefix_look=self.prefix_look, after_look=self.after_look, warmup_steps=self.warmup_steps,
            smoothing=self.smoothing, early_stop=self.early_stop, start_block_align=self.start_block_align,
            mask_id=mask_id, eos_id=eos_id, editing=self.editing_threshold is not None,
            max_post_steps=self.max_post_steps)


@dataclasses.dataclass
class GenerationResult:
    """Per prompt: generated ids (gen region, EOS padding removed), the raw gen region, counters.

    nfe: forwards this prompt took part in; tpf: generated non-EOS tokens / nfe.
    batch_nfe_full / batch_nfe_window: forwards the batch program actually ran, by kind.
    """
    token_ids: list[list[int]]
    raw_ids: np.ndarray
    nfe: list[int]
    tpf: list[float]
    steps_per_block: np.ndarray
    batch_nfe_full: int
    batch_nfe_window: int
    seconds: float
    edits: list[int] | None = None  # block diffusion with editing: token-to-token edits per prompt


def _bucket_batch(b: int) -> int:
    return 1 << max(0, (b - 1).bit_length())


def _bucket_len(n: int) -> int:
    return max(PROMPT_BUCKET, -(-n // PROMPT_BUCKET) * PROMPT_BUCKET)


class Generator:
    """Compiled-program cache for one model. `compiles` counts traces (tests assert no recompiles)."""

    def __init__(self, model):
        self.model = model
        self.compiles = 0
        self._programs = {}

    def _program(self, spec: DecodeSpec, gen_start: int):
        key = (spec, gen_start)
        if key not in self._programs:
            module = self.model.module
            if module.cfg.attention_mask == "block_causal":  # the attention block is the decoding block
                module = module.clone(attention_block=spec.block_length)

            def run(params, canvas, pad, plen, active, knobs, observer_id):
                self.compiles += 1  # runs at trace time only
                return generate_loop(module, params, spec, canvas, pad, plen, gen_start, active, knobs, observer_id)
            self._programs[key] = jax.jit(run, donate_argnums=(1,))  # outputs keep the canvas sharding
        return self._programs[key]

    def lower(self, prompts, params: SamplingParams, observe: bool = False):
        """The lowered program for these prompts (for inspection: HLO, while ops, callbacks)."""
        prog, args, *_ = self._prepare(prompts, params, observe)
        return prog.lower(*args)

    def _prepare(self, prompts, params, observe: bool = False, observer_id: int = 0):
        cfg = self.model.config
        if hasattr(prompts, "shape"):  # one array: (L,) is one prompt, (B, L) a batch
            arr = np.asarray(prompts)
            prompts = [arr] if arr.ndim == 1 else list(arr)
        elif len(prompts) and np.ndim(prompts[0]) == 0:  # a flat list of ids is one prompt
            prompts = [prompts]
        if not len(prompts):
            raise ValueError("no prompts given")
        rows = []
        for p in prompts:
            arr = np.asarray(p)
            if arr.ndim != 1:
                raise ValueError(f"each prompt must be a 1-D sequence of token ids, got shape {arr.shape}")
            rows.append(self.model.check_ids(arr))
        for r in rows:
            if (r == cfg.mask_token_id).any():
                raise ValueError(f"prompt contains the mask token id {cfg.mask_token_id}")
        per_row = list(params) if isinstance(params, (list, tuple)) else [params] * len(rows)
        if len(per_row) != len(rows):
            raise ValueError(f"{len(per_row)} SamplingParams for {len(rows)} prompts (give one, or one per prompt)")
        spec = per_row[0].spec(cfg.mask_token_id, cfg.eos_id)
        if spec.cache == "block" and cfg.attention_mask != "block_causal":
            raise ValueError(f"cache='block' (block diffusion) needs a block-causal model; this {cfg.family} model "
                             f"has {cfg.attention_mask} attention (use none, prefix, dual or vicinity)")
        for i, p in enumerate(per_row[1:], 1):
            other = p.spec(cfg.mask_token_id, cfg.eos_id)
            if other != spec:
                diff = [f.name for f in dataclasses.fields(spec) if getattr(spec, f.name) != getattr(other, f.name)]
                raise ValueError(f"prompts in one batch must share the compiled settings; prompt {i} differs in "
                                 f"{diff} (only {', '.join(KNOBS)} may differ per prompt)")
        if observe:
            spec = dataclasses.replace(spec, observe=True)
        dp = self.model.data_parallel
        B = -(-_bucket_batch(len(rows)) // dp) * dp  # rows split evenly over the mesh's data axis
        gen_start = _bucket_len(max(len(r) for r in rows) + spec.head_room)
        Lc = gen_start + spec.gen_length + spec.tail_room
        if max(len(r) for r in rows) + spec.gen_length > cfg.max_position_embeddings:
            raise ValueError(f"prompt + gen_length = {max(len(r) for r in rows) + spec.gen_length} exceeds "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        pad_id = cfg.pad_id
        canvas = np.full((B, Lc), pad_id, np.int32)
        pad = np.full((B,), gen_start, np.int32)
        plen = np.zeros((B,), np.int32)
        for b, r in enumerate(rows):
            canvas[b, gen_start - len(r):gen_start] = r
            pad[b], plen[b] = gen_start - len(r), len(r)
        canvas[:len(rows), gen_start:gen_start + spec.gen_length] = cfg.mask_token_id
        active = np.arange(B) < len(rows)
        def knob(p, k):
            v = getattr(p, k)
            return 1.0 if v is None else v  # editing_threshold None: no editing (the value is unused)
        knobs = {k: np.array([knob(per_row[min(b, len(rows) - 1)], k) for b in range(B)],
                             np.uint32 if k == "seed" else np.float32) for k in KNOBS}
        prog = self._program(spec, gen_start)
        put = self.model.place_batch
        args = (self.model.params, put(canvas), put(pad), put(plen), put(active), {k: put(v) for k, v in knobs.items()},
                np.int32(observer_id))
        return prog, args, rows, spec, gen_start

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 observer=None) -> GenerationResult:
        """Decode a batch. params: one SamplingParams for all prompts, or one per prompt (they must
        share the compiled settings; KNOBS such as threshold, temperature and seed may differ).
        observer: fn(step, gen_BG, blk_B, done_B, active_B) called on the host after every loop
        iteration (decoding/observe.py); it selects a program variant with one callback per step."""
        params = params or SamplingParams()
        oid = 0
        if observer is not None:
            from dinfer_jax.decoding import observe
            oid = observe.register(observer)
        try:
            prog, args, rows, spec, gen_start = self._prepare(prompts, params, observer is not None, oid)
            t = time.perf_counter()
            with jax.profiler.TraceAnnotation("dinfer_generate"):
                canvas, stats = prog(*args)
                canvas = to_host(canvas)
            secs = time.perf_counter() - t
        finally:
            if observer is not None:
                observe.unregister(oid)
        stats = jax.tree_util.tree_map(to_host, stats)
        n = len(rows)
        if not stats["done"][:n].all():  # only with non-finite logits (e.g. a bf16 overflow)
            warnings.warn(f"{int((~stats['done'][:n]).sum())} of {n} prompts hit the iteration bound "
                          f"({spec.max_iterations}) before every block was decoded; their output keeps mask ids",
                          RuntimeWarning, stacklevel=2)
        raw = canvas[:n, gen_start:gen_start + spec.gen_length]
        cfg = self.model.config
        stops = cfg.stop_ids
        out, tpf = [], []
        for b in range(n):
            toks = raw[b].tolist()
            cut = next((i for i, t_ in enumerate(toks) if t_ in stops), len(toks))
            out.append(toks[:cut])
            real = int(np.sum((raw[b] != cfg.eos_token_id) & (raw[b] != cfg.mask_token_id)))
            tpf.append(real / max(1, int(stats["row_nfe"][b])))
        edits = [int(v) for v in stats["edits"][:n]] if "edits" in stats else None
        return GenerationResult(out, raw, [int(v) for v in stats["row_nfe"][:n]], tpf,
                                stats["steps_per_block"][:n], int(stats["nfe_full"]), int(stats["nfe_window"]), secs,
                                edits)


def generate(model, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None,
             observer=None) -> GenerationResult:
    """Decode prompts with the model's compiled-program cache (`model.generator`); see
    `Generator.generate` for per-prompt params and the observer."""
    return model.generator.generate(prompts, params, observer=observer)
