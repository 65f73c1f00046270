"""Token pages: cut a sequence state into pages, serialize them, assemble a prefix back.

A page holds ``n_tokens`` consecutive positions of one sequence, every layer, K and V, as one
self-describing bytes object::

    header  '<4sHHIIIII': magic b'SKPG', PAGE_FORMAT_VERSION, flags (bit0 v_trans),
                          n_layer, start, n_tokens, ext_bytes, reserved
    layers  n_layer * '<iQiII': k_type, k_row, v_type, v_unit, v_embd
    ext     n_tokens * ext_bytes
    K       per layer n_tokens * k_row
    V       per layer n_tokens * v_row, or v_embd rows of n_tokens * elem (transposed)

Assembly writes every page straight into one preallocated buffer: no intermediate copies, so a
16k-token prefix costs one pass over its bytes.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import LayoutMismatchError, StateFormatError
from ..hostmem import HostBuffer
from ..parallel import PARALLEL_BYTES, run_all
from .format import STATE_MAGIC, U8, SequenceState
from .layout import KVLayout, LayerLayout, type_name

PAGE_MAGIC = b"SKPG"
#: Version of skippy's page format; part of the cache identity.
PAGE_FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHIIIII")
_LAYER = struct.Struct("<iQiII")


@dataclass(frozen=True)
class Page:
    """``n_tokens`` consecutive cells starting at position ``start``, as views (no copies)."""

    start: int
    n_tokens: int
    layout: KVLayout
    ext: U8
    k: tuple[U8, ...]
    v: tuple[U8, ...]

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    @property
    def nbytes(self) -> int:
        return page_nbytes(self.layout, self.n_tokens)

    def head(self, n: int) -> Page:
        """The page's first ``n`` tokens (views, no copy)."""
        if not 0 < n <= self.n_tokens:
            raise StateFormatError(f"cannot take {n} tokens of a {self.n_tokens}-token page")
        if n == self.n_tokens:
            return self
        layout = self.layout
        v = tuple(
            arr[:, : n * layer.v_unit] if layout.v_trans else arr[:n]
            for arr, layer in zip(self.v, layout.layers, strict=True)
        )
        return Page(self.start, n, layout, self.ext[:n], tuple(a[:n] for a in self.k), v)

    def span(self, start: int, end: int) -> Page:
        """The page's cells at positions ``[start, end)`` (views, no copy).

        An append import continues a resident prefix that may end inside a page: the
        page's cells before that point are already in the context.
        """
        if not self.start <= start < end <= self.end:
            raise StateFormatError(
                f"cannot take [{start}, {end}) of a page holding [{self.start}, {self.end})"
            )
        if start == self.start and end == self.end:
            return self
        layout = self.layout
        a, b = start - self.start, end - self.start
        v = tuple(
            arr[:, a * layer.v_unit : b * layer.v_unit] if layout.v_trans else arr[a:b]
            for arr, layer in zip(self.v, layout.layers, strict=True)
        )
        return Page(start, end - start, layout, self.ext[a:b], tuple(k[a:b] for k in self.k), v)

    def to_bytes(self) -> bytes:
        """Serialize the page: one copy of its payload, straight into the result (a transposed
        V slice, not contiguous, is gathered first)."""
        flags = 1 if self.layout.v_trans else 0
        head = [
            _HEADER.pack(
                PAGE_MAGIC, PAGE_FORMAT_VERSION, flags, self.layout.n_layer,
                self.start, self.n_tokens, self.layout.ext_bytes, 0,
            )
        ]  # fmt: skip
        head += [
            _LAYER.pack(layer.k_type, layer.k_row, layer.v_type, layer.v_unit, layer.v_embd)
            for layer in self.layout.layers
        ]
        parts = (np.ascontiguousarray(arr).data for arr in (self.ext, *self.k, *self.v))
        return b"".join([*head, *parts])


def page_nbytes(layout: KVLayout, n_tokens: int) -> int:
    """The serialized size of a page of ``n_tokens`` cells of ``layout`` (:meth:`Page.to_bytes`)."""
    return (
        _HEADER.size
        + _LAYER.size * layout.n_layer
        + n_tokens * (layout.ext_bytes + layout.kv_bytes_per_cell)
    )


