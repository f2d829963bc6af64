"""JAX's persistent on-disk compilation cache, on by default for the CLI: `--compile-cache DIR`, else
$DINFER_JAX_COMPILE_CACHE, else $JAX_COMPILATION_CACHE_DIR, else ~/.cache/dinfer-jax/jax-compile
("off" disables it); every program is written. `stats()` counts hits / misses / compile seconds in
this process (docs/internals/runtime.md).
"""
from __future__ import annotations

import os
import threading

ENV = "DINFER_JAX_COMPILE_CACHE"
OFF = "off"

_lock = threading.Lock()
_stats = {"requests": 0, "hits": 0, "misses": 0, "compile_seconds": 0.0, "saved_seconds": 0.0}
_listening = False
_dir: str | None = None


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dinfer-jax", "jax-compile")


def resolve(flag: str | None) -> str | None:
    """The cache folder for this flag value (None: not given), or None when disabled."""
    for v in (flag, os.environ.get(ENV), os.environ.get("JAX_COMPILATION_CACHE_DIR")):
        if v is not None and v.strip():
            return None if v.strip().lower() == OFF else os.path.abspath(os.path.expanduser(v.strip()))
    return default_dir()


def _on_event(event: str, **kw):
    key = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
           "/jax/compilation_cache/cache_hits": "hits",
           "/jax/compilation_cache/cache_misses": "misses"}.get(event)
    if key:
        with _lock:
            _stats[key] += 1


def _on_duration(event: str, duration: float, **kw):
    key = {"/jax/core/compile/backend_compile_duration": "compile_seconds",
           "/jax/compilation_cache/compile_time_saved_sec": "saved_seconds"}.get(event)
    if key:
        with _lock:
            _stats[key] += float(duration)


def listen():
    """Count compile-cache events and backend compile time in this process (idempotent)."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    from jax import monitoring
    monitoring.register_event_listener(_on_event)
    monitoring.register_event_duration_secs_listener(_on_duration)


def enable(flag: str | None = None) -> str | None:
    """Turn the persistent cache on (before the first compile) -> its folder, or None when off.
    OSError naming the folder when it cannot be created."""
    global _dir
    listen()
    path = resolve(flag)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"compile cache folder {path!r} cannot be created ({e.strerror or e}); "
                               f"pass --compile-cache DIR or --compile-cache off") from None
    import jax
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _dir = path
    return path


def cache_dir() -> str | None:
    return _dir


def stats() -> dict:
    with _lock:
        return dict(_stats, dir=_dir)
