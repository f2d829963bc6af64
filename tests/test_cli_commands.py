"""`dinfer-jax serve | bench | profile` and the --mesh flag as a user runs them: the console
module in a subprocess, JSON output, clear errors with exit 2."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-m", "dinfer_jax.cli"]
GEN = ["--gen-length", "16", "--block-length", "8", "--threshold", "0.3"]


def run(args, env=None, timeout=600):
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A torch-free tiny random LLaDA-MoE dinfer-jax checkpoint."""
    from dinfer_jax import checkpoint
    from dinfer_jax.families import preset, to_hf_dict
    from dinfer_jax.models import init_params
    cfg = preset("tiny")
    folder = str(tmp_path_factory.mktemp("cli") / "tiny")
    checkpoint.save_params(folder, init_params(cfg, seed=4), to_hf_dict(cfg))
    return folder


@pytest.mark.smoke
def test_bench_json(ckpt):
    r = run(["bench", "--model", ckpt, "--batch", "1,2", "--prompt-len", "8", "--repeats", "1", "--json"] + GEN)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["batch"] for x in rows] == [1, 2]
    assert set(rows[0]) == {"batch", "strategy", "cache", "seconds", "tokens_per_s", "nfe", "tpf", "tokens"}


@pytest.mark.smoke
def test_profile_writes_trace(ckpt, tmp_path):
    r = run(["profile", "--model", ckpt, "--prompt-ids", "1,2,3", "--logdir", str(tmp_path / "tb")] + GEN)
    assert r.returncode == 0, r.stderr
    assert f"tensorboard --logdir {tmp_path / 'tb'} --host 127.0.0.1" in r.stdout
    assert f"bench/profile_top_ops.py {tmp_path / 'tb'}" in r.stdout
    found = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "tb") for f in fs if f.endswith(".xplane.pb")]
    assert found and b"denoise_loop" in open(found[0], "rb").read()


@pytest.mark.smoke
def test_generate_on_a_mesh_equals_one_device(ckpt):
    flags = "--xla_force_host_platform_device_count=4 " + os.environ.get("DINFER_TEST_XLA_FLAGS", "")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    one = run(["generate", "--model", ckpt, "--prompt-ids", "5,6,7,8", "--json"] + GEN, env=env)
    four = run(["generate", "--model", ckpt, "--prompt-ids", "5,6,7,8", "--json", "--mesh", "expert=2,model=2"] + GEN,
               env=env)
    assert one.returncode == 0 and four.returncode == 0, one.stderr + four.stderr
    a, b = json.loads(one.stdout), json.loads(four.stdout)
    assert a["token_ids"] == b["token_ids"] and a["nfe"] == b["nfe"]


@pytest.mark.smoke
@pytest.mark.parametrize("args,msg", [
    (["generate", "--prompt-ids", "1,2", "--mesh", "data=3"], "needs 3 devices but 1 are available"),
    (["generate", "--prompt-ids", "1,2", "--mesh", "tensor=2"], "unknown axes ['tensor']"),
    (["bench", "--strategies", "beam"], "unknown strategy/cache ['beam']"),
    (["bench", "--batch", "0"], "expected positive integers"),
    (["generate", "--prompt-ids", "1,2", "--coordinator", "localhost:1"], "needs --num-processes and --process-id"),
])
def test_command_errors(ckpt, args, msg):
    r = run(args[:1] + ["--model", ckpt] + args[1:])
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_serve_subprocess(ckpt):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(CLI + ["serve", "--model", ckpt, "--port", str(port), "--log-level", "warning",
                                "--block-length", "8", "--threshold", "0.3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
            assert p.poll() is None, p.communicate()[1][-3000:]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 16}, timeout=300)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "tiny" and body["choices"][0]["finish_reason"] in ("stop", "length")
        gen = run(["generate", "--model", ckpt, "--prompt-ids", "5,6,7,8", "--json"] + GEN)
        assert body["choices"][0]["token_ids"] == json.loads(gen.stdout)["token_ids"]
    finally:
        p.terminate()
        p.wait(timeout=30)
