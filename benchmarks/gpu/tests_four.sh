#!/usr/bin/env bash
# the whole integration suite on CUDA, n_gpu_layers -1 and 0, each in two lanes (four pytest
# processes side by side; correctness only: no timings). $1: seconds per lane; GROUPS_SEL=1 or 2
# runs one half. N_GPU_LAYERS/N_BATCH/N_UBATCH reach `skippy-llama serve`'s model through
# llama_cpp.server's settings (it passes them explicitly, so the sitecustomize's defaults miss it)
set -u
. .gpu/env.sh
mkdir -p /tmp/sc && cp .gpu/force_ngl_sitecustomize.py /tmp/sc/sitecustomize.py
export PYTHONPATH=/tmp/sc:$PYTHONPATH
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl 2>/dev/null
T=tests/integration
G1="$T/test_l3_runtime.py $T/test_server.py $T/test_package_cli.py $T/test_l3_crash.py $T/test_swa_l1.py $T/test_restore_exact.py $T/test_matrix.py $T/test_trace_replay.py $T/test_cross_backend.py $T/test_server_page.py $T/test_native_ext.py $T/test_append_runtime.py $T/test_differential.py $T/test_deferred_record.py $T/test_split_probe.py"
G2="$T/test_kvcache_cli.py $T/test_dropin.py $T/test_identity_misses.py $T/test_skippy_llama.py $T/test_l3_damaged_cli.py $T/test_simulate_cli.py $T/test_batch.py $T/test_tier_interplay.py $T/test_native_verdict_cli.py $T/test_package_runtime.py $T/test_run_cli.py $T/test_bench_overhead_workloads.py $T/test_prepare_turn.py"
for ngl in -1 0; do
  for g in ${GROUPS_SEL:-1 2}; do
    eval files=\$G$g
    N_GPU_LAYERS=$ngl N_BATCH=64 N_UBATCH=64 LLCPP_FORCE_NGL=$ngl LLCPP_FORCE_UBATCH=64 timeout ${1:-560} python3 -m pytest -q -p no:cacheprovider -rs $files > $OUT/tests_ngl${ngl}_g$g.log 2>&1 &
  done
done
wait
for f in $OUT/tests_ngl*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $f | tail -12; done