def _header(buf: memoryview) -> tuple[int, int, int, int, int]:
    """(flags, n_layer, start, n_tokens, ext_bytes) of a serialized page's header, checked as
    far as the header alone allows."""
    if len(buf) < _HEADER.size:
        raise StateFormatError(f"page truncated: {len(buf)} bytes, header needs {_HEADER.size}")
    magic, version, flags, n_layer, start, n_tokens, ext_bytes, _ = _HEADER.unpack_from(buf, 0)
    if magic != PAGE_MAGIC:
        raise StateFormatError(f"not a skippy page (magic {bytes(magic)!r})")
    if version != PAGE_FORMAT_VERSION:
        raise StateFormatError(
            f"page format version {version}, this build reads {PAGE_FORMAT_VERSION}"
        )
    if not 1 <= n_layer <= 4096 or n_tokens == 0 or flags > 1:
        raise StateFormatError(f"implausible page header: {n_layer} layers, {n_tokens} tokens")
    return flags, n_layer, start, n_tokens, ext_bytes


@dataclass(frozen=True)
class PageCells:
    """Where a serialized page's K and V lie in its bytes (:meth:`PageReader.cells`), for
    copies straight from them: byte offsets per layer of the first K row and of the first V
    row (V transposed: of the first element of its first row, rows ``n_tokens`` elements
    long), and the bytes from one cell to the next (``k_step``, ``v_step``)."""

    start: int
    n_tokens: int
    v_trans: bool
    k: npt.NDArray[np.uint64]
    v: npt.NDArray[np.uint64]
    k_step: npt.NDArray[np.uint64]
    v_step: npt.NDArray[np.uint64]

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


class PageReader:
    """Serialized pages of one layout located in their bytes without being parsed into views.

    :func:`page_from_bytes` makes two numpy views per layer of every page (on SmolLM2, 31 pages
    of 30 layers: 5-7 ms of a restore's read thread, and as much again to turn the views back
    into addresses for the per-layer copies); a restore by copies needs only where each layer
    starts. :meth:`cells` checks what :func:`page_from_bytes` checks, and that the page's layer
    table is ``layout``'s byte for byte, and computes the offsets from the layout.
    """

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._flags = 1 if layout.v_trans else 0
        self._table = b"".join(
            _LAYER.pack(layer.k_type, layer.k_row, layer.v_type, layer.v_unit, layer.v_embd)
            for layer in layout.layers
        )
        self._cells_at = _HEADER.size + len(self._table)
        k_rows = np.array([layer.k_row for layer in layout.layers], dtype=np.uint64)
        v_cells = np.array([layer.v_bytes_per_cell() for layer in layout.layers], dtype=np.uint64)
        # per layer: the bytes of one cell in the layers before it
        self._k_before = np.cumsum(k_rows) - k_rows
        self._v_before = int(k_rows.sum()) + np.cumsum(v_cells) - v_cells
        self._k_step = k_rows
        self._v_step = np.array([layer.v_unit for layer in layout.layers], dtype=np.uint64)
        self._kv_per_cell = int(k_rows.sum() + v_cells.sum())

    def cells(self, data: bytes | bytearray | memoryview) -> PageCells:
        """Where ``data``'s cells lie.

        Raises:
            StateFormatError: not a page (as :func:`page_from_bytes`), or a page of another
                layout (including one with cell ext, which the copies do not carry).
        """
        buf = memoryview(data).cast("B")
        flags, n_layer, start, n_tokens, ext_bytes = _header(buf)
        table = bytes(buf[_HEADER.size : _HEADER.size + _LAYER.size * n_layer])
        layout = self.layout
        if (
            flags != self._flags
            or ext_bytes != layout.ext_bytes
            or ext_bytes
            or table != self._table
        ):
            raise StateFormatError("a page's layout differs from the context's")
        expected = self._cells_at + n_tokens * self._kv_per_cell
        if len(buf) != expected:
            raise StateFormatError(f"page is {len(buf)} bytes, its header says {expected}")
        n = np.uint64(n_tokens)
        at = np.uint64(self._cells_at)
        return PageCells(
            start,
            n_tokens,
            layout.v_trans,
            at + n * self._k_before,
            at + n * self._v_before,
            self._k_step,
            self._v_step,
        )


