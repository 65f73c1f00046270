#!/usr/bin/env bash
# unpack the Vulkan loader, headers, SPIRV-Headers and glslc (Debian trixie .debs carried in
# .gpuvk) and start a Vulkan build of llama-cpp-python detached into /tmp/llcpp-vk
set -u
dpkg -x .gpuvk/libvulkan1_*.deb / && ldconfig
mkdir -p /opt/vk && for f in .gpuvk/*.deb; do dpkg -x "$f" /opt/vk; done
export PATH=/opt/vk/usr/bin:$PATH LD_LIBRARY_PATH=/opt/vk/usr/lib/x86_64-linux-gnu
glslc --version | head -1 || exit 1
ls /usr/local/nvidia/share/vulkan/icd.d/ 2>&1
rm -rf /tmp/pkg-vk && cp -r /tmp/pkg /tmp/pkg-vk && rm -f /tmp/vkbuild.rc
setsid nohup env -u LD_PRELOAD bash -c 'CMAKE_ARGS="-DGGML_VULKAN=on -DLLAVA_BUILD=off -DVulkan_INCLUDE_DIR=/opt/vk/usr/include -DVulkan_LIBRARY=/usr/lib/x86_64-linux-gnu/libvulkan.so.1 -DVulkan_GLSLC_EXECUTABLE=/opt/vk/usr/bin/glslc -DCMAKE_PREFIX_PATH=/opt/vk/usr" CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/llcpp-vk /tmp/pkg-vk > /tmp/vkbuild.log 2>&1; echo $? > /tmp/vkbuild.rc' > /dev/null 2>&1 < /dev/null &
echo "vulkan build started"
