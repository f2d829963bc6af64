"""Block-aligned prompt prefix cache for block-causal models (LLaDA2.x, SDAR): exact K/V reuse.
A device pool of per-block prompt K/V slots keyed by a hash chain over the prompt's blocks, LRU.
Why it is exact, why full-attention models cannot use it, the store: docs/internals/decoding_loops.md."""
from __future__ import annotations

import collections
import hashlib
import threading

import jax
import jax.numpy as jnp
import numpy as np


def chain_keys(ids, block: int) -> list[bytes]:
    """Keys of the full blocks of a prompt (1-D int ids): key_k names blocks 0..k."""
    ids = np.asarray(ids, np.int64)
    keys, prev = [], b"block=%d" % block
    for k in range(len(ids) // block):
        prev = hashlib.blake2b(prev + ids[k * block:(k + 1) * block].tobytes(), digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """LRU pool of per-block prompt K/V (module doc), bounded by `max_bytes`. Host metadata is
    locked; the pool itself is used by one thread (the scheduler)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"prefix cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._slot: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> pool slot, LRU first
        self._free: list[int] = []
        self._lock = threading.Lock()
        self.pool = None  # (k, v) each (slots, layers, B_len, K*H), allocated on the first insert
        self.block_bytes = 0
        self.stats = dict(lookups=0, blocks_looked_up=0, blocks_hit=0, tokens_reused=0, blocks_inserted=0,
                          evictions=0, prefill_tokens=0, prefill_tokens_full=0)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self):
        return len(self._slot)

    @property
    def bytes(self) -> int:
        return len(self._slot) * self.block_bytes

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Pool slots of the longest cached chain prefix of `keys` (blocks 0..h-1)."""
        out = []
        with self._lock:
            for key in keys:
                slot = self._slot.get(key)
                if slot is None:
                    break
                out.append(slot)
            for key in reversed(keys[:len(out)]):  # deepest first: ancestors end up most recent
                self._slot.move_to_end(key)
            self.stats["lookups"] += 1
            self.stats["blocks_looked_up"] += len(keys)
            self.stats["blocks_hit"] += len(out)
            if out:
                self.stats["tokens_reused"] += len(out) * self.pool[0].shape[2]
        return out

    def _allocate(self, kv, block: int):
        L, _, _, F = kv[0].shape
        self.block_bytes = 2 * L * block * F * kv[0].dtype.itemsize
        n = self.max_bytes // self.block_bytes
        if n == 0:
            return False
        self.pool = tuple(jnp.zeros((n, L, block, F), kv[0].dtype) for _ in range(2))
        self._free = list(range(n - 1, -1, -1))
        return True

    def insert(self, keys: list[bytes], kv, rows: list[int], starts: list[int], block: int):
        """Store the blocks kv[:, rows[i], starts[i]:starts[i] + block] (kv: the (k, v) canvas cache,
        each (layers, B, L, K*H)) under keys[i]; keys already present are refreshed. Evicts LRU
        entries to stay in budget."""
        if self.pool is None and not self._allocate(kv, block):
            return
        with self._lock:
            take, slots, seen = [], [], set()
            for i, key in enumerate(keys):
                if key in self._slot or key in seen:
                    if key in self._slot:
                        self._slot.move_to_end(key)
                    continue
                if not self._free:
                    old, slot = self._slot.popitem(last=False)
                    self._free.append(slot)
                    self.stats["evictions"] += 1
                slot = self._free.pop()
                self._slot[key] = slot
                seen.add(key)
                take.append(i)
                slots.append(slot)
            self.stats["blocks_inserted"] += len(take)
        if take:
            N = _pow2_count(len(take))
            idx = lambda xs: jnp.asarray(_pad_list([xs[i] for i in take], N), jnp.int32)
            self.pool = _store(self.pool[0], self.pool[1], kv[0], kv[1], idx(rows), idx(starts),
                               jnp.asarray(_pad_list(slots, N), jnp.int32))

    def place(self, slots: list[int], rows: list[int], starts: list[int], batch: int, length: int):
        """Cached blocks laid out on a (layers, batch, length, K*H) canvas cache: pool slot slots[i]
        at row rows[i], canvas [starts[i], starts[i] + block); zeros elsewhere."""
        N = _pow2_count(len(slots))
        a = lambda xs: jnp.asarray(_pad_list(list(xs), N), jnp.int32)
        return _place(self.pool[0], self.pool[1], a(slots), a(rows), a(starts), batch, length)

    def clear(self):
        """Forget every entry and zero the counters (the pool stays allocated)."""
        with self._lock:
            if self.pool is not None:
                self._free = list(range(self.pool[0].shape[0] - 1, -1, -1))
            self._slot.clear()
            self.stats = {k: 0 for k in self.stats}

    def count_prefill(self, computed: int, full: int):
        with self._lock:
            self.stats["prefill_tokens"] += computed
            self.stats["prefill_tokens_full"] += full

    def snapshot(self) -> dict:
        """Counters, hit rate (cached blocks / full prompt blocks looked up), entries and bytes."""
        with self._lock:
            s = dict(self.stats)
            s.update(entries=len(self._slot), bytes=self.bytes, max_bytes=self.max_bytes,
                     hit_rate=round(s["blocks_hit"] / s["blocks_looked_up"], 4) if s["blocks_looked_up"] else 0.0)
        return s


def _pow2_count(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pad_list(xs: list, n: int) -> list:
    """xs padded to n by repeating its last element (repeated gathers/writes are idempotent)."""
    return xs + [xs[-1]] * (n - len(xs))


def _store_impl(pool_k, pool_v, k_LBTF, v_LBTF, rows_N, starts_N, slots_N):
    """pool[slots_N[i]] = cache[:, rows_N[i], starts_N[i]:+block] for k and v (pool donated)."""
    block = pool_k.shape[2]

    def one(a, r, s):
        return jax.lax.dynamic_slice(a, (0, r, s, 0), (a.shape[0], 1, block, a.shape[3]))[:, 0]
    take = jax.vmap(one, in_axes=(None, 0, 0))
    return (pool_k.at[slots_N].set(take(k_LBTF, rows_N, starts_N).astype(pool_k.dtype)),
            pool_v.at[slots_N].set(take(v_LBTF, rows_N, starts_N).astype(pool_v.dtype)))


_store = jax.jit(_store_impl, donate_argnums=(0, 1))


def _place_impl(pool_k, pool_v, slots_N, rows_N, starts_N, batch, length):
    _, L, S, F = pool_k.shape
    zero = jnp.zeros((L, batch, length, F), pool_k.dtype)

    def body(i, kv):
        k, v = kv
        at = (0, rows_N[i], starts_N[i], 0)
        return (jax.lax.dynamic_update_slice(k, pool_k[slots_N[i]][:, None], at),
                jax.lax.dynamic_update_slice(v, pool_v[slots_N[i]][:, None], at))
    return jax.lax.fori_loop(0, slots_N.shape[0], body, (zero, zero))


_place = jax.jit(_place_impl, static_argnums=(5, 6))
