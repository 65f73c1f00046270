"""Attaching L2's host arena (:mod:`skippy_llama.tiers.arena`) where the per-layer copies serve.

An L2 restore through the arena copies each run of pages straight into the KV tensors with the
patched ``skippy_kv_cells_set`` (patch 0006). That path is taken only where everything agrees:
an L2 tier, a pageable layout, a roster verdict that certifies ``layer_copy_exact`` for this
model and backend, and a cache whose layers (as llama.cpp reports them) are the ones the state
format describes. Anywhere else L2 keeps page bytes and restores by the stock state path.

The same copies restore pages read from L3 (``KVSeam.page_copies``, :func:`enable_page_copies`):
that needs everything above but L2. On the CPU from each page's own bytes; where the cache is on
a device through two small staging arenas (pinned on CUDA builds, :func:`open_staging`), or from
L2's arena when the read promoted a page there. The arenas' memory is committed ahead of use (by
the registration when pinned, else by a background thread, :func:`prefault`; for L2's arena a
context's worth of slots, :func:`prefault_slots`), so that the first restore or promotion into
slots never written before does not take its page faults on a request.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import threading
from dataclasses import dataclass
from typing import Any

import llama_cpp

from ..cache import PrefixCache
from ..hostmem import MADV_POPULATE_WRITE, Pinner, madvise_call
from ..roster import Verdict
from ..state import KVLayout
from ..tiers.arena import HostArena, slot_count
from . import native_ext
from .export import CellExporter
from .seam import DIRECT_CHUNK_BYTES, KVSeam

log = logging.getLogger("skippy_llama")

#: The largest arena that is page-locked (CUDA builds). Registering locks and commits all of it at
#: load (measured on an H100: 53-62 ms per 720 MB, ``skippy_llama/pinned.py``), so an L2 budget
#: far above what L2 holds would take that much RAM from the machine; a larger arena stays
#: pageable (its copies are staged by the driver: slower, the same bytes).
PIN_ARENA_MAX_BYTES = 8 << 30


def layers_match(infos: list[native_ext.KVLayerInfo], layout: KVLayout) -> str | None:
    """Why the cache's layers (``skippy_kv_layers``) differ from ``layout`` (None: they agree)."""
    if len(infos) != layout.n_layer:
        return f"the cache has {len(infos)} layers, the state {layout.n_layer}"
    for il, (info, layer) in enumerate(zip(infos, layout.layers, strict=True)):
        v = (info.v_elem, info.n_embd_v) if layout.v_trans else (info.v_row, 0)
        got = (info.type_k, info.k_row, info.type_v, *v, bool(info.v_trans))
        want = (layer.k_type, layer.k_row, layer.v_type, layer.v_unit, layer.v_embd)
        if got != (*want, layout.v_trans):
            return f"layer {il}: the cache reports {got}, the state {want}"
    return None


def copy_refusal(ctx: Any, layout: KVLayout | None, verdict: Verdict) -> str | None:
    """Why the per-layer cell copies cannot restore pages of ``layout`` (None: they can)."""
    if layout is None or not layout.pageable or layout.ext_bytes:
        return "the KV layout cannot be kept in an arena"
    if not verdict.layer_copy:
        return f"layer_copy_exact is not certified ({verdict.kind})"
    infos = native_ext.kv_layers(ctx)
    if infos is None:
        return "the library or this cache type has no per-layer cell copies"
    return layers_match(infos, layout)