@functools.lru_cache(maxsize=8)
def page_reader(layout: KVLayout) -> PageReader:
    """The :class:`PageReader` of ``layout`` (kept: a restore asks for it again)."""
    return PageReader(layout)


def page_from_bytes(data: bytes | bytearray | memoryview) -> Page:
    """Parse a serialized page into views over ``data``.

    Raises:
        StateFormatError: wrong magic or version, or a size that does not add up.
    """
    buf = memoryview(data).cast("B")
    flags, n_layer, start, n_tokens, ext_bytes = _header(buf)
    off = _HEADER.size
    if len(buf) < off + _LAYER.size * n_layer:
        raise StateFormatError("page truncated in its layer table")
    layers = []
    for _ in range(n_layer):
        layers.append(LayerLayout(*_LAYER.unpack_from(buf, off)))
        off += _LAYER.size
    layout = KVLayout(v_trans=bool(flags & 1), layers=tuple(layers), ext_bytes=ext_bytes)
    if any((layer.v_embd > 0) != layout.v_trans for layer in layers):
        raise StateFormatError("page layer table disagrees with its v_trans flag")
    expected = off + n_tokens * (ext_bytes + layout.kv_bytes_per_cell)
    if len(buf) != expected:
        raise StateFormatError(f"page is {len(buf)} bytes, its header says {expected}")
    whole = np.frombuffer(buf, dtype=np.uint8)

    def take(shape: tuple[int, int]) -> U8:
        nonlocal off
        n = shape[0] * shape[1]
        arr = whole[off : off + n].reshape(shape)
        off += n
        return arr

    ext = take((n_tokens, ext_bytes))
    k = tuple(take((n_tokens, layer.k_row)) for layer in layers)
    v = tuple(
        take((layer.v_embd, n_tokens * layer.v_unit))
        if layout.v_trans
        else take((n_tokens, layer.v_unit))
        for layer in layers
    )
    return Page(start, n_tokens, layout, ext, k, v)


def sort_by_position(state: SequenceState) -> SequenceState:
    """``state`` with its cells in position order (itself when they already are)."""
    order = state.order()
    if order is None:
        return state
    v: list[U8] = []
    for arr, layer in zip(state.v, state.layout.layers, strict=True):
        if state.layout.v_trans:
            cube = arr.reshape(layer.v_embd, state.n_tokens, layer.v_unit)[:, order, :]
            v.append(np.ascontiguousarray(cube).reshape(layer.v_embd, -1))
        else:
            v.append(arr[order])
    return SequenceState(
        state.seq_id,
        state.layout,
        np.arange(state.first, state.first + state.n_tokens, dtype=np.int32),
        state.ext[order],
        tuple(arr[order] for arr in state.k),
        tuple(v),
        state.first,
    )


def slice_state(state: SequenceState, start: int, end: int) -> Page:
    """Cut cells with positions ``[start, end)`` out of a sequence state, as views where possible.

    Raises:
        StateFormatError: positions are not contiguous from ``state.first``, or the range is
            out of bounds.
    """
    state = sort_by_position(state)
    first = state.first
    if not first <= start < end <= first + state.n_tokens:
        raise StateFormatError(
            f"range [{start}, {end}) outside the state's positions "
            f"[{first}, {first + state.n_tokens})"
        )
    layout = state.layout
    if not layout.pageable:
        raise StateFormatError("a sliding-window (two-section) state cannot be cut into pages")
    a, b = start - first, end - first
    v = tuple(
        arr[:, a * layer.v_unit : b * layer.v_unit] if layout.v_trans else arr[a:b]
        for arr, layer in zip(state.v, layout.layers, strict=True)
    )
    return Page(start, end - start, layout, state.ext[a:b], tuple(k[a:b] for k in state.k), v)


