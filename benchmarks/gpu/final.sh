#!/usr/bin/env bash
# last call of a short sitting: join the model, wait for the CUDA build, the given test files at
# n_gpu_layers -1 and 0 side by side (none when TESTS is empty), then bench_gpu (with KINDS:
# once per kind of host buffer, at SIZES)
set -u
. .gpu/env.sh
bash .gpu/join.sh || exit 1
for i in $(seq 1 110); do [ -f /tmp/build.rc ] && break; sleep 5; done
echo "cuda build rc: $(cat /tmp/build.rc 2>/dev/null || echo running)"; [ "$(cat /tmp/build.rc 2>/dev/null)" = 0 ] || exit 1
mkdir -p /tmp/sc && cp .gpu/force_ngl_sitecustomize.py /tmp/sc/sitecustomize.py
for ngl in -1 0; do
  [ -n "${TESTS:-}" ] || break
  PYTHONPATH=/tmp/sc:$PYTHONPATH N_GPU_LAYERS=$ngl N_BATCH=64 N_UBATCH=64 LLCPP_FORCE_NGL=$ngl LLCPP_FORCE_UBATCH=64 timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -rs $TESTS > $OUT/final_ngl$ngl.log 2>&1 &
done
wait
for f in $(ls $OUT/final_ngl*.log 2>/dev/null); do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $f | tail -8; done
if [ -z "${KINDS:-}" ]; then
  python3 benchmarks/bench_gpu.py /tmp/big.gguf --sizes 2048 8192 32000 --chat 8192 --out $OUT/gpu.json 2>&1 | grep -v "n_ctx_seq\|hashing" | tail -8
  exit
fi
for kind in $KINDS; do
  python3 benchmarks/bench_gpu.py /tmp/big.gguf --sizes ${SIZES:-8192 32000} --buffers $kind --out $OUT/gpu-$kind.json 2>&1 | grep -v "n_ctx_seq\|hashing" | tail -3 | cut -c1-400
done
