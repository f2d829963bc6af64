#!/usr/bin/env bash
# One prepared device check (see the device tool's METHOD.md): (1) attention kernel and MoE layer
# timings at LLaDA-MoE-7B-A1B shapes, (2) end-to-end generation at 7B-A1B shapes (bs 1, 4, 16; block
# 64; dual cache) with the bytes/FLOPs floor from bench/roofline.py. Logs + JSON go to $OUT (when set).
# On a machine without an accelerator, pass --tiny (the test suite does).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$(pwd)
out=${OUT:-/tmp}
python3 -c "import jax" 2>/dev/null || python3 -m pip install -q -e .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
python3 bench/gpu/kernels_bench.py "$@" 2>&1 | tee "$out/kernels_bench.log"
python3 bench/gpu/e2e_bench.py --out "$out/e2e_bench.json" "$@" 2>&1 | tee "$out/e2e_bench.log"
