"""The persistent compile cache: a second `dinfer-jax generate` in a fresh process reads its
programs from the on-disk cache (hits reported, no new cache files) instead of compiling them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.smoke  # no torch; also runs on the newest jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _generate(*flags, env=None):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    p = subprocess.run([sys.executable, "-m", "dinfer_jax.cli", "generate", "--prompt", "add 123+045=", "--json",
                        *flags], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_second_process_reuses_the_disk_cache(tmp_path):
    cache = str(tmp_path / "cc")
    first = _generate("--compile-cache", cache)
    files = sorted(os.listdir(cache))
    second = _generate("--compile-cache", cache)
    print(f"compile: first process {first['compile_seconds']}s, second {second['compile_seconds']}s "
          f"({second['compile_cache_hits']} cache hits)")
    assert first["compile_cache"] == second["compile_cache"] == os.path.abspath(cache)
    assert first["compile_cache_hits"] == 0 and len(files) > 0 and first["compile_seconds"] > 0
    assert second["compile_cache_hits"] > 0
    assert sorted(os.listdir(cache)) == files  # nothing new compiled and written
    assert second["token_ids"] == first["token_ids"]


def test_env_off_disables_it():
    out = _generate(env={"DINFER_JAX_COMPILE_CACHE": "off"})
    assert out["compile_cache"] is None and out["compile_cache_hits"] == 0


def test_flag_then_env_then_default(tmp_path, monkeypatch):
    from dinfer_jax import compile_cache
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "x"))
    assert compile_cache.resolve(None) == str(tmp_path / "x")
    assert compile_cache.resolve("OFF") is None and compile_cache.resolve(str(tmp_path / "y")) == str(tmp_path / "y")
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    assert compile_cache.resolve(None) == str(tmp_path / "home" / "dinfer-jax" / "jax-compile")
