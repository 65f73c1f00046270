# sourced on the GPU machine from the repo root
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
export PYTHONPATH=${LLCPP_DIR:-/tmp/llcpp}:/tmp/site:$PWD:/tmp/smolpkg
export XDG_CACHE_HOME=/tmp/xdg
