# Sourced by setup.sh and build_patched_llama.sh: the CMake flags llama.cpp is compiled with.
#
# ggml's default (-march=native) compiles its AMX kernels on CPUs that have AMX, and in
# llama-cpp-python 0.3.36 they crash the first decode (SIGSEGV in ggml_backend_amx_mul_mat, seen
# with SmolLM2 Q4_1 on a 2-core Xeon VM with amx_int8). On x86-64 the default here is the portable
# x86-64-v3 build (AVX2, FMA, F16C; -DGGML_NATIVE=OFF), which runs on every CPU CI and users have,
# so a cached wheel stays valid on another machine. A CMAKE_ARGS that names GGML_NATIVE is kept.
if [ "$(uname -m)" = x86_64 ]; then
  case " ${CMAKE_ARGS:-} " in
    *GGML_NATIVE*) ;;
    *) CMAKE_ARGS="${CMAKE_ARGS:+$CMAKE_ARGS }-DGGML_NATIVE=OFF" ;;
  esac
fi
export CMAKE_ARGS="${CMAKE_ARGS:-}"
