"""ctypes bindings to skippy-llama's patched llama.cpp calls (``patches/``), absent on a stock build.

The symbols are looked up by name on the shared library llama_cpp already loaded, so a stock
wheel simply reports :func:`abi_version` ``None`` and every caller keeps to the stock state API.
:func:`range_export` writes the sequence state of the cells with positions in ``[p0, p1)`` in the
stock format (``skippy_llama.state`` parses and cuts it); :func:`append_import` adds a blob's cells
after a sequence's last position and refuses, changing nothing, when the positions do not continue.
Whether a loaded model may use them is the roster's decision (:mod:`skippy_llama.runtime.recipe`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import llama_cpp
from llama_cpp import llama_cpp as _bindings

from ..errors import TierError
from ..hostmem import HostBuffer, fit


@dataclass(frozen=True)
class _Calls:
    abi_version: Any
    queue_sha256: Any
    range_get_size: Any
    range_get_data: Any
    append_data: Any


@functools.cache
def _calls() -> _Calls | None:
    lib = _bindings._lib
    try:
        calls = _Calls(
            lib.skippy_abi_version,
            lib.skippy_patch_queue_sha256,
            lib.skippy_state_seq_range_get_size,
            lib.skippy_state_seq_range_get_data,
            lib.skippy_state_seq_append_data,
        )
    except AttributeError:
        return None
    calls.abi_version.argtypes = []
    calls.abi_version.restype = ctypes.c_int32
    calls.queue_sha256.argtypes = []
    calls.queue_sha256.restype = ctypes.c_char_p
    ctx, seq, pos, size = (
        llama_cpp.llama_context_p_ctypes,
        llama_cpp.llama_seq_id,
        llama_cpp.llama_pos,
        ctypes.c_size_t,
    )
    u8p = ctypes.POINTER(ctypes.c_uint8)
    calls.range_get_size.argtypes = [ctx, seq, pos, pos]
    calls.range_get_size.restype = size
    calls.range_get_data.argtypes = [ctx, u8p, size, seq, pos, pos]
    calls.range_get_data.restype = size
    calls.append_data.argtypes = [ctx, u8p, size, seq]
    calls.append_data.restype = size
    return calls


def abi_version() -> int | None:
    """The skippy ABI version of the loaded llama.cpp library; None for a stock build."""
    calls = _calls()
    return None if calls is None else int(calls.abi_version())


def queue_sha256() -> str | None:
    """The patch-queue digest the loaded library was built from ("" if unrecorded; None if stock)."""
    calls = _calls()
    if calls is None:
        return None
    raw = calls.queue_sha256()
    return raw.decode("ascii", "replace") if raw else ""


def _require() -> _Calls:
    calls = _calls()
    if calls is None:
        raise TierError("the loaded llama.cpp library has no skippy patches (stock build)")
    return calls


def range_export_size(ctx: Any, seq_id: int, p0: int, p1: int) -> int:
    """Bytes :func:`range_export` would write (0: the cache type does not support it)."""
    return int(_require().range_get_size(ctx, seq_id, p0, p1))


def range_export(
    ctx: Any, seq_id: int, p0: int, p1: int, buf: HostBuffer | None = None
) -> memoryview:
    """The state of ``seq_id``'s cells with positions in ``[p0, p1)`` (``p1 < 0``: to the end),
    written into ``buf`` (see :func:`~skippy_llama.hostmem.fit`; a fresh buffer when None).

    Raises :class:`TierError` when the library cannot export (stock build, unsupported cache type).
    """
    calls = _require()
    size = int(calls.range_get_size(ctx, seq_id, p0, p1))
    if size == 0:
        raise TierError(f"range export of sequence {seq_id} [{p0}, {p1}) is not supported here")
    out = fit(buf, size)
    arr = (ctypes.c_uint8 * size).from_buffer(out)
    written = int(calls.range_get_data(ctx, arr, size, seq_id, p0, p1))
    if written != size:
        raise TierError(f"skippy_state_seq_range_get_data wrote {written} of {size} bytes")
    return memoryview(out)[:size]


def append_import(ctx: Any, blob: bytes | bytearray | memoryview, seq_id: int) -> bool:
    """Add ``blob``'s cells to ``seq_id`` after its last position; False (nothing changed) if refused.

    Refused when the blob's positions are not exactly ``last + 1 …``, when its layout does not
    match the context, or when the cache type has no append.
    """
    calls = _require()
    n = len(blob)
    if n == 0:
        return False
    view = memoryview(blob)
    if view.readonly:
        # ctypes cannot point into read-only memory without a copy
        arr = (ctypes.c_uint8 * n).from_buffer_copy(view)
    else:
        arr = (ctypes.c_uint8 * n).from_buffer(view)
    return int(calls.append_data(ctx, arr, n, seq_id)) == n
