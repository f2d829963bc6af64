#!/usr/bin/env bash
# One prepared device check (see the device tool's METHOD.md). Sections, in order of value, each under
# its own time limit so one slow or failing part never costs the others (a failure is printed as
# "SECTION <name> FAILED rc=N" and the script goes on):
#   1. kernels: attention (our Pallas/Triton kernel vs cuDNN vs XLA, error vs an fp32 reference) and the
#      MoE expert layer (ragged_dot / tiled / dense, and int8 / fp8 weights) at real model shapes;
#   2. e2e_bench: end-to-end generation at LLaDA-MoE-7B-A1B shapes (all 16 layers, bf16, dual cache,
#      block 64) with the bytes/FLOPs floor from bench/roofline.py;
#   3. peers_medium: bench/compare_peers.py on the GPU (Fast-dLLM's and dInfer's own engines vs ours,
#      same weights: the medium dense LLaDA, bf16), when checkouts of the peers are in $PEERS
#      (default .peers/{fast-dllm,dinfer});
#   4. e2e_llada2: block diffusion at LLaDA2-mini shapes (all 20 layers, 256 experts, bf16, block 32).
# Logs + JSON go to $OUT (8 files at most: what the device tool returns). On a machine without an
# accelerator pass --tiny (the test suite does): every section at tiny shapes, seconds each.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$(pwd)
out=${OUT:-/tmp}
peers=${PEERS:-.peers}
tiny=0
for a in "$@"; do [ "$a" = "--tiny" ] && tiny=1; done
python3 -c "import jax" 2>/dev/null || python3 -m pip install -q -e .
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null || true
failed=0

section() {  # section NAME SECONDS LOGFILE CMD...
  local name=$1 secs=$2 log=$3; shift 3
  echo "=== SECTION $name (limit ${secs} s) $(date -u +%T)" | tee -a "$log"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$secs" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ]; then echo "SECTION $name FAILED rc=$rc" | tee -a "$log"; failed=1; fi
  echo "=== SECTION $name done in $((SECONDS - t0)) s" | tee -a "$log"
}

if [ $tiny = 1 ]; then
  section kernels 300 "$out/kernels_bench.log" python3 bench/gpu/kernels_bench.py "$@"
  section e2e 300 "$out/e2e_bench.log" python3 bench/gpu/e2e_bench.py --out "$out/e2e_bench.json" "$@"
  section e2e_llada2 300 "$out/e2e_llada2.log" python3 bench/gpu/e2e_bench.py --preset tiny-llada2 \
    --cache block --block 8 --batches 2 --out "$out/e2e_llada2.json" "$@"
else
  section kernels 90 "$out/kernels_bench.log" python3 bench/gpu/kernels_bench.py "$@"
  # If the default attention path (our Triton kernel) fails to build, the same run with XLA's attention.
  section e2e 100 "$out/e2e_bench.log" bash -c 'python3 bench/gpu/e2e_bench.py --batches 1 16 --out "$0" || {
    echo "E2E WITH THE PALLAS ATTENTION FAILED: again with --attention-impl xla";
    python3 bench/gpu/e2e_bench.py --batches 1 16 --attention-impl xla --out "$0"; }' "$out/e2e_bench.json"
fi
if [ -d "$peers/fast-dllm" ] && [ -d "$peers/dinfer" ]; then
  if [ $tiny = 1 ]; then
    section peers 300 "$out/peers.log" python3 bench/compare_peers.py --fast-dllm "$peers/fast-dllm" \
      --dinfer "$peers/dinfer" --models tiny --repeats 1 --num-prompts 2 --out "$out/peers_tiny.json"
  else
    # The medium dense model (168 M params) in bf16; the 8b-4l model (--models 8b-4l) needs ~80 s
    # of host time to build its checkpoint and more to load the peers: too long for one lease.
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 section peers_medium 90 "$out/peers.log" python3 bench/compare_peers.py \
      --device cuda --dtype bfloat16 --models medium --gen-length 256 --block-length 32 --num-prompts 3 \
      --repeats 3 --fast-dllm "$peers/fast-dllm" --dinfer "$peers/dinfer" --out "$out/peers_medium.json"
  fi
else
  echo "no peer checkouts in $peers (fast-dllm, dinfer): compare_peers skipped"
fi
if [ $tiny = 0 ]; then
  section e2e_llada2 70 "$out/e2e_llada2.log" bash -c 'a="--preset llada2-mini --cache block --block 32 --batches 16";
    python3 bench/gpu/e2e_bench.py $a --out "$0" || { echo "E2E WITH THE PALLAS ATTENTION FAILED: again with xla";
    python3 bench/gpu/e2e_bench.py $a --attention-impl xla --out "$0"; }' "$out/e2e_llada2.json"
fi
exit $failed
