#!/usr/bin/env bash
# call 1 of a sitting with Vulkan: the CUDA build (setup.sh) and the Vulkan build, both detached
bash .gpu/setup.sh && bash .gpu/vk_build.sh
