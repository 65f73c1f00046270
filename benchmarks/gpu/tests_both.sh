#!/usr/bin/env bash
# the integration files with n_gpu_layers -1 and 0 side by side (correctness only: no timings)
set -u
export TESTS="${TESTS:-tests/integration/test_skippy_llama.py tests/integration/test_dropin.py tests/integration/test_restore_exact.py tests/integration/test_l3_runtime.py tests/integration/test_tier_interplay.py tests/integration/test_identity_misses.py tests/integration/test_run_cli.py tests/integration/test_kvcache_cli.py tests/integration/test_batch.py tests/integration/test_package_runtime.py}"
bash .gpu/tests.sh -1 ${1:-540} > /dev/null &
bash .gpu/tests.sh 0 ${1:-540} > /dev/null &
wait
for f in $OUT/tests_ngl*.log; do echo "== $f"; grep -E "passed|failed|FAILED|ERROR" $f | tail -14; done
