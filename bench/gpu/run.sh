#!/usr/bin/env bash
# One prepared device check (see the device tool's METHOD.md): kernel and MoE timings at
# LLaDA-MoE-7B-A1B shapes. Writes the log to $OUT (when set) and prints the table.
# On a machine without an accelerator, pass --tiny (the test suite does).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$(pwd)
log=${OUT:-/tmp}/kernels_bench.log
python3 -c "import jax" 2>/dev/null || python3 -m pip install -q -e .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
python3 bench/gpu/kernels_bench.py "$@" 2>&1 | tee "$log"
