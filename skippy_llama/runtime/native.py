"""Thin, typed wrappers over the llama.cpp C calls the cache needs (sequence state and memory)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from ..errors import TierError
from ..hostmem import HostBuffer, fit

_GPU_BACKENDS = ("CUDA", "Metal", "Vulkan", "SYCL", "HIP", "MUSA", "CANN", "OpenCL")


def get_seq_state(ctx: Any, seq_id: int, buf: HostBuffer | None = None) -> memoryview:
    """Serialize sequence ``seq_id`` (``llama_state_seq_get_data``) into ``buf`` (see
    :func:`fit`; a fresh buffer when None): a view of the bytes written."""
    size = int(llama_cpp.llama_state_seq_get_size(ctx, seq_id))
    out = fit(buf, size)
    if size == 0:
        return memoryview(out)[:0]
    arr = (ctypes.c_uint8 * size).from_buffer(out)
    written = int(llama_cpp.llama_state_seq_get_data(ctx, arr, size, seq_id))
    if written != size:
        raise TierError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
    return memoryview(out)[:size]


def set_seq_state(ctx: Any, blob: HostBuffer, seq_id: int, size: int | None = None) -> bool:
    """Restore the first ``size`` (default all) bytes of ``blob`` into sequence ``seq_id``,
    which llama.cpp clears first; True on success."""
    size = len(blob) if size is None else size
    arr = (ctypes.c_uint8 * size).from_buffer(blob)
    return int(llama_cpp.llama_state_seq_set_data(ctx, arr, size, seq_id)) == size


def _checked_size(n: int, what: str) -> int:
    if n <= 0:
        raise TierError(f"{what} returned no state (size {n})")
    return n


def capture_range(
    ctx: Any, src: int, scratch: int, p0: int, p1: int, buf: HostBuffer | None = None
) -> memoryview:
    """Serialize only the cells of ``src`` at positions ``[p0, p1)`` into ``buf`` (host memory;
    see :func:`get_seq_state`).

    The stock API serializes whole sequences, so the cells are first shared with the empty
    ``scratch`` sequence (a unified cache shares cells without copying), serialized from there and
    unshared again: the cost follows ``p1 - p0``, not the context length.
    """
    mem = memory(ctx)
    llama_cpp.llama_memory_seq_cp(mem, src, scratch, p0, p1)
    try:
        return get_seq_state(ctx, scratch, buf)
    finally:
        llama_cpp.llama_memory_seq_rm(mem, scratch, -1, -1)


def checkpoint(ctx: Any, src: int, slot: int, n_tokens: int, *, on_device: bool = True) -> bytes:
    """Keep a copy of the first ``n_tokens`` cells of ``src`` under sequence id ``slot``.

    With ``on_device``, ``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE`` makes llama.cpp copy the K/V tensors
    into buffers the context holds for ``slot`` (VRAM on GPU builds, host RAM on CPU) and return
    only the cell metadata, which :func:`restore_checkpoint` needs. A later checkpoint of the
    same slot replaces the buffers, so only the newest metadata of a slot may ever be restored.
    Without it, the whole sequence state is returned (host memory).
    """
    mem = memory(ctx)
    flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE if on_device else 0
    llama_cpp.llama_memory_seq_cp(mem, src, slot, 0, n_tokens)
    try:
        size = _checked_size(
            int(llama_cpp.llama_state_seq_get_size_ext(ctx, slot, flags)), "checkpoint size"
        )
        buf = (ctypes.c_uint8 * size)()
        written = int(llama_cpp.llama_state_seq_get_data_ext(ctx, buf, size, slot, flags))
        if written != size:
            raise TierError(f"checkpoint of sequence {slot} wrote {written} of {size} bytes")
        return bytes(buf)
    finally:
        llama_cpp.llama_memory_seq_rm(mem, slot, -1, -1)


def restore_checkpoint(ctx: Any, meta: bytes, dst: int, *, on_device: bool = True) -> None:
    """Copy a checkpoint (see :func:`checkpoint`) into sequence ``dst``, which is cleared first."""
    buf = (ctypes.c_uint8 * len(meta)).from_buffer_copy(meta)
    flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE if on_device else 0
    read = int(llama_cpp.llama_state_seq_set_data_ext(ctx, buf, len(meta), dst, flags))
    if read != len(meta):
        raise TierError(f"restoring a checkpoint read {read} of {len(meta)} bytes")


def memory(ctx: Any) -> Any:
    mem = llama_cpp.llama_get_memory(ctx)
    if mem is None:
        raise TierError("the context has no memory module")
    return mem


def seq_cp(ctx: Any, src: int, dst: int, p0: int, p1: int) -> None:
    """Share cells ``[p0, p1)`` of ``src`` with ``dst`` (no data copy in a unified cache)."""
    llama_cpp.llama_memory_seq_cp(memory(ctx), src, dst, p0, p1)


def seq_rm(ctx: Any, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
    """Remove positions ``[p0, p1)`` of one sequence (``-1`` = open bound)."""
    return bool(llama_cpp.llama_memory_seq_rm(memory(ctx), seq_id, p0, p1))


def seq_pos_max(ctx: Any, seq_id: int) -> int:
    return int(llama_cpp.llama_memory_seq_pos_max(memory(ctx), seq_id))


@functools.cache
def ggml() -> ctypes.CDLL | None:
    """The ggml library loaded next to llama-cpp-python's libllama (``None`` if not found)."""
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml.so", "libggml.dylib", "ggml.dll"):
        if (lib_dir / name).exists():
            lib = ctypes.CDLL(str(lib_dir / name))
            for fn in ("ggml_backend_reg_get", "ggml_backend_dev_get"):
                getattr(lib, fn).restype = ctypes.c_void_p
                getattr(lib, fn).argtypes = [ctypes.c_size_t]
            for fn in ("ggml_backend_reg_name", "ggml_backend_dev_name"):
                getattr(lib, fn).restype = ctypes.c_char_p
                getattr(lib, fn).argtypes = [ctypes.c_void_p]
            lib.ggml_backend_dev_description.restype = ctypes.c_char_p
            lib.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
            lib.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
            lib.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
            lib.ggml_backend_reg_count.restype = ctypes.c_size_t
            lib.ggml_backend_dev_count.restype = ctypes.c_size_t
            return lib
    return None


