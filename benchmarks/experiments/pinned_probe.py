"""Probe for issue 12: would pinning the host buffers speed up restores and captures on CUDA?

An L2 restore ends in ``llama_state_seq_set_data`` from a host buffer, and a capture in
``llama_state_seq_get_data`` into one; on CUDA both copy each layer's K and V between the device
and pageable host memory, which the driver stages through its own pinned buffers. This times
both calls for one sequence of ``--tokens`` tokens from the same anonymous mapping (what
``skippy_llama.hostmem`` allocates), first pageable, then after ``cudaHostRegister`` (libcudart,
loaded beside llama.cpp's CUDA backend), and reports what registering costs. The restored
sequence's next-token logits are checked against the original's, so a fast wrong copy shows.

Without libcudart (a CPU build) it times the pageable path only and says so.

Usage (on the device, after the GPU route's setup)::

    python3 benchmarks/experiments/pinned_probe.py /tmp/big.gguf --tokens 8192 32000 --out $OUT/pinned.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from skippy_llama.pinned import load_cudart

REPEATS = 5


def _logits(llm: llama_cpp.Llama, pos: int, token: int) -> np.ndarray[Any, Any]:
    """Logits of ``token`` decoded alone at ``pos`` of sequence 0."""
    batch = llama_cpp.llama_batch_init(1, 0, 1)
    try:
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0] = token, pos, 1
        batch.seq_id[0][0], batch.logits[0] = 0, True
        if llama_cpp.llama_decode(llm.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, 0)
        return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()
    finally:
        llama_cpp.llama_batch_free(batch)


def _median_ms(call: Any) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times), 2)


def probe(model: str, n_tokens: int, cudart: ctypes.CDLL | None, ngl: int) -> dict[str, Any]:
    llm = llama_cpp.Llama(
        model,
        n_ctx=n_tokens + 64,
        n_batch=2048,
        n_ubatch=512,
        n_gpu_layers=ngl,
        flash_attn=True,
        verbose=False,
    )
    mem = llama_cpp.llama_get_memory(llm.ctx)
    try:
        tokens = np.random.default_rng(0).integers(100, 20_000, n_tokens).tolist()
        llm.eval(tokens)
        size = int(llama_cpp.llama_state_seq_get_size(llm.ctx, 0))
        region = mmap.mmap(-1, size)
        view = (ctypes.c_uint8 * size).from_buffer(region)

        def get() -> None:
            if llama_cpp.llama_state_seq_get_data(llm.ctx, view, size, 0) != size:
                raise RuntimeError("get_data wrote a different size")

        def put() -> None:
            llama_cpp.llama_memory_seq_rm(mem, 0, -1, -1)
            if llama_cpp.llama_state_seq_set_data(llm.ctx, view, size, 0) != size:
                raise RuntimeError("set_data read a different size")

        def exact() -> bool:
            """The next token's logits on the restored cells equal the original's."""
            got = _logits(llm, n_tokens, tokens[-1])
            llama_cpp.llama_memory_seq_rm(mem, 0, n_tokens, -1)
            return bool(np.array_equal(got, want))

        want = _logits(llm, n_tokens, tokens[-1])
        llama_cpp.llama_memory_seq_rm(mem, 0, n_tokens, -1)
        out: dict[str, Any] = {"tokens": n_tokens, "state_bytes": size}
        out["pageable"] = {"get_ms": _median_ms(get), "set_ms": _median_ms(put), "exact": exact()}
        if cudart is not None:
            address = ctypes.addressof(view)
            started = time.perf_counter()
            rc = cudart.cudaHostRegister(ctypes.c_void_p(address), ctypes.c_size_t(size), 0)
            out["register_ms"] = round((time.perf_counter() - started) * 1e3, 2)
            out["register_rc"] = int(rc)
            if rc == 0:
                out["pinned"] = {"get_ms": _median_ms(get), "set_ms": _median_ms(put)}
                out["pinned"]["exact"] = exact()
                started = time.perf_counter()
                cudart.cudaHostUnregister(ctypes.c_void_p(address))
                out["unregister_ms"] = round((time.perf_counter() - started) * 1e3, 2)
        return out  # the mapping goes with the closures that view it
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="GGUF (on the device: /tmp/big.gguf, the 1.1B F16 model)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32000])
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: print only)")
    args = parser.parse_args()
    cudart = load_cudart()
    results = {
        "cudart": cudart is not None,
        "runs": [probe(args.model, n, cudart, args.n_gpu_layers) for n in args.tokens],
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
