#!/usr/bin/env bash
# The test install's time and venv size in fresh python3 venvs (README "Quick start"):
#   plain    pip install -e '.[test]'  (PyPI's torch: the CUDA build and its nvidia-* wheels)
#   readme   the README's install command: torch from torch's CPU index, then .[test]
#   ci       .ci/run's install lines (torch's CPU build first), with .[test] and with .[test,tpu]
# Usage: bash bench/install_size.sh [WORKDIR]  (default: a new temporary folder; needs ~12 GB free).
# pip's cache is off, so downloads are counted; the times depend on the network.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
mkdir -p "$work" && cd "$work" || exit 1
git -C "$root" archive HEAD | tar -x -C "$work"  # a clean copy: the egg-info and .venv stay out of the checkout
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
report() {  # name seconds rc
  echo "$1: rc=$3 seconds=$2 size=$(du -sh .venv | cut -f1)" \
       "torch=$(.venv/bin/python -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)" \
       "nvidia_wheels=$(.venv/bin/pip list 2>/dev/null | grep -ci '^nvidia')"
}
rm -rf .venv && python3 -m venv .venv
t0=$(date +%s)
.venv/bin/pip install -q -e '.[test]' > plain.log 2>&1; rc=$?
report "plain .[test]" $(( $(date +%s) - t0 )) $rc
rm -rf .venv && python3 -m venv .venv
t0=$(date +%s)
readme=$(grep -m1 -o "pip install torch --index-url [^&]*&& pip install -e '.\[test\]'" README.md)
(PATH=$PWD/.venv/bin:$PATH; eval "$readme") > readme.log 2>&1; rc=$?
report "readme: $readme" $(( $(date +%s) - t0 )) $rc
sed -n '/^rm -rf .venv$/,/^.venv\/bin\/pip install -q -e/p' .ci/run > ci_install.sh
for extras in test test,tpu; do
  sed "s/\.\[test,tpu\]/.[$extras]/" ci_install.sh > "ci_install_$extras.sh"
  t0=$(date +%s)
  bash -e "ci_install_$extras.sh" > "ci_$extras.log" 2>&1; rc=$?
  report "ci .[$extras]" $(( $(date +%s) - t0 )) $rc
done
