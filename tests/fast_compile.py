"""How every test process compiles: fast, and once per program for the whole run.

Tiny test shapes make XLA:CPU compile time, not run time, the cost of the suite, so:
- FAST_XLA_FLAGS: LLVM at -O0 without its expensive passes (~40% less backend compile time on
  tests/test_block_diffusion.py; the HLO passes, fusion and numerics rules are unchanged).
- A persistent compile cache shared by the pytest workers and every subprocess they start (CLI
  runs, mesh workers): a program compiled by one process is read from disk by the next. Its folder
  is made once per run by the first process (the xdist controller) and passed on in
  $DINFER_TEST_COMPILE_CACHE; "off" there disables it.
"""
from __future__ import annotations

import os
import tempfile

FAST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
CACHE_ENV = "DINFER_TEST_COMPILE_CACHE"
_made_here: str | None = None


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process (devices: fake CPU device count, None = XLA's default)."""
    dev = f"--xla_force_host_platform_device_count={devices} " if devices else ""
    return dev + FAST_XLA_FLAGS


def shared_cache_dir() -> str | None:
    """This run's compile-cache folder (made on the first call of the run), or None when off."""
    global _made_here
    d = os.environ.get(CACHE_ENV)
    if d is None:
        d = _made_here = os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="dinfer-test-compile-cache-")
    return None if d.strip().lower() == "off" else d


def enable_shared_cache() -> str | None:
    """Point this process's JAX at the run's compile cache (before its first compile)."""
    d = shared_cache_dir()
    if d is not None:
        import jax
        jax.config.update("jax_compilation_cache_dir", d)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return d


def remove_cache_made_here():
    """Delete the run's cache folder if this process made it (the run's first process, at its end)."""
    if _made_here is not None:
        import shutil
        shutil.rmtree(_made_here, ignore_errors=True)
