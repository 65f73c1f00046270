# Sourced by setup.sh and build_patched_llama.sh: the CMake flags llama.cpp is compiled with.
#
# ggml's default build (-march=native) compiles its AMX kernels on CPUs that have AMX, and in
# llama-cpp-python 0.3.36 they crash the first decode (SIGSEGV in ggml_backend_amx_mul_mat, seen
# with SmolLM2 Q4_1 on a 2-core Xeon VM with amx_int8). On x86-64 the AMX instructions are turned
# off explicitly (GCC keeps explicit -mno-* flags over -march=native's), the rest stays native.
# A CMAKE_ARGS that already sets CMAKE_C_FLAGS or CMAKE_CXX_FLAGS is kept as given.
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