def backend_name() -> str:
    """The compute backend of this llama.cpp build: ``CPU``, ``CUDA``, ``Metal``, ``Vulkan`` …

    Read from ggml's backend registry (the first non-CPU backend with a device); Vulkan, for
    one, does not show in ``llama_print_system_info``.
    """
    if not llama_cpp.llama_supports_gpu_offload():
        return "CPU"
    for name, devices in _registry():
        if name not in ("CPU", "BLAS", "RPC") and devices > 0:
            return name
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    for name in _GPU_BACKENDS:
        if f"{name} :" in info or f"{name}:" in info:
            return name
    return "GPU"


def _registry() -> list[tuple[str, int]]:
    """(name, device count) of each backend in ggml's registry; empty if ggml is not found."""
    lib = ggml()
    if lib is None:
        return []
    regs = [lib.ggml_backend_reg_get(i) for i in range(int(lib.ggml_backend_reg_count()))]
    return [
        (
            str(lib.ggml_backend_reg_name(reg).decode("utf-8", "replace")),
            int(lib.ggml_backend_reg_dev_count(reg)),
        )
        for reg in regs
    ]


def registered_backends() -> list[str]:
    """Names in ggml's backend registry (``CPU``, ``BLAS``, ``CUDA`` …); empty if unknown."""
    return [name for name, _ in _registry()]


def device_names() -> list[str]:
    """``name: description`` of every ggml backend device (the GPU model on GPU builds)."""
    lib = ggml()
    if lib is None:
        return [backend_name()]
    out = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        out.append(
            f"{lib.ggml_backend_dev_name(dev).decode()}: "
            f"{lib.ggml_backend_dev_description(dev).decode()}"
        )
    return out


def last_logits(ctx: Any, n_vocab: int) -> npt.NDArray[np.float32]:
    """A copy of the logits of the last token the context decoded (``llama_get_logits_ith(-1)``)."""
    ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float32, copy=True)
