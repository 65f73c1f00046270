"""The KV seam: the one caller of llama.cpp's state and sequence calls (``native``, ``native_ext``).

It executes a :class:`~skippy_llama.plan.RestorePlan` on the working sequence, reading its pages
from a :class:`~skippy_llama.plan.PageSource`, and says what it did
(:class:`~skippy_llama.plan.RestoreOutcome`); parks, captures and probes go through it too. It
never sees the cache: the request path (``restore.py``, ``repair.py``) plans, asks for a
shallower plan when a step failed, and commits. Stock state calls everywhere; the patched range
export and append import where the roster certifies them, and a restore wholly from L2's host
arena by the per-layer cell copies (patch 0006) where ``layer_copies`` is on (the roster
certifies them and the arena is attached). Pages read from L3 (or held by L2 as bytes) go the
same way where ``page_copies`` is on: each fetched page's K and V are copied from its own bytes
straight into the KV tensors (a page's layout is the arena's with the page's cells as the
capacity), so no state blob is assembled or parsed, and the next chunk is read and its digests
checked while the previous one is copied. Where the cache lives on a device, the read-ahead
thread first puts each chunk's pages into a small (pinned) staging arena (``staging``), or
finds them already in L2's arena when the read promoted them there, so a chunk goes over the
bus as one copy per layer and K/V, the path L2's arena restores take (issue 45 item 3).
Executing a plan never raises.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import StateFormatError, TierError
from ..hostmem import BufferPool, HostBuffer
from ..plan import FetchedPage, PageRef, PageSource, RestoreOutcome, RestorePlan
from ..state import KVLayout, assemble_into, assembled_size, page_from_bytes, parse_layout
from ..state.pages import PageCells, page_nbytes, page_reader, state_bytes
from ..tiers.arena import ArenaSlot, HostArena
from ..tiers.base import ParkPlan
from . import native, native_ext
from .export import CellExport, CellExporter

log = logging.getLogger("skippy_llama")

WORKING_SEQ = 0
#: Sequence id used as scratch by range captures (empty at rest; also checkpoint slot 1).
SCRATCH_SEQ = 1
#: A page restore of more state than this runs in chunks of about this size, each read while the
#: previous one is imported (see ``KVSeam._pipelined``); smaller ones are one read and one import.
PIPELINE_BYTES = 64 << 20
#: A restore by per-layer copies from fetched pages (``KVSeam._direct``) reads and verifies
#: about this many bytes of pages at a time while the previous chunk is copied: the copies run
#: at memory speed, so chunks shorter than ``PIPELINE_BYTES`` keep both stages busy.
DIRECT_CHUNK_BYTES = 16 << 20


def direct_read_bytes(layout: KVLayout, page_tokens: int, stage_slots: int = 0) -> int:
    """The bytes of pages one chunk of a direct restore reads (:meth:`KVSeam._direct_steps`:
    ``stage_slots`` pages where staging arenas hold a chunk) when its pages are whole pages of
    ``page_tokens`` cells: what each read-ahead thread's buffer must hold, one chunk per
    thread in flight (:meth:`KVSeam.warm_reads`)."""
    per_page = max(1, page_tokens * layout.kv_bytes_per_cell)
    step = stage_slots if stage_slots > 0 else max(1, DIRECT_CHUNK_BYTES // per_page)
    return step * page_nbytes(layout, page_tokens)


def chunks(plan: RestorePlan, layout: KVLayout) -> list[tuple[PageRef, ...]]:
    """``plan.pages`` cut into runs of about ``PIPELINE_BYTES`` of state each (one run when the
    restore is too small to pipeline)."""
    per_page = max(1, max((page.used for page in plan.pages), default=1)) * (
        layout.kv_bytes_per_cell + layout.meta_bytes_per_cell
    )
    step = max(1, PIPELINE_BYTES // per_page)
    pages = plan.pages
    return [pages[i : i + step] for i in range(0, len(pages), step)]


def _arena_groups(
    pages: tuple[PageRef, ...], in_arena: Callable[[tuple[PageRef, ...]], bool]
) -> list[tuple[bool, int, int]]:
    """``pages`` cut into runs held in an arena or not: (held, first, end) page indices."""
    groups: list[tuple[bool, int, int]] = []
    for i, page in enumerate(pages):
        held = bool(in_arena((page,)))
        if groups and groups[-1][0] == held:
            groups[-1] = (held, groups[-1][1], i + 1)
        else:
            groups.append((held, i, i + 1))
    return groups


def arena_spans(
    arena: HostArena, parts: list[tuple[ArenaSlot, int, int]]
) -> list[native_ext.HostSpan]:
    """The spans ``skippy_kv_cells_set/get`` take for positions ``[first, end)`` of the pages in
    arena slots (``parts``, consecutive): one per run of consecutive arena cells."""
    return [
        native_ext.HostSpan(run.n_cells, *arena.addresses(run), arena.capacity)
        for run in arena.runs(parts)
    ]


def cells_span(address: int, cells: PageCells, first: int, end: int) -> native_ext.HostSpan:
    """The span ``skippy_kv_cells_set`` takes for positions ``[first, end)`` of a serialized
    page at ``address`` (whose cells :meth:`~skippy_llama.state.pages.PageReader.cells`
    located), pointing into the page's own bytes: per layer K rows by cell, V rows by cell or
    (V transposed) ``v_embd`` rows ``cells.n_tokens`` cells apart, as an arena of that
    capacity."""
    if not cells.start <= first < end <= cells.end:
        raise StateFormatError(
            f"cells [{first}, {end}) are not in the page [{cells.start}, {cells.end})"
        )
    off = np.uint64(first - cells.start)
    base = np.uint64(address)
    k = base + cells.k + off * cells.k_step
    v = base + cells.v + off * cells.v_step
    # a transposed V row of the page is the whole page long: the copy strides over the rest
    row_cells = cells.n_tokens if cells.v_trans else end - first
    return native_ext.HostSpan(end - first, k, v, row_cells)


def _note_short_read(plan: RestorePlan, n_read: int, notes: list[str], faults: list[str]) -> int:
    """Note (a fallback note and a ``<tier>_short_read`` fault) a read that got only the first
    ``n_read`` of ``plan``'s pages, a page missing or failing its digest; the tokens those pages
    serve."""
    notes.append(plan.short_note(n_read))
    faults.append(f"{plan.pages[n_read].tier}_short_read")
    return plan.n_tokens - sum(page.used for page in plan.pages[n_read:])


def _cut_to_read(
    plan: RestorePlan, n_read: int, notes: list[str], faults: list[str]
) -> RestorePlan | None:
    """``plan`` cut to its first ``n_read`` pages, read before the sequence was touched (all of
    it when nothing is short), or None (noted) where a shallower plan does at least as well."""
    if n_read >= len(plan.pages):
        return plan
    n_tokens = _note_short_read(plan, n_read, notes, faults)
    return plan.truncated(n_tokens) if n_tokens > plan.floor else None


def _address(payload: bytes | memoryview) -> int:
    """Where ``payload``'s bytes are (they stay put while it is referenced)."""
    return int(np.frombuffer(payload, dtype=np.uint8).ctypes.data)


