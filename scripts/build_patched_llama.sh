#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 with skippy-llama's native patch queue (patches/series) applied.
#
#   scripts/build_patched_llama.sh            build (or reuse) the patched wheel; prints its path last
#   scripts/build_patched_llama.sh apply DIR  unpack a fresh sdist into DIR and apply the queue only
#
# CPU by default; pass the backend through CMAKE_ARGS as for a plain llama-cpp-python install, e.g.
#   CMAKE_ARGS="-DGGML_CUDA=on" | "-DGGML_VULKAN=on" | "-DGGML_METAL=on"
# Install the result with: .venv/bin/pip install --force-reinstall --no-deps "$(scripts/build_patched_llama.sh | tail -1)"
#
# Idempotent and cached: the sdist is downloaded once, and a wheel is kept per (patch-queue digest,
# CMAKE_ARGS) under ${SKIPPY_LLAMA_CACHE:-~/.cache/skippy-llama} (scripts/wheel_build.sh); a changed patch
# builds a new one.
# The queue digest is compiled into the library (skippy_patch_queue_sha256), so the runtime can match
# the loaded library against roster/split-certified.json exactly.
# Environment: PYTHON (default python3) builds; CMAKE_BUILD_PARALLEL_LEVEL (default 2); LLCPP_SDIST
# an sdist archive already on disk (.tar.gz or .tar.xz whose top folder is llama_cpp_python-VERSION),
# used instead of downloading one (offline machines: benchmarks/gpu/run.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
. "$ROOT/scripts/wheel_build.sh"
CACHE="$WHEEL_CACHE"

roster() { PYTHONPATH="$ROOT" "$PYTHON" -c "import skippy_llama.roster as r; print($1)"; }
VERSION="$(roster r.LLAMA_CPP_PYTHON_VERSION)"
DIGEST="$(roster 'r.queue_digest()')"
SDIST="${LLCPP_SDIST:-$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz}"

fetch_sdist() {
  if [ ! -f "$SDIST" ]; then
    echo "build_patched_llama: downloading the llama-cpp-python==$VERSION sdist" >&2
    mkdir -p "$CACHE/sdist"
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$CACHE/sdist"
  fi
}

# unpack a fresh sdist into $1 and apply the series; fails loudly on any patch that does not apply
apply_queue() {
  local dest="$1" src
  if ! command -v patch > /dev/null; then
    echo "build_patched_llama: patch(1) is not installed (e.g. apt-get install patch)" >&2
    return 1
  fi
  fetch_sdist
  mkdir -p "$dest"
  tar -xf "$SDIST" -C "$dest"
  src="$dest/llama_cpp_python-$VERSION"
  while IFS= read -r name || [ -n "$name" ]; do
    case "$name" in ''|'#'*) continue ;; esac
    # --fuzz=0: a patch applies exactly or not at all
    if ! (cd "$src" && patch -p1 --batch --fuzz=0 --dry-run --quiet < "$ROOT/patches/$name" > /dev/null); then
      echo "build_patched_llama: patches/$name does not apply to llama-cpp-python $VERSION" >&2
      return 1
    fi
    (cd "$src" && patch -p1 --batch --fuzz=0 --quiet < "$ROOT/patches/$name" >&2)
  done < "$ROOT/patches/series"
  printf '#pragma once\n// written by skippy-llama scripts/build_patched_llama.sh\n#define SKIPPY_PATCH_QUEUE_SHA256 "%s"\n' \
    "$DIGEST" > "$src/vendor/llama.cpp/src/skippy-queue.h"
  echo "$src"
}

if [ "${1:-}" = "apply" ]; then
  [ $# -eq 2 ] || { echo "usage: $0 apply DIR" >&2; exit 2; }
  apply_queue "$2"
  exit 0
fi
[ $# -eq 0 ] || { echo "usage: $0 [apply DIR]" >&2; exit 2; }

OUT="$(wheel_dir "$VERSION" "${DIGEST:0:16}")"
if has_wheel "$OUT"; then
  echo "build_patched_llama: reusing the cached wheel for queue ${DIGEST:0:12}" >&2
else
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
  SRC="$(apply_queue "$WORK" | tail -1)"
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" build_wheel "$OUT" "$PYTHON" "$SRC"
fi
ls "$OUT"/*.whl | head -1
