#!/usr/bin/env bash
# One prepared TPU check, the twin of bench/gpu/run.sh (the benchmark scripts are platform-agnostic
# and live in bench/gpu/): (0) the whole generate program AOT-exported for this jax's TPU lowering
# (dinfer_jax.aot: Mosaic kernels present, none interpreted), (1) attention and MoE kernel timings
# (Pallas flash attention and the Pallas GMM vs XLA) at LLaDA-MoE / LLaDA2 shapes, (2) end-to-end
# generation at 7B-A1B shapes (bs 1, 4, 16; block 64; dual cache) with the bytes/FLOPs floor.
# Logs + JSON go to $OUT (when set). On a machine without a TPU, pass --tiny (the test suite does).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$(pwd)
out=${OUT:-/tmp}
python3 -c "import jax" 2>/dev/null || python3 -m pip install -q -e . "jax[tpu]"
python3 -c "import jax; print(jax.__version__, jax.default_backend(), jax.devices())"
model=llada-moe-7b-a1b
for a in "$@"; do [ "$a" = "--tiny" ] && model=tiny; done
python3 -m dinfer_jax.aot --model "$model" --platform tpu --cache none dual --batch 1 --json "$out/aot_tpu.json" \
  2>&1 | tee "$out/aot_tpu.log"
python3 bench/gpu/kernels_bench.py "$@" 2>&1 | tee "$out/kernels_bench.log"
python3 bench/gpu/e2e_bench.py --out "$out/e2e_bench.json" "$@" 2>&1 | tee "$out/e2e_bench.log"
