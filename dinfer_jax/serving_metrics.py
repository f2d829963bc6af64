"""Request-level serving metrics: Prometheus histograms and counters (`dinfer:` prefix) over answered
requests (`observe_request`) and scheduled batches (`observe_batch`); `lines()` gives text exposition
format 0.0.4. Thread safe. Names and meanings: docs/metrics.md.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from typing import Optional, Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPF_BUCKETS = (0.5, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
NFE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
OCCUPANCY_BUCKETS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)


def _fmt(v: float) -> str:
    return "+Inf" if v == math.inf else f"{float(v):g}"


@dataclasses.dataclass
class Histogram:
    """A cumulative-bucket Prometheus histogram: counts[i] observations <= buckets[i] (non
    cumulative here, summed when printed), the last count for +Inf."""
    name: str
    help: str
    buckets: tuple
    counts: list = dataclasses.field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        if list(self.buckets) != sorted(self.buckets):
            raise ValueError(f"{self.name}: buckets must increase")
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float):
        v = float(v)
        if not math.isfinite(v):
            return
        i = next((k for k, b in enumerate(self.buckets) if v <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += v
        self.n += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = 0
        for b, c in zip(tuple(self.buckets) + (math.inf,), self.counts):
            cum += c
            out.append(f'{self.name}_bucket{{le="{_fmt(b)}"}} {cum}')
        out += [f"{self.name}_sum {self.total!r}", f"{self.name}_count {self.n}"]
        return out


@dataclasses.dataclass
class RequestObservation:
    """One answered request (times in seconds from its arrival)."""
    queue_s: float  # arrival -> admitted into a batch / segment
    first_token_s: Optional[float]  # arrival -> first committed text sent (None: no token)
    e2e_s: float  # arrival -> answer
    nfe: int  # forwards the row took part in
    tpf: float  # generated tokens / nfe
    blocks: int  # blocks the row decoded
    blocks_at_cap: int  # of those, blocks that used every iteration their bound allows
    edits: int = 0  # token-to-token edits (block diffusion with editing)
    inserts: int = 0  # indel SPLIT tokens
    deletes: int = 0  # indel DELETE tokens


class ServingMetrics:
    """Histograms and counters over answered requests and scheduled batches (module doc)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.queue = Histogram("dinfer:request_queue_time_seconds",
                               "time from arrival until the request's rows were admitted into a batch / segment",
                               LATENCY_BUCKETS)
        self.first_token = Histogram("dinfer:time_to_first_token_seconds",
                                     "time from arrival until the first committed token was sent (streaming: the "
                                     "first chunk; otherwise the answer)", LATENCY_BUCKETS)
        self.e2e = Histogram("dinfer:e2e_request_latency_seconds", "time from arrival until the answer",
                             LATENCY_BUCKETS)
        self.tpf = Histogram("dinfer:tokens_per_forward", "generated tokens / forwards, per request", TPF_BUCKETS)
        self.nfe = Histogram("dinfer:forwards_per_request", "model forwards each request took part in", NFE_BUCKETS)
        self.occupancy = Histogram("dinfer:batch_occupancy", "decoding rows / batch slots, per batch (static) or "
                                   "segment (continuous)", OCCUPANCY_BUCKETS)
        self.counters = {"blocks": 0, "blocks_at_cap": 0, "edits": 0, "inserts": 0, "deletes": 0}

    def observe_request(self, o: RequestObservation):
        with self._lock:
            self.queue.observe(o.queue_s)
            if o.first_token_s is not None:
                self.first_token.observe(o.first_token_s)
            self.e2e.observe(o.e2e_s)
            self.nfe.observe(o.nfe)
            self.tpf.observe(o.tpf)
            for k in self.counters:
                self.counters[k] += int(getattr(o, k))

    def observe_batch(self, rows: int, slots: int):
        with self._lock:
            self.occupancy.observe(rows / max(1, slots))

    def lines(self) -> list[str]:
        help_ = {"blocks": "blocks decoded for answered requests",
                 "blocks_at_cap": "blocks that used every iteration their bound allows (adaptive strategies: "
                                  "the threshold never let more than one token through per step, or editing "
                                  "reached its post-fill step cap); rate = this / dinfer:blocks_total",
                 "edits": "token-to-token edits (block diffusion with editing)",
                 "inserts": "tokens inserted (indel SPLIT)", "deletes": "tokens deleted (indel DELETE)"}
        with self._lock:
            out = []
            for h in (self.queue, self.first_token, self.e2e, self.tpf, self.nfe, self.occupancy):
                out += h.lines()
            for k, v in self.counters.items():
                name = f"dinfer:{k}_total"
                out += [f"# HELP {name} {help_[k]}", f"# TYPE {name} counter", f"{name} {v}"]
            return out


def blocks_at_cap(steps_per_block: Sequence[int], cap: int, adaptive: bool) -> tuple[int, int]:
    """(blocks decoded, blocks whose step count reached `cap`) from a row's steps per block (K,);
    blocks never entered (0 steps) are not counted; a scheduled strategy (fixed steps) never
    counts as capped."""
    steps = [int(s) for s in steps_per_block if int(s) > 0]
    return len(steps), (sum(s >= cap for s in steps) if adaptive else 0)
