"""The quick-start demo (no torch needed): random tiny LLaDA-MoE -> HF export -> convert -> forward."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.smoke


def test_demo_round_trip(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dinfer_jax.cli", "demo", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "logits identical = True" in r.stdout
    assert (tmp_path / "hf" / "model.safetensors").is_file()  # 140k params: one file, no index
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert (tmp_path / "converted" / "dinfer_jax.json").is_file()
