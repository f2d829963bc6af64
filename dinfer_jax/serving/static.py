"""The static scheduler (`--scheduler static`): queued jobs with the same compiled settings
(gen_length, block_length, strategy, cache, ...) are decoded together as one whole engine batch;
per-request threshold, temperature and seed are per-row values of the same program, and batches
are padded to the engine's shape buckets. A batch runs to its last row before the next starts.
"""
from __future__ import annotations

import collections
import time
from typing import Optional

import numpy as np

from dinfer_jax.engine import PROMPT_BUCKET, SamplingParams
from dinfer_jax.serving.scheduler import Job, Scheduler


class StaticBatcher(Scheduler):
    """Whole batches, one at a time (module doc)."""

    def _take_batch(self) -> Optional[list[Job]]:
        """The next batch (maybe empty when every waiting job expired); None when stopping."""
        with self.cond:
            while not self.pending and not self._stop:
                self.cond.wait()
            if self._stop:
                return None
        time.sleep(self.cfg.batch_wait_s)  # let concurrent requests arrive
        with self.cond:
            dropped = self._purge_locked()
            live = list(self.pending)
            batch, rest = [], collections.deque()
            for j in live:
                (batch if j.key == live[0].key and len(batch) < self.cfg.max_batch else rest).append(j)
            self.pending = rest
            if batch:
                self.stats["batches"] += 1
                self.stats["batch_sizes"][len(batch)] += 1
                self.stats["max_batch_size"] = max(self.stats["max_batch_size"], len(batch))
                self.stats["running_rows"] = len(batch)
        self._drop(dropped)
        return batch

    def _warmup_sizes(self) -> list[int]:
        """The batch sizes requests may run at: powers of two up to max_batch's bucket."""
        sizes, b = [], 1
        while True:
            sizes.append(b)
            if b >= self.cfg.max_batch:
                return sizes
            b *= 2

    def _warmup_batch(self, p: SamplingParams, size: int, ids: np.ndarray) -> int:
        """Compile (by running) the programs a batch of `size` rows uses -> how many."""
        for observer in (None, lambda *a: None):  # plain and streaming variants
            self.gen.generate([ids] * size, p, observer=observer)
        return 2

    def _warmup_prompts(self) -> list[np.ndarray]:
        """One prompt per prompt-length bucket up to cfg.warmup_prompt_len (the static scheduler's
        buckets: engine's multiples of PROMPT_BUCKET)."""
        tok = self.gen.model.config.filler_id
        lens = range(1, max(1, self.cfg.warmup_prompt_len) + 1, PROMPT_BUCKET)
        return [np.full((n,), tok, np.int32) for n in lens]

    def _run(self):
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            if not batch:
                continue
            try:
                with self.running(f"batch of {len(batch)}", batch):
                    self._decode(batch)
            except Exception as e:  # the batch fails, the server stays up
                with self.cond:
                    self.stats["failed"] += len(batch)
                for j in batch:
                    self._finish(j, exc=e)
            finally:
                with self.cond:
                    self.stats["running_rows"] = 0
