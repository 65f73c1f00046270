"""Thin, typed wrappers over the llama.cpp C calls the cache needs (sequence state and memory)."""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp

from ..errors import TierError

_GPU_BACKENDS = ("CUDA", "Metal", "Vulkan", "SYCL", "HIP", "MUSA", "CANN", "OpenCL")


def get_seq_state(ctx: Any, seq_id: int) -> bytearray:
    """Serialize sequence ``seq_id`` (``llama_state_seq_get_data``) into a fresh buffer."""
    size = int(llama_cpp.llama_state_seq_get_size(ctx, seq_id))
    buf = bytearray(size)
    if size == 0:
        return buf
    arr = (ctypes.c_uint8 * size).from_buffer(buf)
    written = int(llama_cpp.llama_state_seq_get_data(ctx, arr, size, seq_id))
    if written != size:
        raise TierError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
    return buf


def set_seq_state(ctx: Any, blob: bytearray, seq_id: int) -> bool:
    """Restore ``blob`` into sequence ``seq_id`` (which llama.cpp clears first); True on success."""
    arr = (ctypes.c_uint8 * len(blob)).from_buffer(blob)
    return int(llama_cpp.llama_state_seq_set_data(ctx, arr, len(blob), seq_id)) == len(blob)


def memory(ctx: Any) -> Any:
    mem = llama_cpp.llama_get_memory(ctx)
    if mem is None:
        raise TierError("the context has no memory module")
    return mem


def seq_cp(ctx: Any, src: int, dst: int, p0: int, p1: int) -> None:
    """Share cells ``[p0, p1)`` of ``src`` with ``dst`` (no data copy in a unified cache)."""
    llama_cpp.llama_memory_seq_cp(memory(ctx), src, dst, p0, p1)


def copy_stream(ctx: Any, src: int, dst: int, keep: int) -> None:
    """Make sequence ``dst`` a copy of the first ``keep`` positions of ``src``.

    Each sequence has its own KV stream, so this copies the whole stream buffer (on the device,
    at the next decode) and then trims: every cell keeps its index, which keeps attention's
    summation order, and so the logits, identical to those of a cold prefill.
    """
    llama_cpp.llama_memory_seq_cp(memory(ctx), src, dst, -1, -1)
    llama_cpp.llama_memory_seq_rm(memory(ctx), dst, keep, -1)


def seq_rm(ctx: Any, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
    """Remove positions ``[p0, p1)`` of one sequence (``-1`` = open bound)."""
    return bool(llama_cpp.llama_memory_seq_rm(memory(ctx), seq_id, p0, p1))


def seq_pos_max(ctx: Any, seq_id: int) -> int:
    return int(llama_cpp.llama_memory_seq_pos_max(memory(ctx), seq_id))


def backend_name() -> str:
    """The compute backend of this llama.cpp build: ``CPU``, ``CUDA``, ``Metal``, ``Vulkan`` …"""
    if not llama_cpp.llama_supports_gpu_offload():
        return "CPU"
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    for name in _GPU_BACKENDS:
        if f"{name} :" in info or f"{name}:" in info:
            return name
    return "GPU"
