"""generate(model, prompts, SamplingParams) -> GenerationResult: canvas building, shape bucketing,
and a cache of compiled generation programs (one per static spec x bucket).
"""
from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Sequence

import jax
import numpy as np

from dinfer_jax import families
from dinfer_jax.config import ConfigError
from dinfer_jax.canvas_template import CanvasTemplate, template_classes, template_gen_length, template_region
from dinfer_jax.program_cache import DEFAULT_MAX_PROGRAMS, ProgramCache
from dinfer_jax.sharding import to_host
from dinfer_jax.decoding.prefix_cache import PrefixCache
from dinfer_jax.decoding.loop import generate_loop, refresh_rows_for
from dinfer_jax.decoding.rows import knob_value, place_row, row_output, row_record
from dinfer_jax.decoding.spec import (DREAM, EB_THRESHOLD, KNOBS, ROW_KNOBS, SCHEDULED,
                                      SETTINGS, DecodeSpec, InvalidParam, RowKnobs, check_field, check_model,
                                      check_rules, logprob_bucket, program_spec)


PROMPT_BUCKET = 32  # prompt lengths are padded up to a multiple of this


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Decoding settings. Static ones select a compiled program; the rest are traced per row.

    Defaults follow dInfer for LLaDA-MoE: threshold 0.9, block 64, dual cache, temperature 0.
    steps: total denoising steps for the fixed/random/dream strategies (LLaDA's and Dream's
    `steps`), split evenly over blocks (steps % num_blocks == 0). With cache='block': steps PER
    BLOCK, LLaDA2.0's transfer schedule (each step unmasks at least block // steps, one more on the first block % steps);
    None: num_to_transfer per step (LLaDA2.1).
    """
    gen_length: int = 128
    block_length: int = 64
    strategy: str = "threshold"  # fixed | random | threshold | factor | credit | hierarchy | dream
    # | sequential | entropy_bounded (the last two: cache="block" only, SDAR's remasking strategies)
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
    # temperature > 0: a position's confidence is the drawn token's probability under the
    # temperature-scaled softmax BEFORE top-k / top-p (SDAR's evaluation sampler,
    # huggingface_bd3.py); False: under the filtered softmax (LLaDA2, SDAR's generate.py).
    confidence_before_filter: bool = False
    # LLaDA2.2 insert/delete editing (SGLang's JointThresholdInDel; block_strategies.indel_step): greedy;
    # editing_threshold None means SGLang's edit_threshold 0; needs a model with DELETE/SPLIT ids.
    indel: bool = False
    # vLLM's extras (per row, traced): EOS never chosen (all gen_length tokens are decoded; no early
    # stop), or EOS forbidden in the first min_tokens generated positions. Only the model's EOS id is
    # forbidden, not an end-of-turn id.
    ignore_eos: bool = False
    min_tokens: int = 0
    # Dream's diffusion_generate sampler (strategy="dream"; docs/facts/llada2_and_dream.md §13.5):
    # alg one of origin | maskgit_plus | topk_margin | entropy (None: Dream's default "origin");
    # alg_temp > 0 draws the positions from softmax(confidence / alg_temp) instead of the top k;
    # t = linspace(1, eps, steps_per_block + 1) sets k = int(#masked * (1 - s/t)) per step (the
    # row's own count; Dream uses the batch mean). Dream decodes the whole canvas as one block:
    # block_length = gen_length; smaller blocks run the same schedule inside every block.
    # top_k / top_p filter the distribution before its softmax (at temperature 0 too, as in Dream).
    alg: str | None = None
    alg_temp: float = 0.0
    eps: float = 1e-3
    # Sub-block schedule inside each block (cache="block"; Fast-dLLM v2's `small_block_size`): the
    # block's sub-blocks of this many positions are decoded left to right, each with the threshold
    # rule (at least num_to_transfer per step); with a shifted-logits model a masked first position
    # of the block is first committed alone (decoding/block_loop.py). 0: off (the whole block at once).
    sub_block_length: int = 0
    # SDAR's remasking strategies on the block loop (cache="block"; families/sdar.py, DECODING):
    # strategy "sequential" commits the leftmost n masks per step; "entropy_bounded" commits the
    # masks in order of increasing entropy (of the distribution the confidence is read from) while
    # the running sum of their entropies stays < eb_threshold (nats), at least n (n = the steps
    # schedule's count, else num_to_transfer; SDAR: 1) and at most every mask. `threshold` is unused.
    eb_threshold: float = EB_THRESHOLD
    # Fast-dLLM v2's sub-block DualCache (its generate(use_block_cache=True)): with sub_block_length,
    # a step that enters a sub-block (or whose sub-block's first position is still masked) runs a
    # forward over the whole block and keeps the block's K/V; the other steps run a forward over the
    # sub-block only, reading the other block positions' K/V from that block cache (stale: an
    # approximation; decoding/block_loop.py). False: every step is a whole-block forward (exact).
    sub_block_cache: bool = False
    # Per-token log-probabilities (None: off): each generated token's log-probability and the
    # `logprobs` (0..20) most probable alternatives, under the distribution of the step that committed
    # it (decoding/row_state.commit_record: log_softmax of the logits the decoder received, fp32, before
    # temperature / top-k / top-p; not a left-to-right likelihood). GenerationResult.token_logprobs /
    # top_logprobs. The commit step of each token (GenerationResult.commit_steps) is always recorded.
    logprobs: int | None = None

    def __post_init__(self):
        """Every per-field rule (decoding/spec.SETTINGS: types, ranges, finiteness) is checked here, at
        construction, for the CLI, the library and the server alike; rules between fields by `validate`."""
        for name in SETTINGS:
            object.__setattr__(self, name, check_field(name, getattr(self, name)))

    def validate(self) -> "SamplingParams":
        """The rules between fields (decoding/spec.RULES); returns self."""
        check_rules(self)
        return self

    @classmethod
    def for_model(cls, cfg, folder: str | None = None, *, defaults: "SamplingParams | None" = None,
                  **overrides) -> "SamplingParams":
        """THE decoding settings of a model (docs/decoding_defaults.md): its family's documented
        defaults (`Family.decoding`: its authors' own generate() defaults), then what its folder
        sets (config.json's attention block, generation_config.json: `families.folder_decoding`),
        then `overrides` (explicit flags, request fields, arguments), merged by `families.layer`.
        defaults: an already resolved SamplingParams to start from instead (the server's defaults,
        with a request's fields as overrides). A full-canvas cache on a block-causal model warns
        once, saying what changes."""
        fam = families.get(cfg.family)
        whole = families.whole_canvas(fam)
        own = {} if defaults is not None else families.folder_decoding(cfg, folder)
        base = (dataclasses.asdict(defaults) if defaults is not None
                else families.layer(dict(fam.decoding), own, whole))
        try:
            sp = cls(**families.layer(base, overrides, whole))
        except InvalidParam as e:  # a bad value from the folder names its file
            if e.field in own and e.field not in overrides and folder is not None:
                raise ConfigError(f"{os.path.join(folder, families.GENERATION_CONFIG)}: {e}") from None
            raise
        _warn_family_conflict(cfg, sp)
        return sp

    def spec_for(self, cfg) -> DecodeSpec:
        """`spec` with a model config's mask / EOS ids and logit shift, checked against what the model
        can decode (`check_model`)."""
        return check_model(self.spec(cfg.mask_token_id, cfg.eos_id, cfg.logit_shift), cfg)

    def spec(self, mask_id: int, eos_id: int, logit_shift: int = 0) -> DecodeSpec:
        """The static part (the compiled program's key), after `validate`. logit_shift: the model's
        (ModelConfig.logit_shift); `spec_for(cfg)` passes all three."""
        self.validate()
        steps_per_block = 0
        if self.cache == "block":  # LLaDA2.0: `steps` counts per block (its transfer schedule)
            steps_per_block = self.steps or 0
        elif self.strategy in SCHEDULED:
            nb = self.gen_length // self.block_length
            steps_per_block = (self.gen_length if self.steps is None else self.steps) // nb
        return DecodeSpec(
            gen_length=self.gen_length, block_length=self.block_length, strategy=self.strategy,
            steps_per_block=steps_per_block, cache=self.cache, refresh_every=self.refresh_every,
            prefix_look=self.prefix_look, after_look=self.after_look, warmup_steps=self.warmup_steps,
            smoothing=self.smoothing, early_stop=self.early_stop, start_block_align=self.start_block_align,
            mask_id=mask_id, eos_id=eos_id, editing=self.editing_threshold is not None or self.indel,
            max_post_steps=self.max_post_steps, indel=self.indel,
            alg=(self.alg or "origin") if self.strategy == DREAM else "", logit_shift=logit_shift,
            sub_block_length=self.sub_block_length, sub_block_cache=self.sub_block_cache,
            logprobs=-1 if self.logprobs is None else logprob_bucket(self.logprobs))


@dataclasses.dataclass
class GenerationResult:
    """Per prompt: generated ids (gen region, EOS padding removed), the raw gen region, counters.

    nfe: forwards this prompt took part in; tpf: generated non-EOS tokens / nfe.
    batch_nfe_full / batch_nfe_window: forwards the batch program actually ran, by kind;
    batch_nfe_partial: of the full ones, those that ran on a gathered subset of the rows.
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
    inserts: list[int] | None = None  # indel: SPLIT (insert) tokens written per prompt
    deletes: list[int] | None = None  # indel: DELETE tokens written per prompt
    # sub_block_cache: per prompt, how many of its forwards covered only a sub-block (read the block cache)
    sub_block_forwards: list[int] | None = None
    batch_nfe_partial: int = 0
    # Per prompt, aligned with token_ids (`row_record`): the row's iteration (0-based, its own step
    # counter) that committed each token (-1: never written by the decoder, e.g. an undecoded mask);
    # with SamplingParams.logprobs, each token's log-probability (NaN where never written) and its
    # top `logprobs` alternatives as (token id, log-probability) pairs, most probable first.
    commit_steps: list[list[int]] | None = None
    token_logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


def _prompt_rows(prompts, check_ids) -> list[np.ndarray]:
    """prompts (a flat id list = one prompt, a list of id lists, (L,) or (B, L) array) -> int32 rows."""
    if isinstance(prompts, (str, bytes)) or (isinstance(prompts, (list, tuple)) and prompts
                                             and isinstance(prompts[0], (str, bytes))):
        raise InvalidParam("prompt", "prompts must be token ids, got text (encode it with the model's "
                                     "tokenizer: dinfer_jax.tokenizer.load_tokenizer(folder).encode_prompt)")
    if hasattr(prompts, "shape"):  # one array: (L,) is one prompt, (B, L) a batch
        arr = np.asarray(prompts)
        prompts = [arr] if arr.ndim <= 1 else list(arr)
    elif not isinstance(prompts, (list, tuple)):
        raise InvalidParam("prompt", f"prompts must be a list of token-id lists or an array, got "
                                     f"{type(prompts).__name__}")
    elif len(prompts) and not isinstance(prompts[0], (list, tuple, np.ndarray)):  # a flat id list: one prompt
        prompts = [prompts]
    if not len(prompts):
        raise InvalidParam("prompt", "no prompts given")
    rows = []
    for i, p in enumerate(prompts):
        try:
            arr = np.asarray(p)
        except ValueError as e:  # ragged nesting
            raise InvalidParam("prompt", f"prompt {i} is not a flat sequence of token ids ({e})") from None
        if arr.size == 0:
            raise InvalidParam("prompt", f"prompt {i} is empty")
        if arr.ndim != 1:
            raise InvalidParam("prompt", f"each prompt must be a 1-D sequence of token ids, got shape {arr.shape} "
                                         f"(prompt {i})")
        try:
            rows.append(check_ids(arr))
        except ValueError as e:
            raise InvalidParam("prompt", f"prompt {i}: {e}") from None
    return rows


def _bucket_batch(b: int) -> int:
    return 1 << max(0, (b - 1).bit_length())


def _bucket_len(n: int) -> int:
    return max(PROMPT_BUCKET, -(-n // PROMPT_BUCKET) * PROMPT_BUCKET)


@dataclasses.dataclass(frozen=True)
class ProgramShape:
    """One generate program's canvas layout: `batch` rows (bucketed, a multiple of the data axis),
    prompts right-aligned before `gen_start`, canvas (batch, canvas_length)."""
    batch: int
    gen_start: int
    canvas_length: int


class Generator:
    """Compiled-program cache for one model. `compiles` counts traces (tests assert no recompiles)."""

    def __init__(self, model, prefix_cache_bytes: int = 0, max_programs: int = DEFAULT_MAX_PROGRAMS):
        """prefix_cache_bytes > 0: a prompt prefix cache of that many bytes for block-causal models'
        continuous batches (decoding/prefix_cache.py; the server sets it). max_programs: compiled
        programs kept (least recently used dropped first; program_cache.py says why)."""
        self.model = model
        self.compiles = 0
        self._warm: set = set()  # continuous-batch programs compiled ahead (warm_segment_programs)
        self._programs = ProgramCache(max_programs, on_evict=self._forget_warm)
        self._movers = ProgramCache(max_programs, on_evict=lambda key: self._movers_warm.discard(key))
        self._movers_warm: set = set()  # row movers compiled ahead (warm_move_program)
        self.set_prefix_cache(prefix_cache_bytes)

    def set_prefix_cache(self, nbytes: int):
        """A fresh prompt prefix cache of `nbytes` (0: off) for the continuous batches built after."""
        self.prefix_cache = PrefixCache(nbytes)

    @property
    def programs(self) -> ProgramCache:
        """The compiled decoding programs (LRU; `ProgramCache.resize`, `.evicted`)."""
        return self._programs

    @property
    def movers(self) -> ProgramCache:
        """The compiled row movers between continuous batches (LRU, a cache of their own)."""
        return self._movers

    def _forget_warm(self, key):
        """A dropped segment program is no longer warm (its prefix prefills neither)."""
        if key[0] == "segments":
            self._warm = {w for w in self._warm if w[:4] != key}

    def _program(self, spec: DecodeSpec, gen_start: int):
        def build():
            module = self.model.module
            if module.cfg.attention_mask == "block_causal":  # the attention block is the decoding block
                module = module.clone(attention_block=spec.block_length)

            def run(params, canvas, pad, plen, active, knobs, observer_id):
                self.compiles += 1  # runs at trace time only
                return generate_loop(module, params, spec, canvas, pad, plen, gen_start, active, knobs, observer_id,
                                     refresh_rows_for(canvas.shape[0], self.model.batch_shards(canvas.shape[0])))
            return jax.jit(run, donate_argnums=(1,))  # outputs keep the canvas sharding
        return self._programs.get((spec, gen_start), build)

    def segment_programs(self, spec: DecodeSpec, gen_start: int, batch: int):
        """Jitted (init, segment, merge) of the continuous-batching loop (decoding/segments.py)."""
        def build():
            from dinfer_jax.decoding.loop_state import merge_rows
            from dinfer_jax.decoding.segments import segment_program
            module = self.model.module
            if module.cfg.attention_mask == "block_causal":
                module = module.clone(attention_block=spec.block_length)
            init, segment = segment_program(module, spec, gen_start, gen_start + spec.gen_length + spec.tail_room,
                                            refresh_rows_for(batch, self.model.batch_shards(batch)))

            def counted(fn):
                def run(*a):
                    self.compiles += 1  # trace time only
                    return fn(*a)
                return run
            return (jax.jit(counted(init)), jax.jit(counted(segment), donate_argnums=(1,)),
                    jax.jit(merge_rows, donate_argnums=(0,)),
                    jax.jit(counted(init), static_argnums=(7,)))  # init over cached prompt K/V
        return self._programs.get(("segments", spec, gen_start, batch), build)

    @staticmethod
    def move_key(spec: DecodeSpec, gen_start: int, src_batch: int, dst_batch: int, fresh: bool) -> tuple:
        """The program cache key of a row mover (decoding/loop_state.move_rows) between continuous
        batches of these sizes (fresh: into an empty batch)."""
        return ("move", spec, gen_start, src_batch, dst_batch, fresh)

    def move_ready(self, key: tuple) -> bool:
        """Whether `warm_move_program` compiled the row mover under `key`."""
        return key in self._movers_warm and key in self._movers

    def move_program(self, key: tuple):
        """The jitted row mover under `key` (`move_key`; decoding/loop_state.move_rows). A call with
        shapes `warm_move_program` did not compile compiles there (library use); the server calls
        it only once ready. Kept in a cache of its own: these small programs never push out a
        decoding program."""
        from dinfer_jax.decoding.loop_state import move_rows
        return self._movers.get(key, lambda: jax.jit(move_rows))

    def warm_move_program(self, key: tuple, dst_abstract, src_abstract):
        """Compile the row mover under `key` for states of these shapes (segments.abstract_state; dst
        None: into an empty batch) ahead of its first call, without allocating any state (the
        jitted function's own lower().compile(): its calls then reuse the executable). Safe on a
        background thread."""
        dst_batch = key[4]
        sharded = self.model.mesh is not None
        row = lambda dt: jax.ShapeDtypeStruct(  # noqa: E731  (as place_batch puts them)
            (dst_batch,), dt, **({"sharding": self.model.batch_sharding((dst_batch,))} if sharded else {}))
        self.move_program(key).lower(dst_abstract, src_abstract, row(np.int32), row(np.bool_)).compile()
        self._movers_warm.add(key)

    def segment_programs_ready(self, spec: DecodeSpec, gen_start: int, batch: int, width: int | None = None) -> bool:
        """Whether `warm_segment_programs` compiled this continuous batch's programs (and the prefix
        prefill of `width`, when given)."""
        return ("segments", spec, gen_start, batch, width) in self._warm

    def warm_segment_programs(self, spec: DecodeSpec, gen_start: int, batch: int, widths=()):
        """Compile a continuous batch's programs by running them on a throwaway batch (one dummy row
        admitted, one iteration, a second row merged in), and the prefix-cache prefill of each width
        in `widths`. Safe on a background thread (the server's compile thread)."""
        from dinfer_jax.decoding.segments import RunningBatch
        base = ("segments", spec, gen_start, batch, None)
        tok = self.model.config.filler_id
        rb = RunningBatch(self, spec, gen_start, batch, use_prefix_cache=False)
        if base not in self._warm:
            knobs = SamplingParams()  # knobs only (check=False): the batch's spec is fixed
            rb.admit([(0, np.full((1,), tok, np.int32), knobs)], check=False)
            rb.step(1)
            rb.evict([0])  # a batch of one has no second free slot: the merge needs a running state
            rb.admit([(1, np.full((1,), tok, np.int32), knobs)], check=False)
            jax.block_until_ready(rb.state)
            self._warm.add(base)
        for w in widths:
            if ("segments", spec, gen_start, batch, w) not in self._warm:
                rb.compile_prefix_prefill(w)
                self._warm.add(("segments", spec, gen_start, batch, w))

    def running_batch(self, params: SamplingParams, batch: int, max_prompt_len: int, gen_length: int | None = None,
                      background=None):
        """An empty continuous batch (decoding/segments.RunningBatch) of `batch` slots for prompts of
        at most max_prompt_len tokens decoded with params' compiled settings (knobs may differ per
        row). gen_length: the program's generation region (default params.gen_length); rows of any
        gen_length up to it may join. background: RunningBatch's compile hook (the server's thread)."""
        from dinfer_jax.decoding.segments import RunningBatch
        return RunningBatch(self, *self.running_batch_key(params, batch, max_prompt_len, gen_length),
                            background=background)

    def running_batch_key(self, params: SamplingParams, batch: int, max_prompt_len: int,
                          gen_length: int | None = None) -> tuple:
        """(spec, gen_start, batch) of the batch `running_batch` would build (builds nothing):
        `segment_programs_ready(*key)` says whether its programs are compiled."""
        spec = params.spec_for(self.model.config)
        if gen_length is not None:
            spec = program_spec(spec, gen_length)
        return spec, _bucket_len(max_prompt_len + spec.head_room), batch

    def lower(self, prompts, params: SamplingParams, observe: bool = False):
        """The lowered program for these prompts (for inspection: HLO, while ops, callbacks)."""
        prog, args, *_ = self._prepare(prompts, params, observe)
        return prog.lower(*args)

    def _check_spec(self, spec: DecodeSpec):
        """InvalidParam when the model cannot run a program of this spec (`check_model`)."""
        check_model(spec, self.model.config)

    def program_shape(self, n_rows: int, max_prompt_len: int, spec: DecodeSpec) -> ProgramShape:
        """The canvas layout of the program for n_rows prompts of at most max_prompt_len tokens."""
        cfg = self.model.config
        if max_prompt_len + spec.gen_length > cfg.max_position_embeddings:
            raise InvalidParam("gen_length", f"prompt + gen_length = {max_prompt_len + spec.gen_length} exceeds "
                                             f"max_position_embeddings={cfg.max_position_embeddings}")
        dp = self.model.data_parallel
        batch = -(-_bucket_batch(n_rows) // dp) * dp  # rows split evenly over the mesh's data axis
        gen_start = _bucket_len(max_prompt_len + spec.head_room)
        return ProgramShape(batch, gen_start, gen_start + spec.gen_length + spec.tail_room)

    def program_args(self, shape: ProgramShape, constraint_classes: int = 0) -> tuple:
        """The generate program's arguments as ShapeDtypeStructs (with the model's shardings): params,
        canvas (B, Lc) int32, pad / plen (B,) int32, active (B,) bool, RowKnobs, observer id ().
        constraint_classes C > 0 (canvas templates): the knobs' allow_class (B, Lc) int32 and
        allowed (B, C, V) bool are set (decoding/constraint.py)."""
        m, B = self.model, shape.batch
        sd = jax.ShapeDtypeStruct
        row = lambda dt: sd((B,), dt, sharding=m.batch_sharding((B,)))
        knobs = RowKnobs.build(lambda k, dt: row(dt), ROW_KNOBS)
        if constraint_classes:
            V = m.config.vocab_size
            knobs = knobs.replace(
                allow_class=sd((B, shape.canvas_length), np.int32, sharding=m.batch_sharding((B, 1))),
                allowed=sd((B, constraint_classes, V), np.bool_, sharding=m.batch_sharding((B, 1, 1))))
        return (m.abstract_params(), sd((B, shape.canvas_length), np.int32, sharding=m.batch_sharding((B, 1))),
                row(np.int32), row(np.int32), row(np.bool_), knobs, sd((), np.int32, sharding=m.replicated()))

    def abstract_program(self, n_rows: int, prompt_len: int, params: SamplingParams, observe: bool = False,
                         constraint_classes: int = 0):
        """(jitted program, its ShapeDtypeStruct args, spec, ProgramShape) for n_rows prompts of
        prompt_len tokens: what `generate` would run, from shapes alone (lower / compile it anywhere).
        constraint_classes: a canvas-template program (DecodeSpec.constraint_classes)."""
        if n_rows <= 0 or prompt_len <= 0:
            raise InvalidParam("batch", f"batch={n_rows} and prompt_len={prompt_len} must be positive")
        spec = params.spec_for(self.model.config)
        self._check_spec(spec)
        if observe:
            spec = dataclasses.replace(spec, observe=True)
        if constraint_classes:
            spec = constrained_spec(spec, constraint_classes)
        shape = self.program_shape(n_rows, prompt_len, spec)
        return (self._program(spec, shape.gen_start), self.program_args(shape, spec.constraint_classes), spec,
                shape)

    def _prepare(self, prompts, params, observe: bool = False, observer_id: int = 0, templates=None):
        cfg = self.model.config
        rows = _prompt_rows(prompts, self.model.check_ids)
        for i, r in enumerate(rows):
            if (r == cfg.mask_token_id).any():
                raise InvalidParam("prompt", f"prompt contains the mask token id {cfg.mask_token_id} (prompt {i})")
        per_row = list(params) if isinstance(params, (list, tuple)) else [params] * len(rows)
        if len(per_row) != len(rows):
            raise InvalidParam("params", f"{len(per_row)} SamplingParams for {len(rows)} prompts "
                                         "(give one, or one per prompt)")
        bad = [type(p).__name__ for p in per_row if not isinstance(p, SamplingParams)]
        if bad:
            raise InvalidParam("params", f"params must be SamplingParams (or a list of them), got {bad[0]}")
        n_classes = 0
        if templates is not None:
            templates = self._check_templates(templates, len(rows))
            per_row = templated_params(per_row, templates)
            n_classes = template_classes(templates)
        spec = per_row[0].spec_for(cfg)
        for i, p in enumerate(per_row[1:], 1):
            other = p.spec_for(cfg)
            if other != spec:
                diff = [f.name for f in dataclasses.fields(spec) if getattr(spec, f.name) != getattr(other, f.name)]
                raise ValueError(f"prompts in one batch must share the compiled settings; prompt {i} differs in "
                                 f"{diff} (only {', '.join(KNOBS)} may differ per prompt)")
        prog, sds, spec, shape = self.abstract_program(len(rows), max(len(r) for r in rows), per_row[0], observe,
                                                       n_classes)
        B, gen_start = shape.batch, shape.gen_start
        canvas = np.full((B, shape.canvas_length), cfg.pad_id, np.int32)
        pad = np.full((B,), gen_start, np.int32)
        plen = np.zeros((B,), np.int32)
        for b, r in enumerate(rows):
            place_row(canvas, pad, plen, b, r, gen_start, spec.gen_length, cfg.mask_token_id)
        active = np.arange(B) < len(rows)
        knobs = RowKnobs.build(lambda k, dt: np.array([knob_value(per_row[min(b, len(rows) - 1)], k) for b in range(B)],
                                                      dt), ROW_KNOBS)
        if n_classes:
            knobs = knobs.replace(allow_class=np.zeros((B, shape.canvas_length), np.int32),
                                  allowed=np.ones((B, spec.constraint_classes, cfg.vocab_size), bool))
            G = spec.gen_length
            for b, t in enumerate(templates):
                canvas[b, gen_start:gen_start + G], knobs.allow_class[b, gen_start:gen_start + G] = \
                    template_region(t, G, cfg.mask_token_id, cfg.eos_id)
                if t is not None:
                    knobs.allowed[b] = t.allowed_table(cfg.vocab_size, cfg.mask_token_id, spec.constraint_classes)
        put = self.model.place
        host = (canvas, pad, plen, active, knobs, np.int32(observer_id))
        args = (self.model.params,) + jax.tree_util.tree_map(put, host, sds[1:])
        return prog, args, rows, spec, gen_start

    def _check_templates(self, templates, n: int) -> list:
        """One CanvasTemplate (or None) per prompt, its fixed ids and token sets inside the vocabulary."""
        cfg = self.model.config
        templates = list(templates)
        if len(templates) != n:
            raise InvalidParam("templates", f"{len(templates)} templates for {n} prompts (give one per prompt, "
                                            f"None for a prompt without one)")
        for i, t in enumerate(templates):
            if t is None:
                continue
            if not isinstance(t, CanvasTemplate):
                raise InvalidParam("templates", f"template {i} must be a CanvasTemplate or None, got "
                                                f"{type(t).__name__}")
            ids = [x for x in t.tokens if x >= 0] + [x for s in t.sets for x in s]
            bad = [x for x in ids if x >= cfg.vocab_size or x == cfg.mask_token_id]
            if bad:
                raise InvalidParam("templates", f"template {i} holds token id {bad[0]}: outside the vocabulary "
                                                f"({cfg.vocab_size}) or the mask id")
            if any(s == (cfg.mask_token_id,) for s in t.sets):
                raise InvalidParam("templates", f"template {i} has a position that allows only the mask id")
        if all(t is None for t in templates):
            raise InvalidParam("templates", "every template is None (pass templates=None instead)")
        return templates

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 observer=None, templates=None) -> GenerationResult:
        """Decode a batch. params: one SamplingParams for all prompts, or one per prompt (they must
        share the compiled settings; KNOBS such as threshold, temperature and seed may differ).
        observer: fn(step, gen_BG, blk_B, done_B, active_B) called on the host after every loop
        iteration (decoding/observe.py); it selects a program variant with one callback per step.
        templates: one canvas_template.CanvasTemplate (or None) per prompt: the generation region
        is laid out by it (gen_length: the longest template in whole blocks; no early stop) and a
        templated row's token_ids are the template's T ids, fixed ones included
        (structured.Constrained renders the answer from them)."""
        if params is None:  # the model's family / folder defaults (SamplingParams.for_model)
            params = SamplingParams.for_model(self.model.config, self.model.folder)
        oid = 0
        if observer is not None:
            from dinfer_jax.decoding import observe
            oid = observe.register(observer)
        try:
            prog, args, rows, spec, gen_start = self._prepare(prompts, params, observer is not None, oid, templates)
            per_row = list(params) if isinstance(params, (list, tuple)) else [params] * len(rows)
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
        if not stats.done[:n].all():  # only with non-finite logits (e.g. a bf16 overflow)
            warnings.warn(f"{int((~stats.done[:n]).sum())} of {n} prompts hit the iteration bound "
                          f"({spec.max_iterations}) before every block was decoded; their output keeps mask ids",
                          RuntimeWarning, stacklevel=2)
        raw = canvas[:n, gen_start:gen_start + spec.gen_length]
        cfg = self.model.config
        out, tpf = [], []
        for b in range(n):
            ids, t = row_output(raw[b], int(stats.row_nfe[b]), cfg, per_row[b].ignore_eos)
            if templates is not None and templates[b] is not None:
                ids = raw[b, :len(templates[b])].tolist()
            out.append(ids)
            tpf.append(t)
        ints = lambda a: None if a is None else [int(v) for v in a[:n]]  # noqa: E731
        edits, ins, dels, subf = ints(stats.edits), ints(stats.inserts), ints(stats.deletes), ints(stats.row_sub)
        recs = [row_record(stats.record, b, len(out[b]), per_row[b].logprobs) for b in range(n)]
        lp = [r[1] for r in recs] if per_row[0].logprobs is not None else None
        return GenerationResult(out, raw, ints(stats.row_nfe), tpf,
                                stats.steps_per_block[:n], int(stats.nfe_full), int(stats.nfe_window), secs,
                                edits, ins, dels, subf, int(0 if stats.nfe_partial is None else stats.nfe_partial),
                                [r[0] for r in recs], lp, [r[2] for r in recs] if lp is not None else None)


def templated_params(per_row: list, templates: list) -> list:
    """The rows' SamplingParams for a templated batch: gen_length the templates' region (the longest
    template in whole blocks, Dream's one-block convention kept), no early stop (EOS in one slot
    must not wipe later slots), steps None unless given."""
    p0 = per_row[0]
    glen = template_gen_length(templates, p0.block_length)
    whole = p0.block_length == p0.gen_length  # one block over the whole region (Dream): keep it so
    return [dataclasses.replace(p, gen_length=glen, early_stop=False,
                                block_length=glen if whole else p.block_length) for p in per_row]


def constrained_spec(spec: DecodeSpec, n_classes: int) -> DecodeSpec:
    """spec with canvas-template constraints of n_classes classes, or InvalidParam."""
    try:
        return dataclasses.replace(spec, constraint_classes=n_classes)
    except ValueError as e:
        raise InvalidParam("indel" if spec.indel else "templates", str(e)) from None


class FamilyWarning(UserWarning):
    """A setting that contradicts the model family (e.g. a full-canvas cache on a block-causal model)."""


_WARNED: set = set()


def family_conflict(cfg, p: SamplingParams) -> str | None:
    """What changes when p contradicts cfg's family, in one line; None when nothing does."""
    if cfg.attention_mask == "block_causal" and p.cache != "block":
        return (f"cache={p.cache!r} on a block-causal {cfg.family} model: it is decoded with dInfer's full-canvas "
                f"loop (forwards over the whole canvas, dInfer's transfer rule"
                f"{', approximate cached K/V' if p.cache != 'none' else ''}, no token editing), not with block "
                f"diffusion (cache='block': block by block, exact prefix cache, its authors' sampler); its tokens "
                f"differ from its authors' generate()")
    return None


def _warn_family_conflict(cfg, p: SamplingParams):
    msg = family_conflict(cfg, p)
    if msg is not None and (cfg.family, msg) not in _WARNED:
        _WARNED.add((cfg.family, msg))
        warnings.warn(msg, FamilyWarning, stacklevel=3)


def generate(model, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None,
             observer=None, templates=None) -> GenerationResult:
    """Decode prompts with the model's compiled-program cache (`model.generator`); see
    `Generator.generate` for per-prompt params, the observer and canvas templates."""
    return model.generator.generate(prompts, params, observer=observer, templates=templates)
