"""A bounded cache of compiled programs (the Generator's), least recently used dropped first: at most
`max_programs` entries, and fewer while the process holds more than `map_fraction` of the kernel's
memory-mapping cap (XLA:CPU programs hold many mappings; past the cap the next compile crashes).
Thread safe. Why: docs/internals/runtime.md.
"""
from __future__ import annotations

import collections
import gc
import threading
from typing import Any, Callable, Hashable, Optional

DEFAULT_MAX_PROGRAMS = 64
DEFAULT_MAP_FRACTION = 0.5


def memory_map_count() -> Optional[int]:
    """Memory mappings this process holds now (Linux /proc/self/maps), None where unreadable."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def memory_map_limit() -> Optional[int]:
    """The kernel's cap on a process's memory mappings (vm.max_map_count), None where unreadable."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def maps_near_limit(fraction: float = DEFAULT_MAP_FRACTION) -> bool:
    """Whether this process holds more than `fraction` of the mappings the kernel allows it."""
    n, cap = memory_map_count(), memory_map_limit()
    return n is not None and cap is not None and n > fraction * cap


class ProgramCache:
    """key -> program (jitted functions), LRU with a size bound and a memory-mapping bound.
    `on_evict(key)` runs for each dropped key."""

    def __init__(self, max_programs: int = DEFAULT_MAX_PROGRAMS, map_fraction: float = DEFAULT_MAP_FRACTION,
                 on_evict: Optional[Callable[[Hashable], None]] = None):
        if max_programs < 1:
            raise ValueError(f"max_programs={max_programs} must be >= 1")
        self.max_programs, self.map_fraction, self.on_evict = max_programs, map_fraction, on_evict
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.RLock()
        self.evicted = 0

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The program under key, built (and older ones dropped past the bounds) when missing."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            program = build()
            self._items[key] = program
            self._trim(keep=key)
            return program

    def resize(self, max_programs: int):
        """A new count bound (>= 1); entries past it are dropped, least recently used first."""
        if max_programs < 1:
            raise ValueError(f"max_programs={max_programs} must be >= 1")
        with self._lock:
            self.max_programs = max_programs
            self._trim_count(keep=None)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list:
        with self._lock:
            return list(self._items)

    def clear(self):
        with self._lock:
            for key in list(self._items):
                self._drop(key)

    def _drop(self, key):
        del self._items[key]
        self.evicted += 1
        if self.on_evict is not None:
            self.on_evict(key)

    def _trim_count(self, keep):
        """Drop least recently used entries (never `keep`) down to the count bound."""
        while len(self._items) > self.max_programs:
            self._drop(next(k for k in self._items if k != keep))

    def _trim(self, keep):
        self._trim_count(keep)
        if len(self._items) > 1 and maps_near_limit(self.map_fraction):
            while len(self._items) > 1:
                self._drop(next(k for k in self._items if k != keep))
                gc.collect()  # a jitted closure may sit in a reference cycle: free its executable now
                if not maps_near_limit(self.map_fraction):
                    break
