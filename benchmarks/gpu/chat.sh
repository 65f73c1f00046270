#!/usr/bin/env bash
# issue 16's GPU figure, in the call after setup.sh: wait for the CUDA build and the 1.1B model,
# then the linear chats (CHATS tokens, ROUNDS interleaved rounds, MODES beside plain)
set -u
. .gpu/env.sh
for i in $(seq 1 110); do [ -f /tmp/build.rc ] && break; sleep 5; done
echo "cuda build rc: $(cat /tmp/build.rc 2>/dev/null || echo running)"; tail -2 /tmp/build.log
[ "$(cat /tmp/build.rc 2>/dev/null)" = 0 ] || exit 1
for i in $(seq 1 60); do grep -q "written\|done\|wrote" /tmp/make_model.log 2>/dev/null && break; sleep 2; done
tail -1 /tmp/make_model.log; ls -la /tmp/big.gguf || exit 1
python3 benchmarks/bench_gpu.py /tmp/big.gguf --sizes --chat ${CHATS:-8192 32000} --rounds ${ROUNDS:-3} \
  --chat-modes ${MODES:-skippy,skippy_l3} --out $OUT/chat.json 2>&1 | grep -v "n_ctx_seq\|hashing" | tee $OUT/chat.log | cut -c1-600 | tail -40