def enable_page_copies(
    ctx: Any,
    seam: KVSeam,
    layout: KVLayout | None,
    verdict: Verdict,
    *,
    on_device: bool = False,
    page_tokens: int = 0,
    pinner: Pinner | None = None,
) -> str | None:
    """Turn on the seam's restores of fetched pages by per-layer copies (no state blob);
    returns why not (None: on).

    On the CPU each page's cells are copied from its own bytes. Where the cache is on a device
    (``on_device``) a page's bytes lie in a pageable read buffer, and copies from there are
    one short transfer per page, layer and K/V (V transposed: rows of one page's cells), each
    staged by the driver; so the pages are first put into a staging arena of ``page_tokens``
    cells a slot (:func:`open_staging`, pinned by ``pinner`` where it can) and a chunk goes
    over the bus as L2's arena restores go. Until then (this was CPU-only) GPU builds took the
    pipelined blob import, whose assembly and parse held an H100's 8k-token L3 restore to
    2.2 GB/s (``benchmarks/results/gpu-h100-s45-arena-fa1.json``)."""
    refusal = copy_refusal(ctx, layout, verdict)
    if refusal is None and on_device:
        assert layout is not None
        if page_tokens <= 0:
            refusal = "no page size for the staging arena"
        else:
            seam.staging = open_staging(layout, page_tokens, pinner, seam.idle)
    seam.page_copies = refusal is None
    return refusal


#: Bytes of pages each of the two staging arenas holds (a chunk of a direct restore,
#: ``seam.DIRECT_CHUNK_BYTES``): one is copied to the device while the other is filled.
STAGING_BYTES = DIRECT_CHUNK_BYTES