def cut_pages(
    state: SequenceState, page_tokens: int, *, keep_tail: bool = True, limit: int | None = None
) -> list[Page]:
    """Cut the first ``limit`` (default all) tokens of a state into pages of ``page_tokens``.

    With ``keep_tail`` the last partial page is kept as an exact-length tail page.
    """
    if page_tokens <= 0:
        raise ValueError(f"page_tokens must be positive, got {page_tokens}")
    state = sort_by_position(state)
    n = state.n_tokens if limit is None else min(limit, state.n_tokens)
    pages = []
    for start in range(0, n, page_tokens):
        end = min(start + page_tokens, n)
        if end - start < page_tokens and not keep_tail:
            break
        pages.append(slice_state(state, state.first + start, state.first + end))
    return pages


def _describe(layer: LayerLayout) -> str:
    v_embd = f" x{layer.v_embd}" if layer.v_embd else ""
    return (
        f"K {type_name(layer.k_type)}/{layer.k_row}B "
        f"V {type_name(layer.v_type)}/{layer.v_unit}B{v_embd}"
    )


def _layout_difference(want: KVLayout, got: KVLayout) -> str | None:
    if want.swa_layers != got.swa_layers:
        # a page holds one section; a sliding-window context's state has two
        return (
            f"{got.n_sections} memory section(s) with {len(got.swa_layers)} sliding-window "
            f"layers where the context has {want.n_sections} with {len(want.swa_layers)}"
        )
    if want.v_trans != got.v_trans:
        return f"v_trans {int(got.v_trans)} where the context has {int(want.v_trans)}"
    if want.n_layer != got.n_layer:
        return f"{got.n_layer} layers where the context has {want.n_layer}"
    if want.ext_bytes != got.ext_bytes:
        return f"{got.ext_bytes} cell-ext bytes where the context has {want.ext_bytes}"
    for il, (a, b) in enumerate(zip(want.layers, got.layers, strict=True)):
        if a != b:
            return f"layer {il} is {_describe(b)} where the context has {_describe(a)}"
    return None


def check_layout(want: KVLayout, got: KVLayout, what: str = "page") -> None:
    """Raise :class:`LayoutMismatchError` naming the first difference between two layouts."""
    diff = _layout_difference(want, got)
    if diff is not None:
        raise LayoutMismatchError(f"{what} does not fit the live context: {diff}")


def _write_rows(arr: U8, off: int, blocks: Sequence[U8]) -> int:
    """Copy per-cell row blocks back to back into ``arr`` at ``off``; returns the new offset."""
    for block in blocks:
        arr[off : off + block.size].reshape(block.shape)[...] = block
        off += block.size
    return off


def assemble(
    pages: Sequence[Page], layout: KVLayout, seq_id: int = 0, *, start: int = 0
) -> bytearray:
    """Build a ``llama_state_seq_set_data`` blob for the prefix covered by ``pages``.

    Args:
        pages: consecutive pages starting at position ``start``.
        layout: the live context's layout; every page is checked against it.
        seq_id: the sequence id written into the header (llama.cpp restores into the id it is
            given, so any destination works).
        start: the first position: 0 for a whole prefix (``set_data``), past 0 for the cells
            an append import adds after a resident prefix of ``start`` tokens.

    Raises:
        LayoutMismatchError: a page has a different layout from the context.
        StateFormatError: pages are not consecutive from position ``start``.
    """
    out = bytearray(assembled_size(pages, layout, start=start))
    assemble_into(out, pages, layout, seq_id, start=start)
    return out


def assembled_size(pages: Sequence[Page], layout: KVLayout, *, start: int = 0) -> int:
    """Bytes :func:`assemble` writes for ``pages`` (checked like :func:`assemble` checks them)."""
    if not layout.pageable:
        # pages hold one section; set_data would read the second from whatever followed
        raise LayoutMismatchError(
            "pages cannot rebuild the state of a sliding-window context (two memory sections)"
        )
    pos = start
    for page in pages:
        if page.start != pos:
            raise StateFormatError(
                f"page starts at {page.start}, expected {pos}: pages must be consecutive"
            )
        check_layout(layout, page.layout)
        pos += page.n_tokens
    n = pos - start
    if n == 0:
        raise StateFormatError("nothing to assemble: no pages")
    return state_bytes(layout, n)


