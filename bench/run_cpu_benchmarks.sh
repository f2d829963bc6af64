#!/usr/bin/env bash
# The issue-8 CPU measurements, one after another on a quiet machine (what bench/RESULTS.md records).
# Full-size needs ~18 GiB RAM and ~28 GiB disk under $WORK (default /tmp/fullsize).
#   bash bench/run_cpu_benchmarks.sh            # everything (~40 min on 2 cores)
#   bash bench/run_cpu_benchmarks.sh roofline   # one part: fullsize | roofline | torch | plots | peers
# peers (issue 19; not in the default list: needs checkouts of the peers, given by path):
#   FAST_DLLM=/path/to/Fast-dLLM DINFER=/path/to/dInfer bash bench/run_cpu_benchmarks.sh peers
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WORK=${WORK:-/tmp/fullsize}
parts=${*:-fullsize roofline torch plots}
for part in $parts; do
  case $part in
    fullsize)
      $PY bench/full_size.py --workdir "$WORK" --out bench/full_size.json | tee bench/full_size.log ;;
    roofline)
      $PY bench/roofline.py --out bench/roofline.json | tee bench/roofline.log ;;
    torch)
      $PY bench/compare_torch.py --out bench/compare_torch_demo.json | tee bench/compare_torch_demo.log
      $PY bench/compare_torch.py --random-preset llada-moe-7b-a1b --layers 1 --prompt-len 64 --gen-length 32 \
          --block-length 16 --num-prompts 2 --repeats 3 --out bench/compare_torch_7b_1layer.json \
          | tee bench/compare_torch_7b_1layer.log ;;
    plots)
      $PY bench/throughput_plots.py --out bench/throughput --repeats 3 | tee bench/throughput.log ;;
    peers)
      $PY bench/compare_peers.py --fast-dllm "${FAST_DLLM:?set FAST_DLLM to a Fast-dLLM checkout}" \
          --dinfer "${DINFER:?set DINFER to a dInfer checkout}" --threads 1 --repeats 5 --num-prompts 4 \
          --out bench/compare_peers.json 2>&1 | tee bench/compare_peers.log ;;
    *) echo "unknown part $part (fullsize | roofline | torch | plots | peers)" >&2; exit 2 ;;
  esac
done
