"""Kill tests: `dinfer-jax convert` / `export` killed (SIGKILL, SIGINT) at random points of their
write phase leave either the complete result or no destination at all, and an old destination
(replaced with --overwrite) untouched; SIGINT exits 130 with one line; a retry is never blocked.

Each child imports everything first and prints "ready", so the random delay (seeded, up to the
measured write time) lands in the write phase, not in the imports.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

CHILD = """
import sys
import converters, orbax.checkpoint, jax  # noqa: F401  (imports and backend start before "ready")
from dinfer_jax import cli
jax.devices()
print("ready", flush=True)
cli.main(sys.argv[1:])
"""


def start(cmd, src, dst, overwrite):
    argv = [sys.executable, "-c", CHILD, cmd, src, dst, "--quiet"] + (["--overwrite"] if overwrite else [])
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    return p


def tree(root) -> dict:
    """{relative path: bytes} of every file under root (folders as None)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root)] = None
        for n in files:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


@pytest.fixture(scope="module")
def refs(tmp_path_factory, moe_hf_dir):
    """Complete reference results (written in-process) and each command's write time."""
    from converters import convert, export
    from dinfer_jax import checkpoint as ckpt
    base = tmp_path_factory.mktemp("atomic")
    out = {}
    for cmd, fn, src in (("convert", convert, moe_hf_dir), ("export", export, str(base / "convert"))):
        t = time.perf_counter()
        fn(src, str(base / cmd), progress=False)
        out[cmd] = (src, str(base / cmd), time.perf_counter() - t)
    out["params"] = ckpt.read_params(out["convert"][1])
    out["export_tree"] = tree(out["export"][1])
    return base, out


def assert_complete(cmd, dst, refs):
    from dinfer_jax import checkpoint as ckpt
    _, r = refs
    if cmd == "export":
        assert tree(dst) == r["export_tree"]
        return
    ref = r["convert"][1]
    assert ckpt.read_manifest(dst) == ckpt.read_manifest(ref)
    for name in ("config.json",):
        assert open(os.path.join(dst, name)).read() == open(os.path.join(ref, name)).read()
    got = ckpt.read_params(dst)
    assert set(got) == set(r["params"]) and all(np.array_equal(got[k], r["params"][k]) for k in got)


@pytest.mark.parametrize("cmd", ["convert", "export"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
@pytest.mark.parametrize("seed", [0, 1])
def test_killed_write_leaves_all_or_nothing(refs, tmp_path, cmd, sig, seed):
    base, r = refs
    src, _, write_s = r[cmd]
    rng = random.Random(f"{cmd}-{int(sig)}-{seed}")
    overwrite = seed == 1  # seed 0: a fresh destination; seed 1: an old one replaced with --overwrite
    dst = tmp_path / "dst"
    if overwrite:
        (dst / "sub").mkdir(parents=True)
        (dst / "old.txt").write_text("the old destination")
        (dst / "sub" / "tokenizer.json").write_text("{}")
    old = tree(dst) if overwrite else None
    p = start(cmd, src, str(dst), overwrite)
    time.sleep(rng.uniform(0.0, write_s))
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    if p.returncode != 0:  # killed before completion
        if sig == signal.SIGINT and p.returncode == -signal.SIGINT:  # arrived after main() returned
            assert err == "" and dst.exists(), err
        elif sig == signal.SIGINT:
            assert p.returncode == 130 and err.strip() == f"dinfer-jax: interrupted ({cmd})", err
        else:
            assert p.returncode == -signal.SIGKILL
    if overwrite:  # the old folder untouched, or the complete new one
        assert dst.exists(), "the old destination vanished"
        if tree(dst) != old:
            assert_complete(cmd, str(dst), refs)
    elif dst.exists():  # the complete result, or nothing
        assert_complete(cmd, str(dst), refs)
    else:
        assert p.returncode != 0
    # A retry is never blocked, and removes what the killed run left beside the destination.
    if seed == 1:
        from dinfer_jax import cli
        cli.main([cmd, src, str(dst), "--quiet", "--overwrite"])
        assert_complete(cmd, str(dst), refs)
        assert os.listdir(tmp_path) == ["dst"], os.listdir(tmp_path)


def test_atomic_folder_in_process(tmp_path):
    """An exception inside leaves no destination; overwrite swaps whole folders; stale siblings of
    dead processes are removed."""
    from dinfer_jax.atomic import atomic_folder
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_folder(str(dst)) as tmp:
            open(os.path.join(tmp, "half"), "w").write("x")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    with atomic_folder(str(dst)) as tmp:
        open(os.path.join(tmp, "a"), "w").write("1")
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        with atomic_folder(str(dst)):
            pass
    with pytest.raises(RuntimeError):
        with atomic_folder(str(dst), overwrite=True) as tmp:
            open(os.path.join(tmp, "b"), "w").write("2")
            raise RuntimeError("boom")
    assert tree(dst) == {"a": b"1"}
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.dinfer-tmp-{dead.pid}-abc"
    stale.mkdir()
    with atomic_folder(str(dst), overwrite=True) as tmp:
        open(os.path.join(tmp, "b"), "w").write("2")
    assert tree(dst) == {"b": b"2"} and sorted(os.listdir(tmp_path)) == ["out"]
    shutil.rmtree(dst)