def state_bytes(layout: KVLayout, n: int) -> int:
    """Bytes of a one-section sequence state of ``n`` cells in ``layout`` (what :func:`assemble`
    writes for them; a restore that skips the blob reports its size too, so rates compare)."""
    size = 12 + 4 * layout.n_stream + n * layout.meta_bytes_per_cell + 8
    for layer in layout.layers:
        size += 12 + n * layer.k_row + 12 + n * layer.v_bytes_per_cell()
    return size


def assemble_into(
    out: HostBuffer, pages: Sequence[Page], layout: KVLayout, seq_id: int = 0, *, start: int = 0
) -> int:
    """:func:`assemble` into the start of a caller's buffer (reused across restores, a large
    blob costs no fresh allocation and page faults); returns the bytes written."""
    size = assembled_size(pages, layout, start=start)
    if len(out) < size:
        raise ValueError(f"buffer of {len(out)} bytes is smaller than the {size}-byte blob")
    n = sum(page.n_tokens for page in pages)
    arr = np.frombuffer(out, dtype=np.uint8)
    struct.pack_into("<IiI", out, 0, STATE_MAGIC, seq_id, layout.n_stream)
    off = 12
    for s in range(layout.n_stream):
        struct.pack_into("<I", out, off, n if s == layout.stream else 0)
        off += 4
        if s != layout.stream:
            continue
        rec = layout.meta_bytes_per_cell
        meta = arr[off : off + n * rec].reshape(n, rec)
        positions = np.arange(start, start + n, dtype=np.int32)
        meta[:, 0:4] = positions.view(np.uint8).reshape(n, 4)
        meta[:, 4:8] = np.ones(n, dtype=np.uint32).view(np.uint8).reshape(n, 4)
        row = 0
        for page in pages:
            meta[row : row + page.n_tokens, 8 : 8 + layout.ext_bytes] = page.ext
            row += page.n_tokens
        meta[:, 8 + layout.ext_bytes :] = (
            np.full(n, seq_id, dtype=np.int32).view(np.uint8).reshape(n, 4)
        )
        off += n * rec
        struct.pack_into("<II", out, off, int(layout.v_trans), layout.n_layer)
        off += 8
        # headers first (cheap), then one copy task per layer's K and V
        copies: list[Callable[[], object]] = []
        for il, layer in enumerate(layout.layers):
            struct.pack_into("<iQ", out, off, layer.k_type, layer.k_row)
            blocks = [page.k[il] for page in pages]
            copies.append(functools.partial(_write_rows, arr, off + 12, blocks))
            off += 12 + n * layer.k_row
        for il, layer in enumerate(layout.layers):
            blocks = [page.v[il] for page in pages]
            if layout.v_trans:
                struct.pack_into("<iII", out, off, layer.v_type, layer.v_unit, layer.v_embd)
                width = n * layer.v_unit
                block = arr[off + 12 : off + 12 + layer.v_embd * width]
                copies.append(functools.partial(_write_columns, block, layer.v_embd, blocks))
                off += 12 + layer.v_embd * width
            else:
                struct.pack_into("<iQ", out, off, layer.v_type, layer.v_unit)
                copies.append(functools.partial(_write_rows, arr, off + 12, blocks))
                off += 12 + n * layer.v_unit
        run_all(copies, parallel=size >= PARALLEL_BYTES)
    if off != size:
        raise StateFormatError(f"assembled {off} bytes, planned {size}")  # pragma: no cover
    return size


def _write_columns(block: U8, rows: int, pages: Sequence[U8]) -> None:
    """Place transposed V blocks (``rows`` × tokens) side by side in ``block``."""
    view = block.reshape(rows, block.size // rows)
    col = 0
    for page in pages:
        view[:, col : col + page.shape[1]] = page
        col += page.shape[1]
