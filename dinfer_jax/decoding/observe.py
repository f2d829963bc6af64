"""Host observers of a running generation: streaming and the live canvas view.

A program compiled with DecodeSpec(observe=True) calls `emit` once per loop iteration with the
generation region of the canvas. The callback carries a traced observer id, so one compiled
program serves every call: `register(fn)` returns the id to pass, and `fn(step, gen_BG, blk_B,
done_B, active_B)` receives numpy arrays (gen_BG: the B rows' gen_length tokens, mask ids where
still undecided; blk_B: each row's current block index; done_B: rows finished). Programs compiled
without observe contain no callback at all (tests/test_engine.py checks the jaxpr).
"""
from __future__ import annotations

import itertools
import threading

import jax
import numpy as np

_observers: dict[int, object] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


def register(fn) -> int:
    with _lock:
        oid = next(_ids) % (2**31 - 1)
        _observers[oid] = fn
    return oid


def unregister(oid: int):
    with _lock:
        _observers.pop(oid, None)


def _deliver(oid, step, gen_BG, blk_B, done_B, active_B):
    fn = _observers.get(int(oid))
    if fn is not None:
        fn(int(step), np.asarray(gen_BG), np.asarray(blk_B), np.asarray(done_B), np.asarray(active_B))


def emit(observer_id, step, gen_BG, blk_B, done_B, active_B):
    """Inside the loop: send this iteration's state to the host observer `observer_id`."""
    jax.debug.callback(_deliver, observer_id, step, gen_BG, blk_B, done_B, active_B)
