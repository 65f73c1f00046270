#!/usr/bin/env bash
# after vk_build.sh: the small matrix (CPU + Vulkan, with portability) and the 1.1B matrix on the
# Vulkan build; both reports come back as one tarball (the device returns at most 8 files)
set -u
for f in .gl/*.deb; do case $f in *libvulkan1*) ;; *) dpkg -x "$f" / ;; esac; done; ldconfig
for i in $(seq 1 100); do [ -f /tmp/vkbuild.rc ] && break; sleep 5; done
echo "vulkan build rc: $(cat /tmp/vkbuild.rc 2>/dev/null || echo running)"; tail -2 /tmp/vkbuild.log
export LLCPP_DIR=/tmp/llcpp-vk
. .gpu/env.sh
mkdir -p /tmp/vkout
python3 -m skippy_llama.cli.main matrix --small --threads 16 --portability --out /tmp/vkout/matrix-vulkan-small > /tmp/vkout/matrix-vulkan-small.log 2>&1
tail -14 /tmp/vkout/matrix-vulkan-small.log
python3 -m skippy_llama.cli.main matrix --model /tmp/big.gguf --backends Vulkan --doc-tickets 150 --n-ctx 16384 --n-batch 512 --page-tokens 512 --flash-attn on --out /tmp/vkout/matrix-vulkan-1b > /tmp/vkout/matrix-vulkan-1b.log 2>&1
tail -14 /tmp/vkout/matrix-vulkan-1b.log
tar czf $OUT/vulkan-matrices.tgz -C /tmp/vkout .
