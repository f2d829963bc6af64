"""`dinfer-jax generate` as a user runs it: subprocess, --json schema, clear errors with exit 2."""
import json
import subprocess
import sys

import pytest

EXE = [sys.executable, "-m", "dinfer_jax.cli", "generate"]


def run(args):
    return subprocess.run(EXE + args, capture_output=True, text=True, timeout=600)


def test_generate_json(moe_hf_dir):
    r = run(["--model", moe_hf_dir, "--prompt-ids", "1,2,3", "--gen-length", "16", "--block-length", "8",
             "--cache", "dual", "--json"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"token_ids", "text", "nfe", "tpf", "seconds", "compile_seconds", "compile_cache_hits",
                        "compile_cache"}
    assert len(out["token_ids"]) <= 16 and out["nfe"] >= 2 and out["text"] is None


@pytest.mark.parametrize("args,msg", [
    (["--gen-length", "0"], "expected a positive integer, got 0"),
    (["--strategy", "beam"], "invalid choice: 'beam'"),
    (["--gen-length", "20", "--block-length", "8"], "gen_length=20 must be a positive multiple of block_length=8"),
    (["--prompt", "hello"], "--prompt needs"),
])
def test_generate_errors(moe_hf_dir, args, msg):
    base = ["--model", moe_hf_dir] + ([] if "--prompt" in args else ["--prompt-ids", "1,2"])
    r = run(base + args)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_generate_missing_model_folder(tmp_path):
    r = run(["--model", str(tmp_path / "nope"), "--prompt-ids", "1"])
    assert r.returncode == 2 and "does not exist" in r.stderr
