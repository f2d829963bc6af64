"""The GPU benchmark script runs end to end at tiny shapes on CPU (so it is ready for a lent GPU)."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.smoke
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_kernel_bench_tiny_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu", "run.sh"), "--tiny", "--repeats", "2"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| attention | pallas |" in r.stdout and "| moe | tiled |" in r.stdout
    assert '"error"' not in r.stdout  # xla and pallas both ran
    assert (tmp_path / "kernels_bench.log").is_file()
