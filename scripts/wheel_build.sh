# Sourced by setup.sh and build_patched_llama.sh: how llama-cpp-python's wheels are compiled and
# kept.
#
# CMake flags. ggml's default build (-march=native) compiles its AMX kernels on CPUs that have
# AMX, and in llama-cpp-python 0.3.36 they crash the first decode (SIGSEGV in
# ggml_backend_amx_mul_mat, seen with SmolLM2 Q4_1 on a 2-core Xeon VM with amx_int8). On x86-64
# the AMX instructions are turned off explicitly (GCC keeps explicit -mno-* flags over
# -march=native's), the rest stays native. A CMAKE_ARGS that already sets CMAKE_C_FLAGS or
# CMAKE_CXX_FLAGS is kept as given.
if [ "$(uname -m)" = x86_64 ]; then
  case " ${CMAKE_ARGS:-} " in
    *CMAKE_C_FLAGS*|*CMAKE_CXX_FLAGS*) ;;
    *)
      NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
      CMAKE_ARGS="${CMAKE_ARGS:+$CMAKE_ARGS }-DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
      ;;
  esac
fi
export CMAKE_ARGS="${CMAKE_ARGS:-}"

# Wheels are kept per (version, flavour, CMAKE_ARGS) under ${SKIPPY_LLAMA_CACHE:-~/.cache/skippy-llama}:
# pip's own wheel cache is keyed by the sdist alone, so it would hand back a wheel compiled
# elsewhere with other flags.
WHEEL_CACHE="${SKIPPY_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/skippy-llama}"

# wheel_dir VERSION FLAVOUR: the folder that keeps the wheel of (VERSION, FLAVOUR, CMAKE_ARGS)
wheel_dir() {
  printf '%s/wheels/%s-%s-%s\n' "$WHEEL_CACHE" "$1" "$2" "$(printf '%s' "$CMAKE_ARGS" | sha256sum | cut -c1-12)"
}

# has_wheel DIR: whether DIR keeps a wheel
has_wheel() { compgen -G "$1/*.whl" > /dev/null; }

# build_wheel DIR PYTHON SPEC...: build `pip wheel SPEC...` into DIR (nothing is left on failure)
build_wheel() {
  local out="$1" python="$2"
  shift 2
  echo "building llama-cpp-python ($(basename "$out"), CMAKE_ARGS='$CMAKE_ARGS'): about 5 minutes on 2 cores" >&2
  mkdir -p "$(dirname "$out")"
  rm -rf "$out.tmp"
  nice -n 10 "$python" -m pip wheel --quiet --no-deps --no-cache-dir -w "$out.tmp" "$@" >&2
  rm -rf "$out"
  mv "$out.tmp" "$out"
}
