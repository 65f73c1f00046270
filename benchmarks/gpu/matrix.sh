#!/usr/bin/env bash
# the small traffic matrix on CPU (n_gpu_layers 0) and CUDA (full offload), with portability
set -u
. .gpu/env.sh
python3 -m skippy_llama.cli.main matrix --small --threads 16 --portability --out $OUT/matrix-cuda-small 2>&1 | tee $OUT/matrix.log | tail -40
