#!/usr/bin/env bash
# guidellm (vLLM's load generator, the tool vLLM / SGLang users benchmark with) against `dinfer-jax serve`.
#
#   bash bench/guidellm.sh [--smoke] [--scheduler continuous|static] [--model DIR] [--streams 1,8,32]
#
# Installs guidellm (pinned) into bench/.venv-guidellm on first use, starts the server on a free port
# with --warmup (prompts up to 96 tokens; the demo model unless --model), waits for /health, runs guidellm's concurrent
# profile once per stream count on synthetic prompts (8 prompt tokens, 16 output tokens), writes
# bench/guidellm_<scheduler>.json (guidellm's own report) and prints the summary table
# (bench/guidellm_summary.py). --smoke: one stream count (4), 20 requests, and a non-zero exit when
# any request errored or went unanswered (the CI check that guidellm can drive the server).
set -euo pipefail
cd "$(dirname "$0")/.."
GUIDELLM_VERSION=0.8.1
SMOKE=0; SCHED=continuous; MODEL=""; STREAMS=1,8,32; REQUESTS=200
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1; STREAMS=4; REQUESTS=20; shift ;;
    --scheduler) SCHED=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --streams) STREAMS=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-.venv/bin/python}
VENV=bench/.venv-guidellm
if [ ! -x "$VENV/bin/guidellm" ]; then
  python3 -m venv "$VENV"
  # guidellm depends on torch: its CPU build first (as .ci/run does), not PyPI's CUDA build (6 GB)
  if "$VENV/bin/python" -c "import urllib.request; urllib.request.urlopen('https://download.pytorch.org/whl/cpu/torch/', timeout=20)" 2>/dev/null; then
    "$VENV/bin/pip" install -q torch --index-url https://download.pytorch.org/whl/cpu
  else
    "$VENV/bin/pip" install -q "${TORCH_CPU_LOCAL:-torch==2.13.0+cpu}" || echo "no CPU torch wheel: guidellm takes PyPI's torch" >&2
  fi
  "$VENV/bin/pip" install -q "guidellm==$GUIDELLM_VERSION"
fi
PORT=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
MODEL_DIR=${MODEL:-$("$PY" -c "from dinfer_jax.checkpoint import DEMO_MODEL_DIR; print(DEMO_MODEL_DIR)")}
LOG=$(mktemp)
JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} "$PY" -m dinfer_jax.cli serve --model "$MODEL_DIR" --port "$PORT" \
  --scheduler "$SCHED" --max-batch 16 --warmup --warmup-max-tokens 16 --warmup-prompt-len 96 --default-max-tokens 16 >"$LOG" 2>&1 &
SERVER=$!
trap 'rc=$?; kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; exit $rc' EXIT
for _ in $(seq 600); do
  if "$PY" -c "import sys, urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; then
    break
  fi
  if ! kill -0 $SERVER 2>/dev/null; then echo "the server exited:" >&2; tail -20 "$LOG" >&2; exit 1; fi
  sleep 0.5
done
SUFFIX=""; EXPECT=()
if [ $SMOKE = 1 ]; then SUFFIX=_smoke; EXPECT=(--expect "$REQUESTS"); fi
OUT=bench/guidellm_${SCHED}${SUFFIX}.json
(cd bench && "$OLDPWD/$VENV/bin/guidellm" run \
  --backend "kind=openai_http,target=http://127.0.0.1:$PORT" \
  --profile "kind=concurrent,streams=${STREAMS%%,*}" --override profile.streams "$STREAMS" \
  --constraint "kind=max_requests,count=$REQUESTS" \
  --data "kind=synthetic_text,prompt_tokens=8,output_tokens=16" \
  --tokenizer "kind=hf_auto,model=$MODEL_DIR" \
  --output "kind=json,path=$OLDPWD/$OUT" --disable-console-interactive >/dev/null)
"$PY" bench/guidellm_summary.py "$OUT" "${EXPECT[@]}"