def open_staging(
    layout: KVLayout,
    page_tokens: int,
    pinner: Pinner | None,
    idle: threading.Event | None = None,
) -> tuple[HostArena, HostArena]:
    """Two staging arenas of ``STAGING_BYTES`` (at least one page each), page-locked by
    ``pinner`` where it can (committed by the registration, a few ms at load), otherwise
    committed by a background thread (:func:`prefault`, waiting on ``idle`` while a restore
    runs): a process's first restore must not pay their page faults."""
    per = page_tokens * layout.kv_bytes_per_cell
    n = max(1, STAGING_BYTES // per) if per > 0 else 1
    arenas = (HostArena(layout, page_tokens, n), HostArena(layout, page_tokens, n))
    for arena in arenas:
        if pinner is not None and pinner.pin(arena.buffer):
            arena.on_close = functools.partial(pinner.unpin, arena.buffer)
        elif PREFAULT:
            arena.prefault_thread = prefault(arena, idle=idle)
    return arenas


#: Whether :func:`attach_arena` prefaults a pageable arena (``benchmarks/bench_arena.py`` turns it
#: off to measure what the prefault saves the first promotion).
PREFAULT = True
#: Bytes the prefault thread commits per call (it stops between calls when the arena closes,
#: and waits between them while a restore runs: a call under way when one starts competes
#: with it to its end, ~1-2 ms at this size on the 2-core VM).
PREFAULT_STEP = 4 << 20
#: How often (seconds) a prefault waiting for a restore to end checks that its arena closes.
PREFAULT_POLL_S = 0.05


def prefault_slots(arena: HostArena, n_ctx: int) -> int:
    """How many of ``arena``'s first slots to commit at load: a context's worth of pages.

    A request promotes at most one prefix, no longer than the context, and slots are handed
    out in order from the first, so these are the slots the first promotion writes: it meets no
    page faults. Committing every slot instead would take all of ``l2.budget`` from the
    machine's RAM at load (an 8 GiB budget: 8 GiB, for as long as the process lives) whether L2
    ever holds that much or not; a slot past these is committed by its first put, once."""
    return min(arena.n_slots, -(-max(n_ctx, 0) // arena.page_tokens))


def _page_ranges(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` widened to whole OS pages (``madvise`` takes page-aligned addresses), ranges
    that then touch or overlap merged."""
    page = mmap.PAGESIZE
    out: list[tuple[int, int]] = []
    for address, nbytes in spans:
        lo, hi = address - address % page, address + nbytes
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return [(lo, hi - lo) for lo, hi in out]


def prefault(
    arena: HostArena, n_slots: int | None = None, idle: threading.Event | None = None
) -> threading.Thread | None:
    """Commit the memory of ``arena``'s first ``n_slots`` slots (None: all of them; see
    :func:`prefault_slots`) in a background thread, so a promotion into slots never written
    before does not pay the kernel's page faults on a request (measured on the CPU: 228-252 ms
    at the first promotion of a 3,900-token prefix). ``MADV_POPULATE_WRITE`` leaves the bytes
    as they are, so puts may run meanwhile, and the call (through ctypes) lets the GIL go.
    With ``idle`` (the seam's, :attr:`KVSeam.idle`) each step of ``PREFAULT_STEP`` bytes
    waits until no restore runs: the prefault readies later restores and must not slow the
    one under way (a fresh process's first request comes while it still runs).
    Where the kernel lacks it nothing is done. Returns the thread (None: not on Linux)."""
    try:
        madvise = madvise_call()
    except (OSError, AttributeError):
        return None
    want = arena.n_slots if n_slots is None else n_slots

    def run() -> None:
        for address, nbytes in _page_ranges(arena.spans(want)):
            for off in range(0, nbytes, PREFAULT_STEP):
                while idle is not None and not idle.wait(PREFAULT_POLL_S):
                    if arena.closing:
                        return
                if arena.closing:
                    return
                step = min(PREFAULT_STEP, nbytes - off)
                if madvise(address + off, step, MADV_POPULATE_WRITE):
                    log.debug("skippy-llama: arena prefault stopped (errno %d)", ctypes.get_errno())
                    return
        arena.prefaulted = True

    thread = threading.Thread(target=run, name="skippy-arena-prefault", daemon=True)
    thread.start()
    return thread


def attach_arena(
    ctx: Any,
    seam: KVSeam,
    cache: PrefixCache,
    layout: KVLayout | None,
    verdict: Verdict,
    *,
    pinner: Pinner | None = None,
) -> str | None:
    """Give L2 a host arena and turn the seam's arena restores on; returns why not (None: on)."""
    ram = cache.ram
    if ram is None:
        return "no L2"
    refusal = copy_refusal(ctx, layout, verdict)
    if refusal is not None:
        return refusal
    assert layout is not None
    n = slot_count(ram.budget_bytes, layout, cache.page_tokens)
    if n <= 0:
        return "the L2 budget is smaller than one page"
    arena = HostArena(layout, cache.page_tokens, n)
    if pinner is not None and arena.nbytes <= PIN_ARENA_MAX_BYTES and pinner.pin(arena.buffer):
        ram.arena_pinned = True
        arena.on_close = lambda: pinner.unpin(arena.buffer)
    else:
        # a pinned arena is committed by the registration; a pageable one in the background,
        # a context's worth of it (prefault_slots says why not all)
        want = prefault_slots(arena, int(llama_cpp.llama_n_ctx_seq(ctx)))
        arena.prefault_thread = prefault(arena, want, seam.idle) if PREFAULT else None
    ram.attach_arena(arena)
    seam.layer_copies = True
    log.info(
        "skippy-llama: L2 keeps pages in a %s host arena of %d slots (%.1f MiB)",
        "pinned" if ram.arena_pinned else "pageable",
        n,
        arena.nbytes / (1 << 20),
    )
    return None


#: The export arena holds this many contexts' worth of cells: a record's export and the one
#: before it, which the L3 writer may still be cutting pages from.
EXPORT_CONTEXTS = 2


def open_exporter(
    ctx: Any,
    seam: KVSeam,
    cache: PrefixCache,
    layout: KVLayout | None,
    verdict: Verdict,
    n_ctx: int,
    *,
    pinner: Pinner | None = None,
    on_device: bool = False,
) -> str | None:
    """Give the seam an exporter of records' new cells into arena slots (``export.py``), so
    no capture lands on a request; returns why not (None: on). Where there is none, records
    are captured through the state format (and wait on GPU builds, ``recording.py``).

    The export runs on the exporter's thread where the KV cache is on a device
    (``on_device``: the thread waits for the device-to-host copies while the request
    returns); on the CPU on the request thread, right after the decode: there the copy is a
    memcpy of warm slots (2-3 ms for 500 tokens of SmolLM2), which a thread handed over to,
    contending for the GIL and the cores, finished later than the next request began
    (``bench_record_path.py``, ``record-path-s48-hC-2.json``: 5 of 8 requests waited 1-21 ms).

    The arena holds ``EXPORT_CONTEXTS`` times the context's cells in whole pages (its memory
    is committed where written, or all at once where it is pinned: CUDA builds, up to
    ``PIN_ARENA_MAX_BYTES``, so the device-to-host copies run asynchronously by DMA)."""
    if not cache.takes_records:
        return "no tier takes records"
    if n_ctx <= 0:
        return "the context size is unknown"
    refusal = copy_refusal(ctx, layout, verdict)
    if refusal is not None:
        return refusal
    assert layout is not None
    page = cache.page_tokens
    arena = HostArena(layout, page, EXPORT_CONTEXTS * (-(-n_ctx // page)))
    if pinner is not None and arena.nbytes <= PIN_ARENA_MAX_BYTES and pinner.pin(arena.buffer):
        arena.on_close = lambda: pinner.unpin(arena.buffer)
    seam.exporter = CellExporter(
        ctx,
        arena,
        background=on_device,
        on_error=lambda why: cache.fallback(f"record: {why}"),
    )
    return None


@dataclass(frozen=True)
class PagePaths:
    """Why pages are not restored by per-layer copies (None: they are).

    Attributes:
        page_copy_refusal: why pages read from L3 are assembled into a state blob rather than
            copied per layer from their own bytes into the KV tensors.
        arena_refusal: why L2 keeps page bytes rather than its host arena.
        export_refusal: why records are captured through the state format rather than
            exported into arena slots off the request path (``export.py``).
    """

    page_copy_refusal: str | None
    arena_refusal: str | None
    export_refusal: str | None = "not asked"


def open_page_paths(
    ctx: Any,
    seam: KVSeam,
    cache: PrefixCache,
    layout: KVLayout | None,
    verdict: Verdict,
    *,
    on_device: bool,
    pinner: Pinner | None,
    n_ctx: int = 0,
) -> PagePaths:
    """Turn on the per-layer page copies, L2's arena and the records' export where they serve
    (fail-open: any error leaves the stock state paths, logged)."""
    if layout is None:
        return PagePaths("no pages", "no pages", "no pages")
    try:
        copies = enable_page_copies(
            ctx,
            seam,
            layout,
            verdict,
            on_device=on_device,
            page_tokens=cache.page_tokens,
            pinner=pinner,
        )
    except Exception as exc:  # fail-open: pages are assembled
        copies = f"{type(exc).__name__}: {exc}"
        seam.page_copies = False
    if seam.page_copies:
        # the read-ahead threads' buffers committed before the first restore needs them (after
        # the staging arenas, which set a chunk's size on device builds)
        seam.warm_reads(cache.pages, layout, cache.page_tokens)
        cache.costs.commit_streams()
    arena: str | None = "no pages"
    if cache.ram is not None:
        try:
            arena = attach_arena(ctx, seam, cache, layout, verdict, pinner=pinner)
        except Exception as exc:  # fail-open: L2 keeps page bytes
            arena = f"{type(exc).__name__}: {exc}"
            log.warning("skippy-llama: no L2 arena (%s)", arena)
    try:
        export = open_exporter(
            ctx, seam, cache, layout, verdict, n_ctx, pinner=pinner, on_device=on_device
        )
    except Exception as exc:  # fail-open: records are captured
        export = f"{type(exc).__name__}: {exc}"
        seam.exporter = None
        log.warning("skippy-llama: records are captured, not exported (%s)", export)
    return PagePaths(copies, arena, export)
