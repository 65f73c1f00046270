"""ctypes bindings to skippy-llama's patched llama.cpp calls (``patches/``), absent on a stock build.

The symbols are looked up by name on the shared library llama_cpp already loaded, so a stock
wheel simply reports :func:`abi_version` ``None`` and every caller keeps to the stock state API.
:func:`range_export` writes the sequence state of the cells with positions in ``[p0, p1)`` in the
stock format (``skippy_llama.state`` parses and cuts it); :func:`append_import` adds a blob's cells
after a sequence's last position and refuses, changing nothing, when the positions do not continue.
:func:`kv_layers`, :func:`cells_get` and :func:`cells_set` (ABI 2, patch 0006) move a sequence's K/V
cells per layer between the KV tensors and host memory laid out as those tensors are (the L2 arena,
:mod:`skippy_llama.tiers.arena`), without the state format.
Whether a loaded model may use them is the roster's decision (:mod:`skippy_llama.runtime.recipe`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt
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


class KVLayerInfo(ctypes.Structure):
    """``skippy_kv_layer``: one KV layer of the context's cache (patch 0006)."""

    _fields_ = [
        ("type_k", ctypes.c_int32),
        ("type_v", ctypes.c_int32),
        ("k_row", ctypes.c_uint64),
        ("v_row", ctypes.c_uint64),
        ("v_elem", ctypes.c_uint32),
        ("n_embd_v", ctypes.c_uint32),
        ("v_trans", ctypes.c_uint32),
        ("n_cells", ctypes.c_uint32),
    ]


class KVSpan(ctypes.Structure):
    """``skippy_kv_span``: a run of consecutive positions and, per layer, where its K and V rows
    are in host memory (transposed V: rows ``v_row_cells`` elements apart)."""

    _fields_ = [
        ("n_cells", ctypes.c_uint32),
        ("v_row_cells", ctypes.c_uint32),
        ("k", ctypes.POINTER(ctypes.c_void_p)),
        ("v", ctypes.POINTER(ctypes.c_void_p)),
    ]


@dataclass(frozen=True)
class HostSpan:
    """A span as :func:`cells_set` / :func:`cells_get` take it: ``n_cells`` positions, the
    address of their first K row and first V element per layer (uint64 arrays, one entry per
    layer), and the cells per transposed V row of the host memory."""

    n_cells: int
    k: npt.NDArray[np.uint64]
    v: npt.NDArray[np.uint64]
    v_row_cells: int


@dataclass(frozen=True)
class _LayerCalls:
    kv_layers: Any
    cells_get: Any
    cells_set: Any


@functools.cache
def _layer_calls() -> _LayerCalls | None:
    calls = _calls()
    if calls is None or int(calls.abi_version()) < 2:
        return None
    lib = _bindings._lib
    try:
        out = _LayerCalls(lib.skippy_kv_layers, lib.skippy_kv_cells_get, lib.skippy_kv_cells_set)
    except AttributeError:
        return None
    ctx, seq, pos = llama_cpp.llama_context_p_ctypes, llama_cpp.llama_seq_id, llama_cpp.llama_pos
    out.kv_layers.argtypes = [ctx, ctypes.POINTER(KVLayerInfo), ctypes.c_int32]
    out.kv_layers.restype = ctypes.c_int32
    for fn in (out.cells_get, out.cells_set):
        fn.argtypes = [ctx, seq, pos, ctypes.POINTER(KVSpan), ctypes.c_int32]
        fn.restype = ctypes.c_int32
    return out


def has_layer_copies() -> bool:
    """Whether the loaded library has the per-layer cell copies (patch 0006, ABI 2)."""
    return _layer_calls() is not None


def kv_layers(ctx: Any) -> list[KVLayerInfo] | None:
    """The KV layers of the context's cache; None when the library or the cache type has no
    per-layer cell copies."""
    calls = _layer_calls()
    if calls is None:
        return None
    n = int(calls.kv_layers(ctx, None, 0))
    if n <= 0:
        return None
    out = (KVLayerInfo * n)()
    if int(calls.kv_layers(ctx, out, n)) != n:
        return None
    return list(out)


def _spans(spans: list[HostSpan]) -> Any:
    arr = (KVSpan * len(spans))()
    for dst, span in zip(arr, spans, strict=True):
        dst.n_cells = span.n_cells
        dst.v_row_cells = span.v_row_cells
        dst.k = ctypes.cast(span.k.ctypes.data, ctypes.POINTER(ctypes.c_void_p))
        dst.v = ctypes.cast(span.v.ctypes.data, ctypes.POINTER(ctypes.c_void_p))
    return arr


def _layer_require() -> _LayerCalls:
    calls = _layer_calls()
    if calls is None:
        raise TierError("the loaded llama.cpp library has no per-layer cell copies (patch 0006)")
    return calls


def cells_set(ctx: Any, seq_id: int, p0: int, spans: list[HostSpan]) -> bool:
    """Add cells at positions ``p0 ...`` to ``seq_id`` and copy their K/V from ``spans``' host
    memory (one copy per layer and K/V per run of cache cells); False (nothing changed) when
    refused: ``p0`` does not continue the sequence, too few free cells, another cache type.

    The caller keeps ``spans``' arrays and the memory they point at alive for the call."""
    calls = _layer_require()
    if not spans:
        return True
    return int(calls.cells_set(ctx, seq_id, p0, _spans(spans), len(spans))) == 0


def cells_get(ctx: Any, seq_id: int, p0: int, spans: list[HostSpan]) -> bool:
    """Copy the K/V of ``seq_id``'s cells at positions ``p0 ...`` into ``spans``' host memory;
    False when refused (a position is missing, another cache type)."""
    calls = _layer_require()
    if not spans:
        return True
    return int(calls.cells_get(ctx, seq_id, p0, _spans(spans), len(spans))) == 0


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
