"""The decoding options in one place: the strategy / cache / sampler names, `SETTINGS` (each
SamplingParams field's type, range, help, and whether the CLI and the server expose it: the flags
and the request model are generated from it), `RULES` (the one table of rules between fields, each
naming the user-facing field it blames), the model rules, and `DecodeSpec` (the static key of a
compiled program) with the helpers that place rows of one spec in a program.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable

import flax.struct
import numpy as np

# ---- names

FIXED = ("fixed", "random")
THRESHOLD_FAMILY = ("threshold", "factor", "credit", "hierarchy")
DREAM = "dream"  # Dream-7B's diffusion_generate sampler; its rule is DecodeSpec.alg (DREAM_ALGS)
# Block diffusion only (cache="block"; decoding/block_loop.py, SDAR's remasking strategies): the
# leftmost n masks per step, or masks by increasing entropy under a cumulative-entropy bound.
BLOCK_ONLY = ("sequential", "entropy_bounded")
BLOCK_STRATEGIES = ("threshold",) + BLOCK_ONLY  # what cache="block" decodes with
STRATEGIES = FIXED + THRESHOLD_FAMILY + (DREAM,) + BLOCK_ONLY
SCHEDULED = FIXED + (DREAM,)  # strategies with a fixed number of steps per block (steps_per_block)
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
CACHES = ("none", "prefix", "dual", "vicinity", "block")  # "block": block diffusion (decoding/block_loop.py)
LOGPROB_BUCKETS = (0, 5, 20)  # DecodeSpec.logprobs values: top-N alternatives recorded (a request's N rounds up)

# Bounds that keep the loop's arithmetic finite in fp32 / bf16 (docs/decoding_bounds.md): a knob
# travels as an fp32 per-row value (integers exact below 2**24); logits / T and T * Gumbel noise stay
# below 1e7 for |logits| <= 1e4 when T is 0 or in [MIN_TEMPERATURE, MAX_TEMPERATURE].
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
KNOB_INT_MAX = 2**24  # largest integer an fp32 knob holds exactly
MAX_LOGPROBS = max(LOGPROB_BUCKETS)  # top alternatives a request may ask (OpenAI's limit, 20)
LARGE = 1e6  # bound of the unbounded-above float knobs (their rules saturate far below it)
EB_THRESHOLD = 0.35  # SDAR generate.py's --eb_threshold default

# LLaDA2.1's published decoding presets (HF model card / diffusers docs; docs/facts): block 32,
# temperature 0; "quality" (Q mode) and "speed" (S mode). Use with cache="block".
EDIT_MODES = {
    "quality": dict(threshold=0.7, editing_threshold=0.5, max_post_steps=16),
    "speed": dict(threshold=0.5, editing_threshold=0.0, max_post_steps=16),
}


class InvalidParam(ValueError):
    """A bad decoding setting or prompt; `.field` names it (the CLI maps it to a flag, the server
    answers 400 with it as `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# ---- the field table

INT, FLOAT, BOOL, CHOICE = "int", "float", "bool", "choice"
GENERAL, DREAM_GROUP, BLOCK_GROUP = "", "dream", "block"
GROUP_NOTES = {GENERAL: "", DREAM_GROUP: " (Dream's sampler)", BLOCK_GROUP: " (block diffusion)"}
GROUP_TITLES = {DREAM_GROUP: "Dream's sampler (--strategy dream; Dream-7B / DiffuCoder)",
                BLOCK_GROUP: "block diffusion (--cache block; LLaDA2.x); --top-k / --top-p also for --strategy dream"}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One SamplingParams field: its kind and range (checked at construction), whether None is
    allowed, and where a user sets it: `cli` (a --flag; a bool flag sets the opposite of the
    default: --smoothing, --no-early-stop), `server` (a request body field), with `help`."""
    kind: str
    low: float | None = None
    low_in: bool = True
    high: float | None = None
    high_in: bool = True
    choices: tuple = ()
    nullable: bool = False
    cli: bool = True
    cli_sets: bool = True  # a bool field: the value its flag sets (False: the flag is --no-<name>)
    server: bool = True
    group: str = GENERAL
    help: str = ""

    def range_text(self) -> str:
        lo, hi = self.low, self.high
        if hi is None:
            return f"{'>=' if self.low_in else '>'} {lo}"
        if lo == 0 and hi == 2**32:
            return "in [0, 2**32)"
        num = lambda x: f"{x:g}" if isinstance(x, float) and abs(x) >= 1e5 else f"{x}"  # noqa: E731
        return f"in {'[' if self.low_in else '('}{num(lo)}, {num(hi)}{']' if self.high_in else ')'}"


def _int(lo, hi=KNOB_INT_MAX, **kw):
    return Setting(INT, lo, True, hi, hi is not None, **kw)


def _float(lo, hi, lo_in=True, hi_in=True, **kw):
    return Setting(FLOAT, lo, lo_in, hi, hi_in, **kw)


def _bool(**kw):
    return Setting(BOOL, **kw)


_B = dict(group=BLOCK_GROUP)
_D = dict(group=DREAM_GROUP)
SETTINGS: dict[str, Setting] = {
    "gen_length": _int(1, server=False, help="tokens to generate (default: the model's, else 128)"),
    "block_length": _int(1, help="block size (default: the model's: LLaDA2 / SDAR / Fast-dLLM v2 their attention "
                                 "block, else 64; at most gen-length)"),
    "strategy": Setting(CHOICE, choices=STRATEGIES,
                        help="which masked tokens to decode each step (default: the model's: threshold; Dream: "
                             "dream; sequential / entropy_bounded: SDAR's, with --cache block)"),
    "steps": _int(1, nullable=True, help="fixed/random: total steps (default gen-length); --cache block: steps per "
                                         "block (LLaDA2.0's schedule; LLaDA2 default 32, SDAR 4)"),
    "cache": Setting(CHOICE, choices=CACHES, help="KV cache policy (default: the model's: dual; Dream none; LLaDA2 / "
                                                  "SDAR / Fast-dLLM v2 block)"),
    "refresh_every": _int(0, None, cli=False, server=False),
    "prefix_look": _int(0, None, cli=False, server=False),
    "after_look": _int(0, None, cli=False, server=False),
    "warmup_steps": _int(0, None, cli=False, server=False),
    "smoothing": _bool(help="iteration smoothing (soft mask embeddings)"),
    "early_stop": _bool(server=False, cli_sets=False, help="keep decoding blocks after EOS"),
    "start_block_align": _bool(cli=False, server=False),
    "threshold": _float(0.0, 1.0, lo_in=False, help="threshold strategies: confidence tau (default: the --edit-mode "
                                                    "preset's, else the model's: 0.9; LLaDA2 0.95, SDAR 0.85)"),
    "low_threshold": _float(0.0, 1.0, lo_in=False, help="hierarchy: per-run threshold (default 0.4)"),
    "factor": _float(0.0, LARGE, lo_in=False, help="factor strategy's f (default 1.0)"),
    "temperature": _float(0.0, MAX_TEMPERATURE, help="0 = greedy; > 0 samples (Gumbel-max) (default: the model's, 0)"),
    "seed": Setting(INT, 0, True, 2**32, False, help="sampling seed (default 0)"),
    "cont_weight": _float(0.0, 1.0, cli=False, server=False),
    "credit_alpha": _float(0.0, LARGE, cli=False, server=False),
    "credit_gamma": _float(0.0, LARGE, cli=False, server=False),
    "credit_beta": _float(0.0, 1.0, cli=False, server=False),
    "ignore_eos": _bool(help="decode all gen-length tokens: the EOS logit is -inf, so EOS is never chosen"),
    "min_tokens": _int(0, help="EOS is forbidden in the first N generated tokens"),
    "alg": Setting(CHOICE, choices=DREAM_ALGS, nullable=True, **_D,
                   help="origin | maskgit_plus | topk_margin | entropy (default: the model's, else origin)"),
    "alg_temp": _float(0.0, MAX_TEMPERATURE, **_D,
                       help="> 0: draw the positions to decode from softmax(confidence / alg-temp) (default 0)"),
    "eps": _float(0.0, 1.0, hi_in=False, **_D, help="schedule t = linspace(1, eps, steps + 1) (default 1e-3)"),
    "editing_threshold": _float(0.0, 1.0, nullable=True, **_B,
                                help="LLaDA2.1 token-to-token edits above this probability (default: the folder's "
                                     "generation_config.json, else no editing)"),
    "max_post_steps": _int(0, 1024, **_B, help="edit forwards per block after its masks are gone (16)"),
    "num_to_transfer": _int(1, **_B, help="masks committed per step at least (1)"),
    "sub_block_length": _int(0, None, **_B, help="Fast-dLLM v2: decode each block in sub-blocks of this many "
                                                 "positions, left to right (0: off)"),
    "sub_block_cache": _bool(**_B, help="Fast-dLLM v2's sub-block DualCache (use_block_cache=True; needs "
                                        "--sub-block-length): whole-block forwards only when a sub-block is entered, "
                                        "sub-block forwards over a block cache (stale K/V: approximate) otherwise"),
    "top_k": _int(0, **_B, help="with --temperature > 0: keep the k most probable tokens"),
    "top_p": _float(0.0, 1.0, lo_in=False, **_B, help="with --temperature > 0: nucleus sampling"),
    "indel": _bool(**_B, help="LLaDA2.2 insert/delete editing (SGLang JointThresholdInDel; greedy; SGLang's "
                              "defaults: --edit-mode speed)"),
    "eb_threshold": _float(0.0, LARGE, lo_in=False, **_B,
                           help="--strategy entropy_bounded: commit masks by increasing entropy while their summed "
                                "entropy (nats) stays below this (SDAR's eb_threshold; default 0.35)"),
    "confidence_before_filter": _bool(**_B, help="with --temperature > 0: a token's confidence is its probability "
                                                 "under the tempered softmax before --top-k/--top-p (SDAR's "
                                                 "evaluation sampler); default: after"),
    # the server takes OpenAI's own logprobs / top_logprobs fields for it
    "logprobs": _int(0, MAX_LOGPROBS, nullable=True, cli=False, server=False),
}


def flag_name(name: str) -> str:
    """The command-line flag of a SamplingParams field: --gen-length; a bool that the flag turns
    off: --no-early-stop."""
    s = SETTINGS.get(name)
    off = s is not None and s.kind == BOOL and not s.cli_sets
    return f"--{'no-' if off else ''}{name.replace('_', '-')}"


def check_field(name: str, v):
    """The value of one field, normalised (python int / float / bool / str), or InvalidParam."""
    s = SETTINGS[name]
    if v is None and s.nullable:
        return None
    if s.kind == CHOICE:
        if not isinstance(v, str) or v not in s.choices:
            raise InvalidParam(name, f"{name}={v!r} is not one of {s.choices}{GROUP_NOTES[s.group]}")
        return v
    if s.kind == BOOL:
        if not isinstance(v, (bool, np.bool_)):
            raise InvalidParam(name, f"{name}={v!r} must be true or false")
        return bool(v)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or (
            s.kind == INT and not isinstance(v, numbers.Integral)):
        what = "an integer" if s.kind == INT else "a number"
        raise InvalidParam(name, f"{name}={v!r} must be {what} {s.range_text()}")
    v = int(v) if s.kind == INT else float(v)
    ok = math.isfinite(v) and (v >= s.low if s.low_in else v > s.low) and (
        s.high is None or (v <= s.high if s.high_in else v < s.high))
    if not ok:
        raise InvalidParam(name, f"{name}={v!r} must be {s.range_text()}")
    if name in ("temperature", "alg_temp") and 0 < v < MIN_TEMPERATURE:
        raise InvalidParam(name, f"{name}={v!r} must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]: "
                                 f"a smaller one overflows logits / {name} in fp32")
    return v


# ---- the rules between fields

@dataclasses.dataclass(frozen=True)
class Rule:
    """A rule between fields: `broken(p)` on a SamplingParams p means InvalidParam(field, message(p))."""
    field: str
    broken: Callable[[Any], bool]
    message: Callable[[Any], str]


def _schedule_steps(p) -> int:
    return p.gen_length if p.steps is None else p.steps


def _off(p, name, off) -> bool:
    return getattr(p, name) != off


_BLOCK_ONLY_TEXT = "applies to block diffusion only (cache='block'; LLaDA2's decoder)"
RULES: tuple[Rule, ...] = (
    Rule("gen_length", lambda p: p.gen_length % p.block_length,
         lambda p: f"gen_length={p.gen_length} must be a positive multiple of block_length={p.block_length}"),
    Rule("steps", lambda p: p.strategy in SCHEDULED and _schedule_steps(p) % (p.gen_length // p.block_length),
         lambda p: f"steps={_schedule_steps(p)} must be a positive multiple of the number of blocks "
                   f"({p.gen_length // p.block_length})"),
    Rule("min_tokens", lambda p: p.min_tokens > p.gen_length,
         lambda p: f"min_tokens={p.min_tokens} exceeds gen_length={p.gen_length}"),
    Rule("smoothing", lambda p: p.smoothing and p.cache == "prefix",
         lambda p: "iteration smoothing with the prefix cache is not supported (use none, dual or vicinity)"),
    Rule("eb_threshold", lambda p: p.eb_threshold != EB_THRESHOLD and p.strategy != "entropy_bounded",
         lambda p: f"eb_threshold={p.eb_threshold} applies to strategy 'entropy_bounded' only, not strategy "
                   f"{p.strategy!r}"),
    # block diffusion (cache "block")
    Rule("strategy", lambda p: p.cache == "block" and p.strategy not in BLOCK_STRATEGIES,
         lambda p: f"cache='block' (block diffusion) decodes with strategy 'threshold' (LLaDA2's rule), 'sequential' "
                   f"or 'entropy_bounded' (SDAR's), not {p.strategy!r}"),
    *(Rule(name, lambda p, n=name, o=off: p.cache == "block" and p.strategy in BLOCK_ONLY and _off(p, n, o),
           lambda p, n=name: f"{n}={getattr(p, n)!r} does not combine with strategy {p.strategy!r} (SDAR's "
                             f"remasking has no token editing or sub-blocks)")
      for name, off in (("editing_threshold", None), ("indel", False), ("sub_block_length", 0))),
    *(Rule(name, lambda p, n=name: p.cache == "block" and bool(getattr(p, n)),
           lambda p, n=name: f"cache='block' takes no {n}")
      for name in ("smoothing", "start_block_align", "refresh_every")),
    Rule("steps", lambda p: p.cache == "block" and p.steps is not None and p.editing_threshold is not None,
         lambda p: "steps (LLaDA2.0's per-block transfer schedule) does not combine with editing (LLaDA2.1 has no "
                   "schedule; use num_to_transfer)"),
    Rule("steps", lambda p: p.cache == "block" and p.indel and p.steps is not None,
         lambda p: "steps (LLaDA2.0's per-block transfer schedule) does not combine with indel (SGLang's rule "
                   "transfers 1 + #inserted masks; use num_to_transfer)"),
    Rule("sub_block_length", lambda p: p.cache == "block" and p.sub_block_length and
         p.block_length % p.sub_block_length,
         lambda p: f"sub_block_length={p.sub_block_length} must divide block_length={p.block_length}"),
    *(Rule(name, lambda p, n=name, o=off: p.cache == "block" and p.sub_block_length and _off(p, n, o),
           lambda p, n=name: f"{n}={getattr(p, n)!r} does not combine with sub_block_length (Fast-dLLM v2's "
                             f"sub-block threshold rule)")
      for name, off in (("steps", None), ("editing_threshold", None), ("indel", False))),
    Rule("sub_block_cache", lambda p: p.cache == "block" and not p.sub_block_length and p.sub_block_cache,
         lambda p: "sub_block_cache (Fast-dLLM v2's sub-block DualCache) needs sub_block_length > 0: the sub-blocks "
                   "whose forwards it shortens"),
    Rule("logprobs", lambda p: p.cache == "block" and p.indel and p.logprobs is not None,
         lambda p: "logprobs does not combine with indel (LLaDA2.2 insert/delete editing moves tokens between slots "
                   "after they are committed)"),
    Rule("temperature", lambda p: p.cache == "block" and p.indel and p.temperature > 0,
         lambda p: f"indel (LLaDA2.2 insert/delete editing) decodes greedily (SGLang's JointThresholdInDel): "
                   f"temperature must be 0, not {p.temperature}"),
    # the full-canvas caches
    Rule("strategy", lambda p: p.cache != "block" and p.strategy in BLOCK_ONLY,
         lambda p: f"strategy {p.strategy!r} (SDAR's remasking) applies to block diffusion only (cache='block'), "
                   f"not cache={p.cache!r}"),
    Rule("sub_block_length", lambda p: p.cache != "block" and p.sub_block_length,
         lambda p: f"sub_block_length={p.sub_block_length} applies to block diffusion only (cache='block'), not "
                   f"cache={p.cache!r}"),
    Rule("sub_block_cache", lambda p: p.cache != "block" and p.sub_block_cache,
         lambda p: f"sub_block_cache (Fast-dLLM v2's sub-block DualCache) applies to block diffusion with "
                   f"sub_block_length (cache='block'), not cache={p.cache!r}"),
    Rule("indel", lambda p: p.cache != "block" and p.indel,
         lambda p: f"indel (LLaDA2.2 insert/delete editing) applies to block diffusion only (cache='block'), not "
                   f"cache={p.cache!r}"),
    *(Rule(name, lambda p, n=name, o=off: p.cache != "block" and _off(p, n, o),
           lambda p, n=name: f"{n}={getattr(p, n)} {_BLOCK_ONLY_TEXT}, not cache={p.cache!r}")
      for name, off in (("editing_threshold", None), ("num_to_transfer", 1), ("confidence_before_filter", False))),
    *(Rule(name, lambda p, n=name, o=off: p.cache != "block" and p.strategy != DREAM and _off(p, n, o),
           lambda p, n=name: f"{n}={getattr(p, n)} {_BLOCK_ONLY_TEXT} or strategy 'dream', not cache={p.cache!r}")
      for name, off in (("top_k", 0), ("top_p", 1.0))),
    # Dream's sampler
    *(Rule(name, lambda p, n=name, o=off: p.strategy != DREAM and _off(p, n, o),
           lambda p, n=name: f"{n}={getattr(p, n)!r} applies to strategy 'dream' (Dream's sampler) only, not "
                             f"strategy {p.strategy!r}")
      for name, off in (("alg", None), ("alg_temp", 0.0), ("eps", 1e-3))),
)


def check_rules(p):
    """InvalidParam for the first rule of RULES that p (a SamplingParams) breaks."""
    for rule in RULES:
        if rule.broken(p):
            raise InvalidParam(rule.field, rule.message(p))


# ---- the compiled program's key

@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Everything static about one compiled generation program (part of the jit cache key). Built
    by SamplingParams.spec (the user-facing rules are RULES); `__post_init__` checks only what the
    loops need to be well defined."""
    gen_length: int
    block_length: int
    strategy: str = "threshold"
    steps_per_block: int = 0  # fixed/random strategies; cache="block": LLaDA2.0 steps per block (0: off)
    cache: str = "none"
    refresh_every: int = 0  # extra full refresh every N steps inside a block (0: only on block entry)
    prefix_look: int = 16
    after_look: int = 16
    warmup_steps: int = 4
    smoothing: bool = False  # iteration smoothing (soft mask embeddings + threshold ramp)
    early_stop: bool = True
    start_block_align: bool = False
    mask_id: int = 0
    eos_id: int = 0
    observe: bool = False  # host callback after every iteration (streaming, live canvas); off = no host syncs
    editing: bool = False  # block mode: LLaDA2.1 token-to-token edits (post-fill forwards)
    max_post_steps: int = 16  # block mode with editing: post-fill forwards per block at most
    indel: bool = False  # block mode: LLaDA2.2 insert/delete editing (block_strategies.indel_step; implies editing)
    alg: str = ""  # strategy "dream": Dream's rule, one of DREAM_ALGS
    logit_shift: int = 0  # the model's ModelConfig.logit_shift (docs/internals/decoding_loops.md)
    sub_block_length: int = 0  # cache="block": sub-blocks decoded left to right (block_loop.py; 0: off)
    sub_block_cache: bool = False  # with sub_block_length: the sub-block DualCache (block_loop.py)
    # Per-token log-probabilities (`commit_record`): -1 off; N >= 0 records each committed token's
    # logprob and the top N alternatives (N one of LOGPROB_BUCKETS, so programs stay few).
    logprobs: int = -1
    # Canvas templates (decoding/constraint.py): C > 0 adds per-position token sets of C classes
    # (knobs allow_class / allowed); 0: unconstrained.
    constraint_classes: int = 0

    def __post_init__(self):
        problems = []
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy={self.strategy!r} is not one of {STRATEGIES}")
        if self.cache not in CACHES:
            problems.append(f"cache={self.cache!r} is not one of {CACHES}")
        if self.gen_length <= 0 or self.block_length <= 0:
            problems.append("gen_length and block_length must be > 0")
        elif self.gen_length % self.block_length:
            problems.append(f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}")
        if (self.strategy == DREAM) != (self.alg in DREAM_ALGS):
            problems.append(f"strategy {self.strategy!r} with alg={self.alg!r}: strategy 'dream' needs alg in "
                            f"{DREAM_ALGS}, the others none")
        if self.logit_shift not in (0, 1):
            problems.append(f"logit_shift={self.logit_shift} must be 0 or 1")
        if self.strategy in SCHEDULED and self.steps_per_block <= 0:
            problems.append(f"strategy {self.strategy!r} needs steps_per_block > 0")
        if min(self.prefix_look, self.after_look, self.warmup_steps, self.refresh_every, self.max_post_steps,
               self.sub_block_length) < 0:
            problems.append("prefix_look, after_look, warmup_steps, refresh_every, max_post_steps and "
                            "sub_block_length must be >= 0")
        # which loop runs it: the block loop takes the block strategies and the block-only options
        if self.cache == "block" and self.strategy not in BLOCK_STRATEGIES:
            problems.append(f"strategy {self.strategy!r} has no block-diffusion loop (cache='block')")
        elif self.cache == "block" and self.strategy in BLOCK_ONLY and (self.editing or self.sub_block_length):
            problems.append(f"strategy {self.strategy!r} does not combine with editing or sub_block_length")
        if self.cache != "block" and self.strategy in BLOCK_ONLY:
            problems.append(f"strategy {self.strategy!r} needs cache='block' (block diffusion)")
        elif self.cache != "block" and (self.sub_block_length or self.sub_block_cache or self.editing or self.indel):
            problems.append("sub-blocks and token editing (sub_block_length, sub_block_cache, editing_threshold, "
                            "indel) need cache='block' (block diffusion)")
        if self.sub_block_cache and not self.sub_block_length:
            problems.append("sub_block_cache needs sub_block_length > 0 (the sub-blocks it caches)")
        if self.sub_block_length and self.block_length % self.sub_block_length:
            problems.append(f"sub_block_length={self.sub_block_length} must divide block_length={self.block_length}")
        if self.logprobs != -1 and self.logprobs not in LOGPROB_BUCKETS:
            problems.append(f"logprobs={self.logprobs} must be -1 (off) or one of {LOGPROB_BUCKETS}")
        if self.constraint_classes < 0 or self.constraint_classes == 1:
            problems.append(f"constraint_classes={self.constraint_classes} must be 0 (off) or >= 2")
        elif self.constraint_classes and self.indel:
            problems.append("a canvas template (infill, structured output) does not combine with indel "
                            "(insert/delete editing moves tokens across the template's fixed positions)")
        if self.indel and self.logprobs != -1:
            problems.append("logprobs does not combine with indel (insert/delete editing moves tokens between "
                            "slots after their logprob was recorded)")
        if problems:
            raise ValueError("invalid decoding settings: " + "; ".join(problems))

    @property
    def num_blocks(self) -> int:
        """Blocks per row (one more when aligned blocks may start inside the prompt)."""
        aligned = self.start_block_align or self.cache == "block"
        return self.gen_length // self.block_length + (1 if aligned else 0)

    @property
    def head_room(self) -> int:
        """Pads needed before the earliest block start (vicinity windows reach back prefix_look;
        shifted logits read the row before a block)."""
        return (self.prefix_look if self.cache == "vicinity" else 0) + self.logit_shift

    @property
    def tail_room(self) -> int:
        """Pads needed after the generation region (aligned last block, vicinity after_look)."""
        return (self.block_length if self.start_block_align or self.cache == "block" else 0) + (
            self.after_look if self.cache == "vicinity" else 0)

    @property
    def iterations_per_block(self) -> int:
        """The loop iterations one block may take at most."""
        per_block = self.steps_per_block if self.strategy in SCHEDULED else self.block_length
        if self.cache == "block":  # + post-fill forwards; + B for steps that commit the mask id itself
            per_block = 2 * self.block_length + (self.max_post_steps + 1 if self.editing else 0)
            if self.indel:  # SGLang's max_steps (B + max_post_edit_steps + 2) bounds an indel block
                per_block = self.block_length + self.max_post_steps + 2
        return per_block

    @property
    def max_iterations(self) -> int:
        return self.num_blocks * self.iterations_per_block

    def row_max_iterations(self, gen_length_B):
        """Per-row iteration bound (B,) for rows of generation length gen_length_B (<= gen_length,
        multiples of the block): what the program of that gen_length alone would allow, so a row in
        a longer program stops where it would alone."""
        aligned = self.start_block_align or self.cache == "block"
        blocks = gen_length_B.clip(max=self.gen_length) // self.block_length + (1 if aligned else 0)
        return blocks.astype("int32") * self.iterations_per_block


def check_model(spec: DecodeSpec, cfg) -> DecodeSpec:
    """spec, or InvalidParam when the model (a ModelConfig) cannot decode it: block diffusion needs
    block-causal attention; smoothing unshifted logits; indel the model's DELETE / SPLIT token ids."""
    if spec.cache == "block" and cfg.attention_mask != "block_causal":
        raise InvalidParam("cache", f"cache='block' (block diffusion) needs a block-causal model; this "
                                    f"{cfg.family} model has {cfg.attention_mask} attention (use none, prefix, "
                                    f"dual or vicinity)")
    if spec.smoothing and spec.logit_shift:
        raise InvalidParam("smoothing", f"iteration smoothing is not supported for a model with shifted logits "
                                        f"(this {cfg.family} model predicts position i + 1 at i)")
    if spec.indel and not {"delete_token_id", "split_token_id"} <= dict(cfg.extra_token_ids).keys():
        raise InvalidParam("indel", f"indel (LLaDA2.2 insert/delete editing) needs a model whose config declares "
                                    f"delete_token_id and split_token_id; this {cfg.family} model declares "
                                    f"{dict(cfg.extra_token_ids) or 'none'}")
    return spec


def logprob_bucket(n: int) -> int:
    """The DecodeSpec.logprobs that serves a request for the top n (0 <= n <= 20) alternatives."""
    return next(b for b in LOGPROB_BUCKETS if b >= n)


KNOBS = ("threshold", "low_threshold", "factor", "temperature", "cont_weight", "credit_alpha", "credit_gamma",
         "credit_beta", "seed", "editing_threshold", "num_to_transfer", "top_k", "top_p", "ignore_eos", "min_tokens",
         "alg_temp", "eps", "confidence_before_filter", "eb_threshold")
# Per-row arrays the loop reads: the knobs, plus the row's own generation length (<= spec.gen_length,
# a multiple of the block; continuous batches mix lengths in one program, generate() does not).
ROW_KNOBS = KNOBS + ("gen_length",)


@flax.struct.dataclass
class RowKnobs:
    """The loop's per-row values, one program for all: each KNOBS field (B,) (seed uint32, the rest
    float32); gen_length (B,) each row's region (None: the program's); allow_class (B, Lc) int32 and
    allowed (B, C, V) bool for canvas templates (None: unconstrained). numpy on the host, jax in the loop."""
    threshold: Any
    low_threshold: Any
    factor: Any
    temperature: Any
    cont_weight: Any
    credit_alpha: Any
    credit_gamma: Any
    credit_beta: Any
    seed: Any
    editing_threshold: Any
    num_to_transfer: Any
    top_k: Any
    top_p: Any
    ignore_eos: Any
    min_tokens: Any
    alg_temp: Any
    eps: Any
    confidence_before_filter: Any
    eb_threshold: Any
    gen_length: Any = None
    allow_class: Any = None
    allowed: Any = None

    @classmethod
    def build(cls, value: Callable[[str, Any], Any], names=KNOBS, **extra) -> "RowKnobs":
        """value(name, dtype) for each of `names` (KNOBS, or ROW_KNOBS with gen_length), dtype the
        knob's (uint32 for seed, float32 otherwise), plus `extra` fields."""
        return cls(**{k: value(k, np.uint32 if k == "seed" else np.float32) for k in names}, **extra)


assert tuple(f.name for f in dataclasses.fields(RowKnobs))[:len(ROW_KNOBS)] == ROW_KNOBS


# ---- rows of one spec in a program of a longer region (continuous batching)

def joins_program(spec: DecodeSpec, gen_length: int) -> bool:
    """Whether a row decoded with `spec` can run in a program whose generation region is
    `gen_length`: its own region fits, in whole blocks of its block length."""
    return spec.gen_length <= gen_length and gen_length % spec.block_length == 0


def program_spec(spec: DecodeSpec, gen_length: int) -> DecodeSpec:
    """spec with the program's generation region `gen_length` (>= the row's own, whole blocks:
    `joins_program`): continuous batches decode rows of different lengths in one program (each row
    stops at its own length)."""
    if not joins_program(spec, gen_length):
        raise ValueError(f"a program region of {gen_length} cannot hold rows of "
                         f"{spec.gen_length} in blocks of {spec.block_length}")
    return dataclasses.replace(spec, gen_length=gen_length)


def same_program(spec: DecodeSpec, program: DecodeSpec) -> bool:
    """Whether a row decoded with `spec` can join a batch compiled for `program`."""
    return joins_program(spec, program.gen_length) and program_spec(spec, program.gen_length) == program


def bucket_gen_length(spec: DecodeSpec) -> int:
    """The program gen length a row of spec.gen_length joins: blocks rounded up to a power of two."""
    return spec.block_length * (1 << max(0, (spec.gen_length // spec.block_length - 1).bit_length()))
