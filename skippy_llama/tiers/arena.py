"""L2's host arena: pages kept in the KV cache's own layout, so a restore is a few copies per layer.

The arena is one block of host memory holding ``n_slots`` slots of ``page_tokens`` cells each,
laid out as llama.cpp's KV tensors are, with the arena's capacity in place of the cache's:

    per layer il:  K  capacity x k_row bytes             (cell after cell)
                   V  capacity x v_row bytes             (V not transposed)
                   V  v_embd rows of capacity x elem     (V transposed: flash attention off)

A page in slot ``s`` holds cells ``[s * page_tokens, s * page_tokens + n_tokens)``. Pages of one
prefix that sit in consecutive slots form one run of cells, which the patched llama.cpp
(``skippy_kv_cells_set``, patch 0006) copies into the KV tensors with one copy per layer for K
and one (strided, for transposed V) for V: no state blob is assembled and none is parsed
(issue 45: an 8k-token L2 restore on an H100 spent 39 of its 43 ms assembling). Slots are
handed out after the last one taken, so pages promoted in order usually land consecutive.

Each slot also has room for a restore point's *snapshot* (issue 46: the non-per-token state of
a model at the end of the page, e.g. recurrent states); the arena keeps those bytes and never
interprets them. Pure storage: nothing here calls llama.cpp. On GPU builds the caller pins
:attr:`HostArena.buffer` (``skippy_llama.pinned``) so its copies go by DMA.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..errors import StateFormatError
from ..state import KVLayout
from ..state.format import U8
from ..state.pages import Page, PageCells, page_nbytes


@dataclass
class ArenaSlot:
    """One page held in the arena.

    Attributes:
        index: the slot; its cells are ``[index * page_tokens, index * page_tokens + n_tokens)``.
        start: the page's first position.
        n_tokens: cells the page holds (a prompt's tail page may hold fewer than a slot's).
        ext: the page's cell-ext bytes (empty for most models; the arena path refuses them).
        nbytes: the page's serialized size (``Page.nbytes``).
        snapshot: room for a restore point's snapshot at ``start + n_tokens`` (issue 46); the
            arena stores it and never looks inside.
    """

    index: int
    start: int
    n_tokens: int
    ext: bytes = b""
    nbytes: int = 0
    snapshot: bytes | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


@dataclass(frozen=True)
class ArenaRun:
    """Consecutive arena cells to move at once: ``n_cells`` cells from arena cell ``cell``."""

    cell: int
    n_cells: int


class HostArena:
    """Slots of ``page_tokens`` cells in host memory laid out as ``layout``'s KV tensors.

    Not thread-safe: its owner (``RamTier``) serializes puts, frees and the reads of a restore.

    Args:
        layout: the live context's KV layout (one memory section, no cell ext).
        page_tokens: cells per slot (the cache's page size).
        n_slots: slots to hold (the L2 budget over :meth:`slot_bytes`).
    """

    def __init__(self, layout: KVLayout, page_tokens: int, n_slots: int) -> None:
        if not layout.pageable or not layout.layers:
            raise StateFormatError("the arena holds one-section layouts only")
        if page_tokens <= 0 or n_slots <= 0:
            raise ValueError(f"arena of {n_slots} slots of {page_tokens} cells")
        self.layout = layout
        self.page_tokens = page_tokens
        self.n_slots = n_slots
        self.capacity = n_slots * page_tokens
        self.nbytes = self.capacity * layout.kv_bytes_per_cell
        # asked for on every fill (the layout sums its layers each time)
        self._slot_bytes = page_tokens * layout.kv_bytes_per_cell
        # anonymous memory: the kernel commits a page when it is first written, so an arena
        # sized to the whole L2 budget costs only what L2 holds (until it is pinned)
        self.buffer = mmap.mmap(-1, self.nbytes)
        whole = np.frombuffer(self.buffer, dtype=np.uint8)
        self._whole: U8 | None = whole
        k: list[U8] = []
        v: list[U8] = []
        off = 0
        for layer in layout.layers:
            k.append(whole[off : off + self.capacity * layer.k_row].reshape(self.capacity, -1))
            off += self.capacity * layer.k_row
        for layer in layout.layers:
            n = self.capacity * layer.v_bytes_per_cell()
            shape = (layer.v_embd, -1) if layout.v_trans else (self.capacity, -1)
            v.append(whole[off : off + n].reshape(shape))
            off += n
        self.k: tuple[U8, ...] = tuple(k)
        self.v: tuple[U8, ...] = tuple(v)
        #: per layer: the address of cell 0's K row and V row (or first V element), and the
        #: bytes from one cell to the next (K row; V row, or V element when transposed)
        self.k_addr: npt.NDArray[np.uint64] = np.array([a.ctypes.data for a in k], dtype=np.uint64)
        self.v_addr: npt.NDArray[np.uint64] = np.array([a.ctypes.data for a in v], dtype=np.uint64)
        self.k_step: npt.NDArray[np.uint64] = np.array(
            [layer.k_row for layer in layout.layers], dtype=np.uint64
        )
        self.v_step: npt.NDArray[np.uint64] = np.array(
            [layer.v_unit for layer in layout.layers], dtype=np.uint64
        )
        self._free = set(range(n_slots))
        self._next = 0
        #: called by :meth:`close` before the memory goes (e.g. to unpin it)
        self.on_close: Callable[[], object] | None = None
        #: the thread committing the memory ahead of use (``runtime/arena_setup.prefault``),
        #: and whether it finished
        self.prefault_thread: threading.Thread | None = None
        self.prefaulted = False
        #: the memory's address, and whether :meth:`close` began (the prefault thread stops)
        self.address: int = whole.ctypes.data
        self.closing = False

    # -- slots ------------------------------------------------------------------------------

    @property
    def slot_bytes(self) -> int:
        """Host bytes one slot takes, whatever the page in it holds."""
        return self._slot_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def fits(self, page: Page) -> bool:
        """Whether ``page`` can be held here (the same layout, no more cells than a slot)."""
        want, got = self.layout, page.layout
        return (
            got.v_trans == want.v_trans
            and got.layers == want.layers
            and got.ext_bytes == want.ext_bytes
            and 0 < page.n_tokens <= self.page_tokens
        )

    def put(self, page: Page, after: int | None = None) -> ArenaSlot | None:
        """Copy ``page`` into a free slot (the one after slot ``after`` when free, so a prefix
        promoted page by page stays one run); None when the arena is full or the page does not
        fit (:meth:`fits`)."""
        if not self._free or not self.fits(page):
            return None
        return self.write(self._take(after), page)

    def write(self, index: int, page: Page) -> ArenaSlot:
        """Copy ``page`` (which :meth:`fits`) into slot ``index`` as it is, whatever the slot
        held: the free list is the caller's (:meth:`put` takes a free slot first; a restore's
        staging arena, ``runtime/seam.py``, reuses its slots chunk after chunk)."""
        if not 0 <= index < self.n_slots:
            raise ValueError(f"slot {index} of an arena of {self.n_slots}")
        c0, n = index * self.page_tokens, page.n_tokens
        for il, layer in enumerate(self.layout.layers):
            self.k[il][c0 : c0 + n] = page.k[il]
            if self.layout.v_trans:
                u = layer.v_unit
                self.v[il][:, c0 * u : (c0 + n) * u] = page.v[il]
            else:
                self.v[il][c0 : c0 + n] = page.v[il]
        return ArenaSlot(index, page.start, n, bytes(page.ext.data), page.nbytes)

    def fits_cells(self, cells: PageCells) -> bool:
        """Whether a serialized page whose cells ``cells`` locates can be held here by
        :meth:`write_cells`: located in this arena's layout (the caller's to know: a
        ``PageReader`` of it), no more cells than a slot."""
        return 0 < cells.n_tokens <= self.page_tokens and cells.v_trans == self.layout.v_trans

    def write_cells(
        self, index: int, data: bytes | bytearray | memoryview, cells: PageCells
    ) -> ArenaSlot:
        """Copy the cells of the serialized page ``data`` (located by a ``PageReader`` of this
        arena's layout, ``cells``; :meth:`fits_cells`) into slot ``index``, as :meth:`write`
        copies a parsed page, whatever the slot held (a restore's staging arena reuses its
        slots chunk after chunk, ``runtime/seam.py``): the page is not parsed into views first.
        """
        if not 0 <= index < self.n_slots:
            raise ValueError(f"slot {index} of an arena of {self.n_slots}")
        if not self.fits_cells(cells):
            raise ValueError(f"a page of {cells.n_tokens} cells in slots of {self.page_tokens}")
        src = np.frombuffer(data, dtype=np.uint8)
        c0, n = index * self.page_tokens, cells.n_tokens
        for il, layer in enumerate(self.layout.layers):
            k0 = int(cells.k[il])
            self.k[il][c0 : c0 + n] = src[k0 : k0 + n * layer.k_row].reshape(n, layer.k_row)
            v0, vn = int(cells.v[il]), n * layer.v_bytes_per_cell()
            if self.layout.v_trans:
                u = layer.v_unit
                self.v[il][:, c0 * u : (c0 + n) * u] = src[v0 : v0 + vn].reshape(layer.v_embd, -1)
            else:
                self.v[il][c0 : c0 + n] = src[v0 : v0 + vn].reshape(n, -1)
        return ArenaSlot(index, cells.start, n, b"", page_nbytes(self.layout, n))

    def reserve(self, start: int, n_tokens: int, after: int | None = None) -> ArenaSlot | None:
        """A free slot for the cells of positions ``[start, start + n_tokens)``, which its
        caller writes (the runtime's export of a record's new cells straight from the KV
        tensors, ``runtime/export.py``) instead of :meth:`put`; taken after slot ``after`` when
        free, as :meth:`put` does (``after=-1``: slot 0). None when the arena is full or the
        page would not fit."""
        if not self._free or not 0 < n_tokens <= self.page_tokens or self.layout.ext_bytes:
            return None
        index = self._take(after)
        return ArenaSlot(index, start, n_tokens, b"", page_nbytes(self.layout, n_tokens))

    def _take(self, after: int | None) -> int:
        want = self._next if after is None else after + 1
        if want in self._free:
            index = want
        else:
            # the first free slot from the cursor on, wrapping: later puts follow it
            later = [s for s in self._free if s >= self._next]
            index = min(later) if later else min(self._free)
        self._free.discard(index)
        self._next = (index + 1) % self.n_slots
        return index

    def free(self, slot: ArenaSlot) -> None:
        """Give a slot back (its bytes stay until the next put overwrites them)."""
        if 0 <= slot.index < self.n_slots:
            self._free.add(slot.index)

    def page(self, slot: ArenaSlot) -> Page:
        """The page in ``slot`` as views into the arena (``Page.to_bytes`` copies it out)."""
        c0, n = slot.index * self.page_tokens, slot.n_tokens
        layout = self.layout
        k = tuple(a[c0 : c0 + n] for a in self.k)
        v = tuple(
            a[:, c0 * layer.v_unit : (c0 + n) * layer.v_unit] if layout.v_trans else a[c0 : c0 + n]
            for a, layer in zip(self.v, layout.layers, strict=True)
        )
        ext = np.frombuffer(slot.ext, dtype=np.uint8).reshape(n, layout.ext_bytes)
        return Page(slot.start, n, layout, ext, k, v)

    # -- restores -----------------------------------------------------------------------------

    def runs(self, parts: Iterable[tuple[ArenaSlot, int, int]]) -> list[ArenaRun]:
        """The arena cells of consecutive positions, merged into runs.

        ``parts`` are (slot, first, end): positions ``[first, end)`` of the page in the slot,
        in position order; a part that continues the previous one in the arena joins its run.

        Raises:
            StateFormatError: a part outside its page, or parts that are not consecutive.
        """
        out: list[ArenaRun] = []
        pos: int | None = None
        for slot, first, end in parts:
            if not slot.start <= first < end <= slot.end:
                raise StateFormatError(
                    f"cells [{first}, {end}) are not in the page [{slot.start}, {slot.end})"
                )
            if pos is not None and first != pos:
                raise StateFormatError(f"arena pages skip from position {pos} to {first}")
            pos = end
            cell = slot.index * self.page_tokens + (first - slot.start)
            if out and out[-1].cell + out[-1].n_cells == cell:
                last = out[-1]
                out[-1] = ArenaRun(last.cell, last.n_cells + end - first)
            else:
                out.append(ArenaRun(cell, end - first))
        return out

    def addresses(self, run: ArenaRun) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """Per layer, the address of ``run``'s first K row and first V row (or element)."""
        cell = np.uint64(run.cell)
        return self.k_addr + cell * self.k_step, self.v_addr + cell * self.v_step

    def spans(self, n_slots: int) -> list[tuple[int, int]]:
        """The memory that holds slots ``[0, n_slots)``: (address, bytes) ranges in address
        order, adjacent ones merged (one range for every slot). Each layer's K and V hold the
        slots' cells at their start, and with V transposed each of its ``v_embd`` rows does."""
        cells = max(0, min(n_slots, self.n_slots)) * self.page_tokens
        out: list[tuple[int, int]] = []

        def add(address: int, nbytes: int) -> None:
            if out and out[-1][0] + out[-1][1] == address:
                out[-1] = (out[-1][0], out[-1][1] + nbytes)
            elif nbytes:
                out.append((address, nbytes))

        if not cells:
            return out
        layers = self.layout.layers
        for il, layer in enumerate(layers):
            add(int(self.k_addr[il]), cells * layer.k_row)
        for il, layer in enumerate(layers):
            if self.layout.v_trans:
                row = self.capacity * layer.v_unit
                for r in range(layer.v_embd):
                    add(int(self.v_addr[il]) + r * row, cells * layer.v_unit)
            else:
                add(int(self.v_addr[il]), cells * layer.v_bytes_per_cell())
        return out

    def close(self) -> None:
        """Release the memory (every view of it must be gone: a pinned arena is unpinned first)."""
        self.closing = True
        thread = self.prefault_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # at most one step of it: the memory must not go under a madvise
        if self.on_close is not None:
            self.on_close()
            self.on_close = None
        self.k = self.v = ()
        self._whole = None
        self._free.clear()
        # a view still alive somewhere keeps the mapping: the GC frees it later
        with contextlib.suppress(BufferError):
            self.buffer.close()


def slot_count(budget_bytes: int, layout: KVLayout, page_tokens: int) -> int:
    """How many slots an L2 budget of ``budget_bytes`` buys (0: not even one)."""
    per = page_tokens * layout.kv_bytes_per_cell
    return budget_bytes // per if per > 0 else 0
