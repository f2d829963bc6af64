"""Block-aligned prompt prefix cache for block-causal models (LLaDA2.x, SDAR): exact K/V reuse.

Why it is exact: with block-causal attention, the K/V of prompt block k (positions [kB, (k+1)B))
depend only on the tokens of blocks 0..k and on the positions, never on anything later (the
generated region, other rows, the canvas padding: positions are per row, index - pad). So two
prompts that share their first h full blocks share those blocks' K/V bit for bit (up to the
rounding of a differently shaped forward). Only FULL prompt blocks are cached: the prompt tail
shares its block with the first generated positions, and its K/V change while that block decodes.

Why full-attention models (LLaDA, LLaDA-MoE, Dream) cannot use it: every prompt token attends to
the whole canvas, including the masked generation region that changes at every step, so a prompt
token's K/V depend on the request's own generated tokens; a cached copy from another request is
not the K/V this request would compute (the dual cache refreshes them at every block for that
reason).

Store: entry = the K/V of one block, (layers, B_len, K, H) for k and for v, resident on the device,
keyed by a hash chain over the prompt's blocks (key_k = H(key_{k-1}, tokens of block k), seeded by
the block length), so a key names the whole prefix up to that block. Lookup walks the chain from
block 0 and stops at the first miss. Bounded by bytes; least-recently-used entries go first, and a
hit refreshes the chain deepest-first so a prefix's ancestors are always more recent than its
descendants (evicting an ancestor would strand every descendant).

The consumer (decoding/segments.RunningBatch.admit) prefills only the uncached tail of the prompts:
block_loop's init with `prefix=(cached K/V laid out on the canvas, window width)`.
"""
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
    """LRU store of per-block prompt K/V (module doc), bounded by `max_bytes`. Thread safe."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"prefix cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._entries: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.stats = dict(lookups=0, blocks_looked_up=0, blocks_hit=0, tokens_reused=0, blocks_inserted=0,
                          evictions=0, prefill_tokens=0, prefill_tokens_full=0)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self):
        return len(self._entries)

    def lookup(self, keys: list[bytes]) -> list[tuple]:
        """The cached (k, v) of the longest cached chain prefix of `keys` (blocks 0..h-1)."""
        out = []
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None:
                    break
                out.append(e)
            for key in reversed(keys[:len(out)]):  # deepest first: ancestors end up most recent
                self._entries.move_to_end(key)
            self.stats["lookups"] += 1
            self.stats["blocks_looked_up"] += len(keys)
            self.stats["blocks_hit"] += len(out)
            if out:
                self.stats["tokens_reused"] += len(out) * out[0][0].shape[1]
        return out

    def insert(self, key: bytes, k, v):
        """Store one block's K/V (each (layers, B_len, K, H)); evicts LRU entries to stay in budget."""
        size = k.nbytes + v.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            while self.bytes + size > self.max_bytes and self._entries:
                _, (ok, ov) = self._entries.popitem(last=False)
                self.bytes -= ok.nbytes + ov.nbytes
                self.stats["evictions"] += 1
            self._entries[key] = (k, v)
            self.bytes += size
            self.stats["blocks_inserted"] += 1

    def count_prefill(self, computed: int, full: int):
        with self._lock:
            self.stats["prefill_tokens"] += computed
            self.stats["prefill_tokens_full"] += full

    def snapshot(self) -> dict:
        """Counters, hit rate (cached blocks / full prompt blocks looked up), entries and bytes."""
        with self._lock:
            s = dict(self.stats)
            s.update(entries=len(self._entries), bytes=self.bytes, max_bytes=self.max_bytes,
                     hit_rate=round(s["blocks_hit"] / s["blocks_looked_up"], 4) if s["blocks_looked_up"] else 0.0)
        return s


def _pow2_count(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pad_list(xs: list, n: int) -> list:
    """xs padded to n by repeating its last element (repeated gathers/writes are idempotent)."""
    return xs + [xs[-1]] * (n - len(xs))


def gather_blocks(kv, rows: list[int], starts: list[int], block: int) -> list[tuple]:
    """Per-block (k, v) copies, each (layers, block, K, H), of cache rows[i] at canvas [starts[i],
    starts[i] + block). One compiled gather per power-of-two count."""
    n = len(rows)
    N = _pow2_count(n)
    r = jnp.asarray(_pad_list(list(rows), N), jnp.int32)
    s = jnp.asarray(_pad_list(list(starts), N), jnp.int32)
    k, v = _gather(kv[0], kv[1], r, s, block)
    return [(k[i], v[i]) for i in range(n)]


def _gather_impl(k_LBTKH, v_LBTKH, rows_N, starts_N, block):
    def one(a, r, s):
        return jax.lax.dynamic_slice(a, (0, r, s, 0, 0), (a.shape[0], 1, block, a.shape[3], a.shape[4]))[:, 0]
    take = jax.vmap(one, in_axes=(None, 0, 0))
    return take(k_LBTKH, rows_N, starts_N), take(v_LBTKH, rows_N, starts_N)


_gather = jax.jit(_gather_impl, static_argnums=(4,))


def _place_impl(k_NLSKH, v_NLSKH, rows_N, starts_N, batch, length):
    """Blocks written into zero caches (layers, batch, length, K, H) at (rows_N[i], starts_N[i])."""
    _, L, S, K, H = k_NLSKH.shape
    zero = jnp.zeros((L, batch, length, K, H), k_NLSKH.dtype)

    def body(i, kv):
        k, v = kv
        at = (0, rows_N[i], starts_N[i], 0, 0)
        return (jax.lax.dynamic_update_slice(k, k_NLSKH[i][:, None], at),
                jax.lax.dynamic_update_slice(v, v_NLSKH[i][:, None], at))
    return jax.lax.fori_loop(0, k_NLSKH.shape[0], body, (zero, zero))


_place = jax.jit(_place_impl, static_argnums=(4, 5))


def place_blocks(blocks: list[tuple], rows: list[int], starts: list[int], batch: int, length: int):
    """Cached blocks [(k, v) each (layers, block, K, H)] laid out on a (layers, batch, length, K, H)
    canvas cache at rows[i], starts[i] (zeros elsewhere). One compiled program per power-of-two count."""
    N = _pow2_count(len(blocks))
    blocks = _pad_list(blocks, N)
    k = jnp.stack([b[0] for b in blocks])
    v = jnp.stack([b[1] for b in blocks])
    return _place(k, v, jnp.asarray(_pad_list(list(rows), N), jnp.int32),
                  jnp.asarray(_pad_list(list(starts), N), jnp.int32), batch, length)
