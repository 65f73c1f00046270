"""Parse and build llama.cpp sequence-state blobs (``llama_state_seq_get_data`` output).

The format (llama.cpp vendored in llama-cpp-python 0.3.36), all little-endian::

    u32 magic 0xaf143cd8, i32 seq_id, u32 n_stream
    per stream: u32 cell_count (0 -> next stream)
      per cell: i32 pos, u32 n_seq_id (=1), [cell ext], i32 seq_id
      u32 v_trans, u32 n_layer
      per layer K: i32 type, u64 row_bytes, row_bytes * cells
      V rows (v_trans 0): i32 type, u64 row_bytes, row_bytes * cells
      V transposed (v_trans 1): i32 type, u32 elem_bytes, u32 n_embd, n_embd * (elem_bytes * cells)

A sliding-window model's memory is ``llama_kv_cache_iswa`` (``llama-kv-cache-iswa.cpp``,
``state_write``): two caches each write the part from ``n_stream`` on, the full-attention
layers' cache first, then the sliding-window layers' cache, which holds only the cells inside
the window. :func:`parse_state` reads one section (what pages hold) and refuses a second;
:func:`parse_sections` reads every section and :func:`parse_layout` the layout of either kind.

Parsing never copies the K/V payload: :class:`SequenceState` holds numpy views into the blob.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import StateFormatError
from .layout import KVLayout, LayerLayout

STATE_MAGIC = 0xAF143CD8
#: Version of the llama.cpp sequence-state format this module reads (bumped if llama.cpp changes it).
STATE_FORMAT_VERSION = 1

U8 = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class SequenceState:
    """One sequence's KV state, parsed.

    Attributes:
        seq_id: the sequence id recorded in the blob (ignored by llama.cpp on restore).
        layout: the byte layout (row types and sizes per layer, v_trans, streams).
        positions: position of each cell, in blob (cell-index) order.
        ext: per-cell extension bytes, shape (cells, layout.ext_bytes).
        k: per layer, K rows of shape (cells, k_row).
        v: per layer, V rows of shape (cells, v_row), or transposed V of shape (v_embd, cells * elem).
        first: the position the cells must start at: 0 for a whole sequence, ``p0`` for the
            cells ``[p0, p1)`` of a range capture.
    """

    seq_id: int
    layout: KVLayout
    positions: npt.NDArray[np.int32]
    ext: U8
    k: tuple[U8, ...]
    v: tuple[U8, ...]
    first: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.positions)

    def order(self) -> npt.NDArray[np.intp] | None:
        """The permutation that sorts cells by position, or ``None`` when already sorted.

        Raises:
            StateFormatError: positions are not exactly ``first .. first + n - 1``.
        """
        pos = self.positions
        n = len(pos)
        if n == 0:
            return None
        want = np.arange(self.first, self.first + n, dtype=np.int64)
        if np.array_equal(pos, want):
            return None
        order = np.argsort(pos, kind="stable")
        if not np.array_equal(pos[order], want):
            raise StateFormatError(
                f"positions of sequence {self.seq_id} are not contiguous from {self.first}: "
                f"min {int(pos.min())}, max {int(pos.max())}, {n} cells"
            )
        return order


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.off = 0

    def take(self, fmt: str, what: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        if self.off + size > len(self.buf):
            raise StateFormatError(
                f"state blob truncated reading {what} at byte {self.off} (blob is {len(self.buf)} bytes)"
            )
        values = struct.unpack_from(fmt, self.buf, self.off)
        self.off += size
        return values

    def array(self, n_bytes: int, what: str) -> U8:
        if n_bytes < 0 or self.off + n_bytes > len(self.buf):
            raise StateFormatError(
                f"state blob truncated in {what}: need {n_bytes} bytes at byte {self.off}, "
                f"blob is {len(self.buf)} bytes"
            )
        out = np.frombuffer(self.buf, dtype=np.uint8, count=n_bytes, offset=self.off)
        self.off += n_bytes
        return out


def parse_state(
    blob: bytes | bytearray | memoryview, ext_bytes: int = 0, *, first: int = 0
) -> SequenceState:
    """Parse a sequence-state blob into zero-copy views.

    Args:
        blob: bytes from ``llama_state_seq_get_data``.
        ext_bytes: bytes of ``llama_kv_cell_ext`` per cell (12 for M-RoPE/PLE models, else 0).
        first: the first position the cells must hold (a range capture starts past 0).

    Raises:
        StateFormatError: wrong magic, truncation, trailing bytes, several non-empty streams,
            cells that do not belong to exactly one sequence, or inconsistent layer records.
    """
    r = _Reader(memoryview(blob).cast("B"))
    (magic,) = r.take("<I", "magic")
    if magic != STATE_MAGIC:
        raise StateFormatError(f"wrong state magic 0x{magic:08x}, expected 0x{STATE_MAGIC:08x}")
    (seq_id,) = r.take("<i", "seq_id")
    (n_stream,) = r.take("<I", "n_stream")
    if not 1 <= n_stream <= 4096:
        raise StateFormatError(f"implausible stream count {n_stream}")
    found: tuple[int, SequenceState] | None = None
    for s in range(n_stream):
        (cell_count,) = r.take("<I", f"cell count of stream {s}")
        if cell_count == 0:
            continue
        if found is not None:
            raise StateFormatError(
                f"streams {found[0]} and {s} both hold cells; a sequence lives in one stream"
            )
        found = (s, _parse_stream(r, seq_id, n_stream, s, cell_count, ext_bytes))
    if r.off != len(r.buf):
        raise StateFormatError(
            f"{len(r.buf) - r.off} trailing bytes after the state's first memory section (a "
            "sliding-window model's state has a second one, which pages cannot hold)"
        )
    if found is None:
        empty = KVLayout(v_trans=False, layers=(), n_stream=n_stream, ext_bytes=ext_bytes)
        none = np.zeros(0, np.uint8)
        return SequenceState(
            seq_id, empty, np.zeros(0, np.int32), none.reshape(0, ext_bytes), (), (), first
        )
    return dataclasses.replace(found[1], first=first) if first else found[1]


def _parse_stream(
    r: _Reader, seq_id: int, n_stream: int, stream: int, cells: int, ext_bytes: int
) -> SequenceState:
    rec = 12 + ext_bytes
    meta = r.array(cells * rec, "cell metadata").reshape(cells, rec)
    positions = meta[:, 0:4].copy().view(np.int32).reshape(cells)
    n_seq = meta[:, 4:8].copy().view(np.uint32).reshape(cells)
    if not np.all(n_seq == 1):
        bad = int(np.flatnonzero(n_seq != 1)[0])
        raise StateFormatError(
            f"cell {bad} belongs to {int(n_seq[bad])} sequences; a sequence state has exactly one"
        )
    ext = meta[:, 8 : 8 + ext_bytes]
    v_trans, n_layer = r.take("<II", "v_trans and layer count")
    if v_trans not in (0, 1):
        raise StateFormatError(f"v_trans is {v_trans}, expected 0 or 1")
    if not 1 <= n_layer <= 4096:
        raise StateFormatError(f"implausible layer count {n_layer}")
    ks: list[tuple[int, int, U8]] = []
    for il in range(n_layer):
        k_type, k_row = r.take("<iQ", f"K header of layer {il}")
        _check_row(k_row, f"K row size of layer {il}")
        ks.append((k_type, k_row, r.array(k_row * cells, f"K of layer {il}").reshape(cells, k_row)))
    vs: list[tuple[int, int, int, U8]] = []
    for il in range(n_layer):
        if v_trans:
            v_type, elem, embd = r.take("<iII", f"V header of layer {il}")
            _check_row(elem, f"V element size of layer {il}")
            _check_row(embd, f"V embedding size of layer {il}")
            data = r.array(embd * elem * cells, f"V of layer {il}").reshape(embd, elem * cells)
            vs.append((v_type, elem, embd, data))
        else:
            v_type, v_row = r.take("<iQ", f"V header of layer {il}")
            _check_row(v_row, f"V row size of layer {il}")
            vs.append(
                (v_type, v_row, 0, r.array(v_row * cells, f"V of layer {il}").reshape(cells, v_row))
            )
    layers = tuple(
        LayerLayout(k_type=k[0], k_row=k[1], v_type=v[0], v_unit=v[1], v_embd=v[2])
        for k, v in zip(ks, vs, strict=True)
    )
    layout = KVLayout(
        v_trans=bool(v_trans), layers=layers, n_stream=n_stream, stream=stream, ext_bytes=ext_bytes
    )
    return SequenceState(
        seq_id, layout, positions, ext, tuple(k[2] for k in ks), tuple(v[3] for v in vs)
    )


def _check_row(size: int, what: str) -> None:
    if not 1 <= size <= 1 << 24:
        raise StateFormatError(f"implausible {what}: {size}")


def parse_sections(blob: bytes | bytearray | memoryview, ext_bytes: int = 0) -> list[SequenceState]:
    """Parse a state made of several memory sections, one after the other, each like the
    single one :func:`parse_state` reads (after one shared magic and seq_id).

    Sliding-window models keep two KV caches (llama.cpp's ``llama_kv_cache_iswa``): the state
    holds the full-attention layers' cells, then the sliding-window layers' cells, and llama.cpp
    writes only the window's unmasked cells of the second (measured on Gemma 3 270M with
    ``swa_full``: 722 cells in the first section, the last 512 in the second). Used to read the
    layout and to certify, not to page: skippy's pages hold one section.

    A blob cut exactly at a section boundary reads as a state of fewer sections: only the
    caller knows how many to expect.

    Raises:
        StateFormatError: as :func:`parse_state`, per section; a section with no cells; no
            section at all.
    """
    r = _Reader(memoryview(blob).cast("B"))
    (magic,) = r.take("<I", "magic")
    if magic != STATE_MAGIC:
        raise StateFormatError(f"wrong state magic 0x{magic:08x}, expected 0x{STATE_MAGIC:08x}")
    (seq_id,) = r.take("<i", "seq_id")
    sections: list[SequenceState] = []
    while r.off < len(r.buf):
        index = len(sections)
        (n_stream,) = r.take("<I", f"stream count of section {index}")
        if not 1 <= n_stream <= 4096:
            raise StateFormatError(f"implausible stream count {n_stream} in section {index}")
        found: SequenceState | None = None
        for s in range(n_stream):
            (cell_count,) = r.take("<I", f"cell count of stream {s} of section {index}")
            if cell_count == 0:
                continue
            if found is not None:
                raise StateFormatError(f"two streams of section {index} hold cells")
            found = _parse_stream(r, seq_id, n_stream, s, cell_count, ext_bytes)
        if found is None:
            raise StateFormatError(f"section {index} holds no cells")
        sections.append(found)
    if not sections:
        raise StateFormatError("the state holds no memory section")
    return sections


def parse_layout(blob: bytes | bytearray | memoryview, ext_bytes: int = 0) -> KVLayout:
    """The KV layout of a state of one memory section, or of two (a sliding-window model's).

    For two sections the layout is the first's, with the second's layers as ``swa_layers``:
    a layout that says what the live context is (for the cache identity and the roster's row)
    but that no page ever matches (:attr:`KVLayout.pageable` is false).

    Raises:
        StateFormatError: as :func:`parse_sections`; more than two sections; two sections that
            disagree on V transposition, streams or cell ext (llama.cpp builds both caches of
            one context alike).
    """
    sections = parse_sections(blob, ext_bytes)
    if len(sections) > 2:
        raise StateFormatError(
            f"the state has {len(sections)} memory sections; llama.cpp writes one, or two for a "
            "sliding-window model"
        )
    base = sections[0].layout
    if len(sections) == 1:
        return base
    swa = sections[1].layout
    for name in ("v_trans", "n_stream", "stream", "ext_bytes"):
        if getattr(base, name) != getattr(swa, name):
            raise StateFormatError(
                f"the sliding-window section has {name} {getattr(swa, name)}, the first "
                f"section {getattr(base, name)}"
            )
    return dataclasses.replace(base, swa_layers=swa.layers)