@dataclass
class _Fetched:
    """One chunk of a direct restore as the read-ahead thread left it: the pages read (a short
    read ends the restore with them; their payloads are views into the reading thread's
    buffer, valid until that thread's next read) and, per page, its payload's address and
    where its cells lie (None: a page of another layout, which the copies refuse). With a
    staging arena (``stage``), ``staged`` gives per page its slot there, or None for a page to
    copy from L2's arena (the read promoted it there) or, where that no longer holds it, from
    its own bytes."""

    got: list[FetchedPage]
    pages: list[tuple[int, PageCells | None]]
    stage: HostArena | None = None
    staged: list[ArenaSlot | None] = field(default_factory=list)


@dataclass
class _Chunk:
    """One chunk of a pipelined restore, read and assembled: its pages, the pool buffer
    holding their blob (None when nothing was read) and the blob's size; ``short`` when fewer
    pages were read than the chunk has (the restore ends with it)."""

    got: list[FetchedPage]
    buf: HostBuffer | None
    size: int
    short: bool


def backend_name() -> str:
    """The llama.cpp backend that holds the KV cache (``CPU``, ``CUDA`` ...)."""
    return native.backend_name()


def registered_backends() -> list[str]:
    return native.registered_backends()


class KVSeam:
    """llama.cpp state and sequence calls on one context's working sequence.

    Args:
        ctx: the ``llama_context`` pointer.
        buffers: the host buffers restores and captures reuse.
        on_device: L1 checkpoints live on the device that holds the cache (float K/V); False
            keeps them in host memory (quantized K/V, see ``SkippyLlama``).
    """

    def __init__(self, ctx: Any, buffers: BufferPool, *, on_device: bool) -> None:
        self.ctx = ctx
        self.buffers = buffers
        self.on_device = on_device
        #: Whether a pipelined restore wholly from L2 (host RAM, nothing to read) runs in
        #: chunks too, each assembled while the previous one is imported, in two chunk-sized
        #: pool buffers instead of one blob of the whole prefix. Off: on the H100 (session 39)
        #: whole L2 imports were measured, chunked ones not yet (``bench_gpu.py``'s
        #: ``l2_chunked`` compares them).
        self.chunk_ram_restores = False
        #: Whether a plan whose pages are all in L2's host arena is restored by the patched
        #: per-layer cell copies (:meth:`_from_arena`): on where the roster certifies
        #: ``layer_copy_exact`` and the runtime attached the arena (``runtime/arena_setup.py``).
        self.layer_copies = False
        #: Whether a page restore not wholly in the arena copies each fetched page's cells per
        #: layer from the page's bytes into the KV tensors (:meth:`_direct`): on where the roster
        #: certifies ``layer_copy_exact`` and the cache's layers match the state format, with
        #: or without L2 (``runtime/arena_setup.py``). Off: pages are assembled into a blob.
        self.page_copies = False
        #: With ``page_copies`` on a device (``runtime/arena_setup.open_staging``): two host
        #: arenas of a chunk's pages each (page-locked where buffers are pinned), one per
        #: read-ahead thread of :meth:`_direct`, into which each fetched page is copied before
        #: its chunk goes to the KV tensors as one copy per layer and K/V per run of slots
        #: (from a page's own pageable bytes it would be one short copy per page, layer and
        #: K/V, V transposed in rows of one page's cells). None: copied from the pages' bytes.
        self.staging: tuple[HostArena, HostArena] | None = None
        #: reads a pipelined restore's next chunk of pages (one per seam: a thread's L3 read
        #: buffer is reused by its next read, so two restores must not share the thread)
        self._ahead: ThreadPoolExecutor | None = None
        #: a direct restore's two read threads, taken in turn: a chunk's pages are views into
        #: its thread's read buffer, so the next chunk is read by the other thread
        self._direct_ahead: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        #: exports records' new cells into arena slots off the request path (``export.py``;
        #: ``runtime/arena_setup.open_exporter``); None: records are captured by :meth:`capture`
        self.exporter: CellExporter | None = None
        #: Set while no plan is executing (:meth:`execute` clears it for its duration). Work
        #: that only readies later restores waits on it between steps: the arenas' background
        #: prefault (``runtime/arena_setup.prefault``), which otherwise still runs when a fresh
        #: process's first request restores and takes a core from it (issue 45, s49: the
        #: first L3 restore with L2 on took 60-69 ms beside the prefault, 33-46 ms with it
        #: paused; ``benchmarks/results/arena-s49-prefault-*.json``).
        self.idle = threading.Event()
        self.idle.set()

    def _read_pools(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        if self._direct_ahead is None:
            self._direct_ahead = (
                ThreadPoolExecutor(1, thread_name_prefix="skippy-direct-a"),
                ThreadPoolExecutor(1, thread_name_prefix="skippy-direct-b"),
            )
        return self._direct_ahead

    @property
    def stage_slots(self) -> int:
        """Pages a chunk of a direct restore stages (the smaller staging arena's slots; 0:
        no staging arenas, a chunk is about ``DIRECT_CHUNK_BYTES``)."""
        return min(a.n_slots for a in self.staging) if self.staging is not None else 0

    def warm_reads(self, source: PageSource, layout: KVLayout, page_tokens: int) -> None:
        """Have each read-ahead thread of :meth:`_direct` (both read side by side, a chunk
        each) ready its reads of a chunk of whole pages of ``page_tokens`` cells now, in the
        background (``prepare_reads`` of ``source``, where it has one: ``TierPages``): so that
        a process's first restore from L3 does not take, on its request, the page faults of
        fresh read buffers (two chunks' worth, ~2 x 15 MB for SmolLM2) nor open a database
        connection per thread. Call it after the staging arenas are set (a chunk is then
        their slots' worth of pages; the arenas commit their own memory, ``arena_setup``). A
        read submitted meanwhile waits behind it on its thread."""
        prepare = getattr(source, "prepare_reads", None)
        if prepare is None or page_tokens <= 0:
            return
        nbytes = direct_read_bytes(layout, page_tokens, self.stage_slots)
        for pool in self._read_pools():
            pool.submit(prepare, nbytes)

    def close(self) -> None:
        """Drop the kept host buffers and stop the read-ahead thread (on close)."""
        self.settle()
        exporter, self.exporter = self.exporter, None
        if exporter is not None:
            exporter.close()
            exporter.arena.close()
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)
            self._ahead = None
        if self._direct_ahead is not None:
            for pool in self._direct_ahead:
                pool.shutdown(wait=True)
            self._direct_ahead = None
        if self.staging is not None:
            for arena in self.staging:
                arena.close()  # unpinned first (its on_close)
            self.staging = None
        self.buffers.clear()

    # -- the working sequence ---------------------------------------------------------------

    def live_cells(self) -> int:
        """Cells the working sequence holds (its highest position + 1)."""
        return native.seq_pos_max(self.ctx, WORKING_SEQ) + 1

    def cut(self, start: int = 0) -> None:
        """Remove the working sequence's cells from position ``start`` on (all by default)."""
        native.seq_rm(self.ctx, WORKING_SEQ, start if start > 0 else -1, -1)

    def state(self) -> bytes:
        """The working sequence's whole state (the probes compare it)."""
        return bytes(native.get_seq_state(self.ctx, WORKING_SEQ))

    def last_logits(self, n_vocab: int) -> npt.NDArray[np.float32]:
        return native.last_logits(self.ctx, n_vocab)

    def layout_from_cell(self) -> KVLayout:
        """The KV layout, read from one cell of the (non-empty) working sequence."""
        return parse_layout(native.capture_range(self.ctx, WORKING_SEQ, SCRATCH_SEQ, 0, 1))

    def layout_from_state(self) -> KVLayout:
        """The KV layout of the working sequence's whole state (sliding-window sections too)."""
        return parse_layout(native.get_seq_state(self.ctx, WORKING_SEQ))

    def capture(self, start: int, end: int, *, range_export: bool) -> memoryview:
        """The working sequence's cells at positions ``[start, end)``, in the stock format, in
        a buffer taken from the pool (``view.obj``; the caller gives it back).

        The patched range export where the roster certifies it (``range_export``), else the
        stock path (cells shared with a scratch sequence and serialized from there); both cost
        O(end - start).
        """
        buf = self.buffers.take()
        view: memoryview | None = None
        if range_export:
            try:
                view = native_ext.range_export(self.ctx, WORKING_SEQ, start, end, buf)
            except TierError as exc:
                log.warning("skippy-llama: range export failed (%s); using the stock path", exc)
        if view is None:
            try:
                view = native.capture_range(self.ctx, WORKING_SEQ, SCRATCH_SEQ, start, end, buf)
            except BaseException:
                self.buffers.give(buf)
                raise
        assert isinstance(view.obj, bytearray | mmap.mmap)
        if view.obj is not buf:  # outgrown: the call wrote a fresh buffer
            self.buffers.retire(buf)
        return view

    def export(self, parts: list[tuple[int, int]]) -> CellExport | None:
        """Start exporting the working sequence's cells of positions ``[start, end)`` of each
        of ``parts`` (a record's new pages) into the exporter's arena slots, off the request
        path; None when there is no exporter or no room (then :meth:`capture`)."""
        if self.exporter is None:
            return None
        return self.exporter.start(WORKING_SEQ, parts)

    def settle(self) -> None:
        """Wait for a record's export still copying cells out of the context: call before
        anything (a decode, a cut, a checkpoint) touches the context."""
        if self.exporter is not None:
            self.exporter.settle()

    # -- L1 checkpoints -----------------------------------------------------------------------

    def park(self, plan: ParkPlan) -> tuple[bytes, float]:
        """Checkpoint the working sequence's first ``plan.n_tokens`` cells into slot
        ``plan.seq_id`` (the cache's park plan); returns the checkpoint's handle and the
        seconds the checkpoint took (the cost model's park rate)."""
        for slot in plan.evict:
            if slot != plan.seq_id and self.on_device:
                # a slot keeps its buffers until its next checkpoint: shrink it to one cell
                native.checkpoint(self.ctx, WORKING_SEQ, slot, 1)
        started = time.perf_counter()
        handle = native.checkpoint(
            self.ctx, WORKING_SEQ, plan.seq_id, plan.n_tokens, on_device=self.on_device
        )
        return handle, time.perf_counter() - started

    # -- executing a plan ---------------------------------------------------------------------

    def execute(
        self,
        plan: RestorePlan,
        source: PageSource,
        layout: KVLayout | None,
        *,
        append: bool = False,
        pipeline: bool = False,
    ) -> RestoreOutcome:
        """Carry out ``plan`` on the working sequence, whose first ``plan.keep`` cells hold the
        prompt's first tokens, reading its pages from ``source``. Never raises: a step that
        fails gives a ``failed`` outcome (the request path asks for a shallower plan).

        ``append``: append plans may run (an L1 prefix continued with pages). ``pipeline``:
        the append import is available, so a page restore of more than ``PIPELINE_BYTES``
        runs a chunk at a time, each chunk read and assembled while the previous one is
        imported (:meth:`_pipelined`; one wholly from L2 only with ``chunk_ram_restores``).
        """
        notes: list[str] = []
        faults: list[str] = []
        self.idle.clear()
        try:
            outcome = self._try(plan, source, layout, append, pipeline, notes, faults)
        finally:
            self.idle.set()
        if outcome.failed:
            # the plan asked for, not its cut-short form: every tier it reads is left out next
            outcome.plan = plan
        outcome.fallbacks, outcome.faults = notes, faults
        return outcome

    def _try(
        self,
        plan: RestorePlan,
        source: PageSource,
        layout: KVLayout | None,
        append: bool,
        pipeline: bool,
        notes: list[str],
        faults: list[str],
    ) -> RestoreOutcome:
        if plan.pages and layout is not None and (self.layer_copies or self.page_copies):
            # a source with an arena (TierPages) says so; other sources (tests' fakes) have none
            in_arena = getattr(source, "in_arena", None)
            arena_read = getattr(source, "arena_read", None)
            has_arena = self.layer_copies and in_arena is not None and arena_read is not None
            if (
                has_arena
                and in_arena is not None
                and arena_read is not None
                and in_arena(plan.pages)
            ):
                return self._from_arena(plan, arena_read, layout, append, notes, faults)
            if (
                self.page_copies
                and layout.pageable
                and not layout.ext_bytes
                and (append or not plan.base_tokens)
            ):
                # pages from L3 (and L2's, in its arena or as bytes) copied per layer, in order
                groups = (
                    _arena_groups(plan.pages, in_arena)
                    if has_arena and in_arena is not None
                    else []
                )
                direct = self._direct(plan, groups, source, layout, notes, faults)
                if direct is not None:
                    return direct
                # the copies failed (cleared, noted): the stock state path restores the plan
        if (
            pipeline
            and layout is not None
            and (self.chunk_ram_restores or source.reads_storage(plan.pages))
        ):
            parts = chunks(plan, layout)
            if len(parts) > 1:
                return self._pipelined(plan, parts, source, layout, notes, faults)
        if plan.pages:
            fetched = source.fetch(plan.pages)
            short = _cut_to_read(plan, len(fetched), notes, faults)
            if short is None:
                return RestoreOutcome(plan, failed=True)  # nothing was touched
            plan = short
            try:
                size = self._load_pages(plan, fetched, layout, append)
            except Exception as exc:
                return self._failed(plan, plan.tier, exc, notes, faults, self._intact(plan))
            return RestoreOutcome(plan, restored=True, restored_bytes=size, fetched=tuple(fetched))
        if plan.seq_id is not None:
            try:
                self._copy_checkpoint(plan)
            except Exception as exc:
                outcome = self._failed(plan, "l1", exc, notes, faults)
                outcome.broken_checkpoint = plan.seq_id
                return outcome
            return RestoreOutcome(plan, restored=True)
        return RestoreOutcome(plan)

    def _from_arena(
        self,
        plan: RestorePlan,
        arena_read: Callable[
            [tuple[PageRef, ...]],
            AbstractContextManager[tuple[HostArena, list[ArenaSlot]] | None],
        ],
        layout: KVLayout,
        append: bool,
        notes: list[str],
        faults: list[str],
    ) -> RestoreOutcome:
        """A plan wholly from L2's host arena: its pages' cells go from the arena straight into
        the KV tensors, one copy per layer and K/V per run of consecutive slots
        (``skippy_kv_cells_set``), with no state blob. L2 stays locked while the copies run.
        A short read ends the restore where the slots end, as :meth:`_try` does."""
        with arena_read(plan.pages) as held:
            if held is None:
                return RestoreOutcome(plan, failed=True)  # pragma: no cover - checked before
            arena, slots = held
            short = _cut_to_read(plan, len(slots), notes, faults)
            if short is None:
                return RestoreOutcome(plan, failed=True)  # nothing was touched
            plan = short
            try:
                cells = self._import_arena(plan, arena, slots[: len(plan.pages)], append)
            except Exception as exc:
                return self._failed(plan, plan.tier, exc, notes, faults, self._intact(plan))
        fetched = tuple(FetchedPage(ref.tier, ref.key, b"") for ref in plan.pages)
        return RestoreOutcome(
            plan,
            restored=True,
            # the state bytes the same cells take as a blob, so L2's rate compares across paths
            restored_bytes=state_bytes(layout, cells),
            fetched=fetched,
            promoted=True,  # L2 is the shallowest page tier: nothing to promote into
        )

    def _direct(
        self,
        plan: RestorePlan,
        groups: list[tuple[bool, int, int]],
        source: PageSource,
        layout: KVLayout,
        notes: list[str],
        faults: list[str],
    ) -> RestoreOutcome | None:
        """A page restore by per-layer copies, no state blob: each run of pages held in L2's
        arena (``groups``; none without one) is copied from its slots, every other page from
        its own fetched bytes (:func:`cells_span`) or, with staging arenas, from the slots
        the read staged it in, in position order. The other pages are read a chunk
        (``DIRECT_CHUNK_BYTES``) at a time by two read-ahead threads side by side, each chunk
        read, verified, located (``PageReader``) and promoted (into L2's arena, where there is
        one) while the chunks before it are read or copied. A page that fails its digest ends
        the read (a short read: the restore ends where the pages end, or a shallower plan
        runs). A copy or parse that fails clears what this restore added and returns None: the caller restores the
        plan by the stock state path instead."""
        steps = self._direct_steps(plan, groups, layout, self.stage_slots)
        pools = self._read_pools()
        turn = 0
        # the steps read from pages, in order, and the reads in flight or not yet copied: at
        # most one per thread, so a thread's next read (which reuses its read buffer and its
        # staging arena) is submitted only after its previous chunk was copied
        to_read = [j for j, step in enumerate(steps) if not step[0]]
        reads: deque[Future[_Fetched]] = deque()

        def read_ahead() -> None:
            nonlocal turn
            while to_read and len(reads) < len(pools):
                i0, i1 = steps[to_read.pop(0)][1:]
                turn ^= 1
                stage = self.staging[turn] if self.staging is not None else None
                reads.append(
                    pools[turn].submit(
                        self._read_pages,
                        plan.pages[i0:i1],
                        source,
                        plan.n_tokens,
                        layout,
                        stage,
                    )
                )

        def drain() -> None:
            # no read may still be running when the next restore starts
            while reads:
                with contextlib.suppress(Exception):
                    reads.popleft().result()

        base = plan.base_tokens
        pos = base  # the next position to restore
        done = 0  # pages restored
        fetched: list[FetchedPage] = []
        placed = False
        try:
            # both threads read from the start: while one chunk is copied, the next two are
            # read, verified, parsed, promoted (and staged) side by side
            read_ahead()
            for held, i0, i1 in steps:
                refs = plan.pages[i0:i1]
                # the first read comes before the sequence is touched: nothing read leaves the
                # live sequence as it was for a shallower plan
                if not held and not placed and not reads[0].result().got:
                    drain()
                    _note_short_read(plan, 0, notes, faults)
                    return RestoreOutcome(plan, failed=True)
                if not placed:
                    if base:
                        self._place_base(plan)
                    else:
                        self.cut()
                    placed = True
                if held:
                    # the reads in flight overlap this copy too
                    with getattr(source, "arena_read")(refs) as read:  # noqa: B009 - checked
                        n_got = 0
                        if read is not None:
                            arena, slots = read
                            if slots:
                                self._copy_slots(plan, arena, slots, i0, pos)
                            n_got = len(slots)
                    fetched += [FetchedPage(r.tier, r.key, b"") for r in refs[:n_got]]
                else:
                    chunk = reads[0].result()
                    n_got = len(chunk.got)
                    if n_got:
                        pos = self._copy_fetched(plan, chunk, i0, pos, source)
                    reads.popleft()  # copied: its thread may read again
                    fetched += chunk.got
                    if n_got == len(refs):
                        read_ahead()
                done = i0 + n_got
                pos = plan.n_tokens - sum(page.used for page in plan.pages[done:])
                if n_got < len(refs):
                    break
        except Exception as exc:
            drain()
            self._failed(plan, plan.tier, exc, notes, faults, self._intact(plan))
            return None
        drain()  # reads ahead of a short read
        n_tokens = plan.n_tokens - sum(page.used for page in plan.pages[done:])
        outcome = RestoreOutcome(
            plan,
            restored=True,
            restored_bytes=state_bytes(layout, n_tokens - base),
            fetched=tuple(fetched),
            promoted=True,  # each chunk was promoted as it was read
        )
        if done < len(plan.pages):
            _note_short_read(plan, done, notes, faults)
            if n_tokens <= plan.floor or n_tokens <= base or not done:
                self.cut(self._intact(plan))  # a shallower plan does at least as well
                return RestoreOutcome(plan, failed=True)
            outcome.plan = plan.truncated(n_tokens)
        return outcome

    @staticmethod
    def _direct_steps(
        plan: RestorePlan,
        groups: list[tuple[bool, int, int]],
        layout: KVLayout,
        stage_slots: int = 0,
    ) -> list[tuple[bool, int, int]]:
        """``groups`` (all pages outside an arena when empty) with each run outside the arena
        cut into chunks of about ``DIRECT_CHUNK_BYTES`` (of ``stage_slots`` pages where they
        are staged): (in arena, first, end) page indices."""
        per_page = max(1, max(page.used for page in plan.pages)) * layout.kv_bytes_per_cell
        step = stage_slots if stage_slots > 0 else max(1, DIRECT_CHUNK_BYTES // per_page)
        out: list[tuple[bool, int, int]] = []
        for held, i0, i1 in groups or [(False, 0, len(plan.pages))]:
            if held:
                out.append((held, i0, i1))
            else:
                out += [(False, i, min(i + step, i1)) for i in range(i0, i1, step)]
        return out

    @staticmethod
    def _read_pages(
        refs: tuple[PageRef, ...],
        source: PageSource,
        prefix_tokens: int,
        layout: KVLayout,
        stage: HostArena | None = None,
    ) -> _Fetched:
        """A read-ahead thread's stage of :meth:`_direct`: ``refs`` fetched (verified), their
        cells located in their bytes (``PageReader``: no views are made), and offered to the
        shallower tiers (L2's arena copies them there) before this thread's next read reuses
        its buffer; then, with a staging arena, each page that L2's arena did not take is
        copied into slot i of ``stage`` from its bytes (a page already in the arena is not
        copied twice). A page that does not parse ends the chunk there."""
        got = source.fetch(refs)
        reader = page_reader(layout)
        pages: list[tuple[int, PageCells | None]] = []
        for page in got:
            try:
                cells: PageCells | None = reader.cells(page.payload)
            except StateFormatError:
                try:
                    page_from_bytes(page.payload)
                except StateFormatError:
                    break
                cells = None  # a page, of another layout: the copy refuses it (the state path)
            pages.append((_address(page.payload), cells))
        got = got[: len(pages)]
        if got:
            source.promote(got, prefix_tokens)
        if stage is None:
            return _Fetched(got, pages)
        promoted = getattr(source, "promoted_in_arena", None)
        # the cells were located in the context's layout: the staging arena must have it too
        same = stage.layout == layout
        staged: list[ArenaSlot | None] = []
        for i, (ref, page, (_, cells)) in enumerate(zip(refs, got, pages, strict=False)):
            if promoted is not None and promoted((ref,)):
                staged.append(None)  # promoted: copied from L2's arena
            elif same and cells is not None and i < stage.n_slots and stage.fits_cells(cells):
                staged.append(stage.write_cells(i, page.payload, cells))
            else:
                staged.append(None)  # copied from its own bytes (or refused there)
        return _Fetched(got, pages, stage, staged)

    def _copy_fetched(
        self,
        plan: RestorePlan,
        chunk: _Fetched,
        first: int,
        pos: int,
        source: PageSource,
    ) -> int:
        """Append the cells of a fetched chunk (pages ``first ..`` of ``plan``), continuing
        the sequence at position ``pos``; returns the next position. Staged pages go from the
        staging arena, pages the read promoted from L2's arena (locked and verified as an L2
        restore is), the others (or ones L2 dropped meanwhile) from their own bytes."""
        if chunk.stage is None:
            return self._copy_pages(plan, chunk.pages, first, pos)
        n = len(chunk.pages)
        i = 0
        while i < n:
            staged = chunk.staged[i] is not None
            j = i + 1
            while j < n and (chunk.staged[j] is not None) == staged:
                j += 1
            if staged:
                slots = [slot for slot in chunk.staged[i:j] if slot is not None]
                pos = self._copy_slots(plan, chunk.stage, slots, first + i, pos)
            else:
                pos = self._copy_promoted(plan, chunk.pages[i:j], first + i, pos, source)
            i = j
        return pos

    def _copy_promoted(
        self,
        plan: RestorePlan,
        pages: list[tuple[int, PageCells | None]],
        first: int,
        pos: int,
        source: PageSource,
    ) -> int:
        """Append pages ``first ..`` of ``plan`` from L2's arena, as far as it still holds
        them, and the rest from their own bytes (``pages``: each one's address and cells,
        :meth:`_read_pages`); returns the next position."""
        refs = plan.pages[first : first + len(pages)]
        promoted_read = getattr(source, "promoted_read", None)
        held = 0
        if promoted_read is not None:
            with promoted_read(refs) as read:
                if read is not None and read[1]:
                    arena, slots = read
                    pos = self._copy_slots(plan, arena, slots, first, pos)
                    held = len(slots)
        if held < len(pages):
            pos = self._copy_pages(plan, pages[held:], first + held, pos)
        return pos

    def _copy_pages(
        self, plan: RestorePlan, pages: list[tuple[int, PageCells | None]], first: int, pos: int
    ) -> int:
        """Append the cells of pages ``first ..`` of ``plan`` (``pages``: each one's address
        and cells, :meth:`_read_pages`) from their own bytes, continuing the sequence at
        position ``pos``; returns the next position."""
        spans: list[native_ext.HostSpan] = []
        p0 = pos
        for ref, (address, cells) in zip(
            plan.pages[first : first + len(pages)], pages, strict=True
        ):
            if cells is None:
                raise StateFormatError("a page's layout differs from the context's")
            end = cells.start + ref.used
            if not cells.start <= pos < end <= cells.end:
                raise StateFormatError(
                    f"page [{cells.start}, {cells.end}) does not continue position {pos} to {end}"
                )
            spans.append(cells_span(address, cells, pos, end))
            pos = end
        if not native_ext.cells_set(self.ctx, WORKING_SEQ, p0, spans):
            raise TierError("skippy_kv_cells_set refused the pages' cells")
        return pos

    def _copy_slots(
        self, plan: RestorePlan, arena: HostArena, slots: list[ArenaSlot], first: int, pos: int
    ) -> int:
        """Append the cells of pages ``first ..`` of ``plan``, held in ``slots`` of ``arena``
        (L2's or a staging one), continuing the sequence at position ``pos`` (cells below it,
        an append plan's L1 prefix, are not copied); returns the next position."""
        parts: list[tuple[ArenaSlot, int, int]] = []
        end = pos
        for ref, slot in zip(plan.pages[first : first + len(slots)], slots, strict=True):
            lo, end = max(slot.start, end), slot.start + ref.used
            if lo < end:
                parts.append((slot, lo, end))
        if not parts:
            raise StateFormatError("the arena's pages hold none of the planned cells")
        if parts[0][1] != pos:
            raise StateFormatError(f"the arena's pages do not continue position {pos}")
        # arena_spans checks that the parts are consecutive positions
        if not native_ext.cells_set(self.ctx, WORKING_SEQ, pos, arena_spans(arena, parts)):
            raise TierError("skippy_kv_cells_set refused the arena's cells")
        return parts[-1][2]

    def _import_arena(
        self, plan: RestorePlan, arena: HostArena, slots: list[ArenaSlot], append: bool
    ) -> int:
        """Put the plan's L1 prefix in place (or clear the sequence) and copy the slots' cells
        after it; returns the cells copied."""
        base = plan.base_tokens
        if base and not append:
            raise TierError("an append plan without append import")
        parts: list[tuple[ArenaSlot, int, int]] = []
        for ref, slot in zip(plan.pages, slots, strict=True):
            first, end = max(slot.start, base), slot.start + ref.used
            if first < end:
                parts.append((slot, first, end))
        if not parts or parts[0][1] != base or parts[-1][2] != plan.n_tokens:
            raise StateFormatError("the arena's pages do not cover the planned prefix")
        spans = arena_spans(arena, parts)
        if base:
            self._place_base(plan)
        else:
            self.cut()
        if not native_ext.cells_set(self.ctx, WORKING_SEQ, base, spans):
            raise TierError("skippy_kv_cells_set refused the arena's cells")
        return plan.n_tokens - base

    def _failed(
        self,
        plan: RestorePlan,
        step: str,
        exc: Exception,
        notes: list[str],
        faults: list[str],
        keep: int = 0,
    ) -> RestoreOutcome:
        """A restore step raised: the working sequence is half-written, so it is cleared from
        ``keep`` on (0: all of it)."""
        faults.append(f"{step}: {type(exc).__name__}")
        notes.append(f"{step}: {exc}")
        log.warning("skippy-llama: %s failed (%s); continuing without it", step, exc)
        self.cut(keep)
        return RestoreOutcome(plan, failed=True)

    @staticmethod
    def _intact(plan: RestorePlan) -> int:
        """Cells of the working sequence a failed page restore of ``plan`` left as they were:
        an append plan over the live sequence writes nothing below its base (the append import
        removes what a failed call added), so the fallback can still reuse it."""
        return plan.base_tokens if plan.seq_id is None else 0

    def _copy_checkpoint(self, plan: RestorePlan) -> None:
        """Copy a checkpoint into the working sequence and keep its first ``n_tokens`` cells."""
        assert plan.seq_id is not None
        native.restore_checkpoint(self.ctx, plan.handle, WORKING_SEQ, on_device=self.on_device)
        native.seq_rm(self.ctx, WORKING_SEQ, plan.n_tokens, -1)

    def _load_pages(
        self,
        plan: RestorePlan,
        fetched: list[FetchedPage],
        layout: KVLayout | None,
        append: bool,
    ) -> int:
        """Assemble fetched pages into a blob and restore it into the working sequence;
        returns the bytes restored.

        An append plan first puts its L1 prefix in place (the live sequence cut to it, or a
        checkpoint copied on the device) and append-imports only the pages' cells after it;
        any other plan rebuilds the whole prefix with one ``set_data``.
        """
        if layout is None:
            raise StateFormatError("the KV layout is unknown: pages cannot be assembled")
        if plan.base_tokens and not append:
            raise TierError("an append plan without append import")
        buf, size = self._assemble(plan, fetched, 0, layout)
        try:
            self._import(plan, buf, size, first=True)
        finally:
            self.buffers.give(buf)
        return size

    def _pipelined(
        self,
        plan: RestorePlan,
        parts: list[tuple[PageRef, ...]],
        source: PageSource,
        layout: KVLayout,
        notes: list[str],
        faults: list[str],
    ) -> RestoreOutcome:
        """A page restore a chunk at a time, two stages deep: while one chunk is imported (its
        device copies release the GIL), the read-ahead thread reads, verifies, decodes and
        assembles the next one into a second pool buffer (:meth:`_prepare`). The first chunk
        rebuilds the prefix (``set_data``) or continues the plan's L1 prefix; the others are
        append-imported after it.

        A short fetch ends the restore where the pages end (like :meth:`_try`); a failure
        clears the working sequence and fails the outcome.
        """
        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(1, thread_name_prefix="skippy-restore")
        ahead = self._ahead
        pending: Future[_Chunk] | None = ahead.submit(
            self._prepare, plan, parts[0], 0, source, layout
        )
        fetched: list[FetchedPage] = []
        size = 0
        try:
            for i in range(len(parts)):
                assert pending is not None
                chunk = pending.result()
                pending = None
                if chunk.buf is None:
                    break  # nothing read (short): the restore ends before this chunk
                restored = len(fetched)
                if not chunk.short and i + 1 < len(parts):
                    pending = ahead.submit(
                        self._prepare,
                        plan,
                        parts[i + 1],
                        restored + len(chunk.got),
                        source,
                        layout,
                    )
                try:
                    self._import(plan, chunk.buf, chunk.size, first=restored == 0)
                finally:
                    self.buffers.give(chunk.buf)
                fetched += chunk.got
                size += chunk.size
                if chunk.short:
                    break
        except Exception as exc:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(Exception):
                    # no read may still be writing when the next one starts, and the buffer it
                    # assembled goes back to the pool
                    left = pending.result()
                    if left.buf is not None:
                        self.buffers.give(left.buf)
            return self._failed(plan, plan.tier, exc, notes, faults, self._intact(plan))
        restored = len(fetched)
        outcome = RestoreOutcome(
            plan, restored=True, restored_bytes=size, fetched=tuple(fetched), promoted=True
        )
        if restored < len(plan.pages):
            n_tokens = _note_short_read(plan, restored, notes, faults)
            if not restored:
                # nothing was read: the working sequence is untouched
                return RestoreOutcome(plan, failed=True)
            if n_tokens <= plan.floor:
                self.cut(self._intact(plan))  # a shallower plan does at least as well
                return RestoreOutcome(plan, failed=True)
            outcome.plan = plan.truncated(n_tokens)
        return outcome

    def _prepare(
        self,
        plan: RestorePlan,
        part: tuple[PageRef, ...],
        first: int,
        source: PageSource,
        layout: KVLayout,
    ) -> _Chunk:
        """The read-ahead thread's stage: chunk ``part`` (pages ``first ..`` of ``plan``)
        fetched, assembled into a pool buffer, and promoted to the shallower tiers before this
        thread's next read reuses its read buffer."""
        got = source.fetch(part)
        if not got:
            return _Chunk(got, None, 0, short=True)
        buf, size = self._assemble(plan, got, first, layout)
        try:
            source.promote(got, plan.n_tokens)
        except BaseException:
            self.buffers.give(buf)
            raise
        return _Chunk(got, buf, size, short=len(got) < len(part))

    def _assemble(
        self, plan: RestorePlan, got: list[FetchedPage], first: int, layout: KVLayout
    ) -> tuple[HostBuffer, int]:
        """Pages ``first ..`` of ``plan`` (``got``) as one blob in a pool buffer, and its size.

        Each page must hold the tokens the plan uses of it: a page shorter than its entry says
        would leave the prefix short of what the runtime adopts."""
        want = plan.pages[first : first + len(got)]
        pages = [
            page_from_bytes(page.payload).head(ref.used)
            for page, ref in zip(got, want, strict=True)
        ]
        if not pages:
            raise StateFormatError("nothing to assemble: no pages")
        base = plan.base_tokens if first == 0 else 0
        if base:
            if not pages[0].start <= base < pages[0].end:
                raise StateFormatError("the append plan's first page does not reach past L1")
            pages[0] = pages[0].span(base, pages[0].end)
        start = pages[0].start
        # where the plan's pages end, for those up to this chunk (the plan's last ends at
        # n_tokens; ``used`` counts from each page's start)
        end = plan.n_tokens - sum(ref.used for ref in plan.pages[first + len(got) :])
        if start + sum(p.n_tokens for p in pages) != end:
            raise StateFormatError("restored pages do not cover the planned prefix")
        size = assembled_size(pages, layout, start=start)
        buf = self.buffers.take(size)
        try:
            assemble_into(buf, pages, layout, seq_id=WORKING_SEQ, start=start)
        except BaseException:
            self.buffers.give(buf)
            raise
        return buf, size

    def _import(self, plan: RestorePlan, buf: HostBuffer, size: int, *, first: bool) -> None:
        """Load an assembled chunk: the first one rebuilds the prefix (or continues the plan's
        L1 prefix), later ones are append-imported after the last."""
        if first and not plan.base_tokens:
            if not native.set_seq_state(self.ctx, buf, WORKING_SEQ, size):
                raise TierError("llama_state_seq_set_data refused the blob")
            return
        if first:
            self._place_base(plan)
        if not native_ext.append_import(self.ctx, memoryview(buf)[:size], WORKING_SEQ):
            raise TierError("skippy_state_seq_append_data refused the pages")

    def _place_base(self, plan: RestorePlan) -> None:
        """Leave exactly the L1 prefix of an append plan in the working sequence."""
        base = plan.base_tokens
        if plan.seq_id is not None:
            native.restore_checkpoint(self.ctx, plan.handle, WORKING_SEQ, on_device=self.on_device)
        elif self.live_cells() < base:
            raise TierError("the live sequence no longer holds the append plan's L1 prefix")
        # append import continues after the last position: nothing may follow the prefix
        native.seq_rm(self.ctx, WORKING_SEQ, base, -1)
