#!/usr/bin/env bash
# run the integration suite on CUDA with n_gpu_layers forced to $1 (n_batch = n_ubatch = 64)
set -u
. .gpu/env.sh
mkdir -p /tmp/sc && cp .gpu/force_ngl_sitecustomize.py /tmp/sc/sitecustomize.py
export PYTHONPATH=/tmp/sc:$PYTHONPATH
ngl=$1
LLCPP_FORCE_NGL=$ngl LLCPP_FORCE_UBATCH=64 timeout ${2:-260} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/integration} 2>&1 | tee $OUT/tests_ngl$ngl.log | grep -E "passed|failed|FAILED" | tail -40
