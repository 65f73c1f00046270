"""Captures that never land on a request: a record's new cells exported into arena slots.

Issue 45 measured on an H100 what a record cost the request path where nothing is reused (one-shot
2k-token prompts, L3 on): 1.13-1.32x plain ``Llama``, because the previous request's waiting
record was captured through the state format (43 ms for 46 MB; the bus needs ~1 ms) on the next
request's path. Here a record's new cells leave the KV tensors by the patched per-layer copies
(``skippy_kv_cells_get``, patch 0006) straight into slots of a host arena laid out as those
tensors are (:class:`~skippy_llama.tiers.arena.HostArena`; pinned on CUDA builds), right after
the request's decode: where the cache is on a device, on a thread of their own (``background``:
the call queues one device-to-host copy per layer and K/V on the backend's stream and waits
once, off the request thread); on the CPU on the request thread, where it is a memcpy of warm
slots and a thread only came later (``runtime/arena_setup.open_exporter``). No state blob is
written or parsed either way. Serializing the pages, compressing, hashing and the L3 write stay
on the L3 writer, which waits for the export before it reads a slot (:meth:`CellExport.wait`).

A later request waits only for the export still running (:meth:`CellExporter.settle`), and only
before it touches the context: llama.cpp's calls on one context must not run on two threads at
once, and the next prompt's decode may reuse the very cells being copied. Nothing else of the
record (cutting, compression, hashing, writes) is ever waited for on a request.

Where the arena has no room (the writer is far behind), :meth:`CellExporter.start` says so and
the recorder takes the stock capture instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import TierError
from ..state.pages import Page
from ..tiers.arena import ArenaSlot, HostArena
from . import native_ext

log = logging.getLogger("skippy_llama")

#: The longest a reader of an exported page waits for the export (a device copy of a whole
#: context takes milliseconds; past this something is broken and the page is not used).
EXPORT_WAIT_S = 30.0


class CellExport:
    """One record's new cells on their way into arena slots (``slots``, in position order)."""

    def __init__(self, arena: HostArena, slots: list[ArenaSlot]) -> None:
        self.arena = arena
        self.slots = slots
        self.done = threading.Event()
        #: why the export failed (None: it succeeded, or is still running)
        self.error: str | None = None

    def wait(self) -> None:
        """Wait until the cells are in the slots.

        Raises:
            ValueError: the export failed or never ended: the pages are not made (the L3
                writer drops the record; a lookup treats the page as missing).
        """
        if not self.done.wait(EXPORT_WAIT_S):
            raise ValueError("the export of a record's cells did not finish")
        if self.error is not None:
            raise ValueError(f"the export of a record's cells failed: {self.error}")

    def page(self, i: int) -> Page:
        """Page ``i`` of the export as views into the arena (call :meth:`wait` first)."""
        return self.arena.page(self.slots[i])

    def page_bytes(self, i: int) -> bytes:
        """Page ``i`` serialized, once the export is done (the L3 writer calls this)."""
        self.wait()
        return self.page(i).to_bytes()


class CellExporter:
    """Exports a record's new cells from sequence ``seq_id`` of ``ctx`` into ``arena``.

    Args:
        ctx: the ``llama_context`` pointer.
        arena: the host arena the cells land in (its slots are handed out and freed here,
            under a lock: the L3 writer frees them from its thread).
        background: export on a thread of the exporter's own (the request returns while the
            copies run); False runs each export on the caller's thread.
    """

    def __init__(
        self,
        ctx: Any,
        arena: HostArena,
        *,
        background: bool = True,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.arena = arena
        self.background = background
        #: told why an export on the exporter's thread failed (the cache counts it as a record
        #: fallback; on the request thread :meth:`start` raises instead)
        self.on_error = on_error
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._running: Future[None] | None = None
        #: exports started, and records that found no room in the arena
        self.exports = 0
        self.no_room = 0

    def start(self, seq_id: int, parts: list[tuple[int, int]]) -> CellExport | None:
        """Start exporting the cells of positions ``[start, end)`` of each of ``parts`` (a
        record's new pages, consecutive, each at most a slot long) into free slots; None,
        with nothing started, when the arena has no room for them all.

        An export still running is waited for first: one runs at a time, and its slots are
        never handed out again before it ended.

        Raises:
            TierError: an export on the caller's thread (not ``background``) failed.
        """
        if not parts:
            return None
        self.settle()
        slots: list[ArenaSlot] = []
        with self._lock:
            # from the lowest free slot on: the slots the last records used are free again
            # by now (the writer made their pages), and their memory is committed and warm;
            # a cursor would walk fresh memory and fault it in on every export
            after: int | None = -1
            for start, end in parts:
                slot = self.arena.reserve(start, end - start, after)
                if slot is None:
                    for taken in slots:
                        self.arena.free(taken)
                    self.no_room += 1
                    return None
                slots.append(slot)
                after = slot.index
        export = CellExport(self.arena, slots)
        spans = [
            native_ext.HostSpan(run.n_cells, *self.arena.addresses(run), self.arena.capacity)
            for run in self.arena.runs((slot, slot.start, slot.end) for slot in slots)
        ]
        p0 = parts[0][0]

        def run() -> None:
            try:
                if not native_ext.cells_get(self.ctx, seq_id, p0, spans):
                    raise TierError("skippy_kv_cells_get refused the record's cells")
            except Exception as exc:  # the record is dropped; the request is not concerned
                export.error = f"{type(exc).__name__}: {exc}"
                if self.background:
                    log.warning("skippy-llama: exporting a record's cells failed (%s)", exc)
                    if self.on_error is not None:
                        self.on_error(export.error)
            finally:
                export.done.set()

        self.exports += 1
        if self.background:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="skippy-export")
            self._running = self._pool.submit(run)
            return export
        run()
        if export.error is not None:
            self.release(export)()
            raise TierError(export.error)
        return export

    def release(self, export: CellExport) -> Callable[[], None]:
        """What gives ``export``'s slots back (once its pages are no longer read)."""

        def give_back() -> None:
            with self._lock:
                for slot in export.slots:
                    self.arena.free(slot)

        return give_back

    def settle(self) -> None:
        """Wait for the export still running, if any: before anything touches the context."""
        running = self._running
        if running is not None:
            running.result()
            self._running = None

    def close(self) -> None:
        """Wait for the export still running and stop the thread (the arena is its owner's)."""
        self.settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
