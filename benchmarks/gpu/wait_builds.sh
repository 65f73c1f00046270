#!/usr/bin/env bash
# wait (up to $1 s) for the detached CUDA and Vulkan builds; print their ends
for i in $(seq 1 $(( ${1:-400} / 5 ))); do [ -f /tmp/build.rc ] && [ -f /tmp/vkbuild.rc ] && break; sleep 5; done
echo "cuda build rc: $(cat /tmp/build.rc 2>/dev/null || echo running)"; tail -2 /tmp/build.log
echo "vulkan build rc: $(cat /tmp/vkbuild.rc 2>/dev/null || echo running)"; tail -4 /tmp/vkbuild.log
ls -la /tmp/big.gguf 2>&1
