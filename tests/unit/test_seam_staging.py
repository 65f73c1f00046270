"""L3 pages restored through the seam's staging arenas (issue 45 item 3), without a model.

``KVSeam._direct`` with staging arenas (a device build's path) is driven here with real pages
(synthetic states, ``statefixtures``), a real ``TierPages`` over a dict tier and L2's real
``RamTier`` and ``HostArena``; only the native copy is replaced, by one that reads the host
memory each span points at, cell by cell, as ``skippy_kv_cells_set`` does. So the test sees
exactly which bytes would reach the KV tensors at which positions, and from which memory.
The real copy's exactness is ``tests/integration/test_l3_page_copies.py``'s (SmolLM2).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from statefixtures import Spec, build_state, make_content

from skippy_llama.hostmem import BufferPool
from skippy_llama.page_source import TierPages
from skippy_llama.plan import PageRef, RestorePlan
from skippy_llama.runtime import arena_setup, native_ext
from skippy_llama.runtime.seam import KVSeam
from skippy_llama.state import KVLayout, cut_pages, parse_state
from skippy_llama.state.pages import Page
from skippy_llama.tiers.arena import HostArena
from skippy_llama.tiers.ram import RamTier
from skippy_llama.tiers.records import PrefixRecord

PAGE = 8
SPECS = [Spec(n_layer=3, v_trans=False), Spec(n_layer=3, v_trans=True, n_embd_v=(16, 32, 16))]
IDS = ["v_rows", "v_transposed"]


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@dataclass
class Status:
    name: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name}


@dataclass
class DictL3:
    """L3 over a dict of page bytes; every page has digest 1 (L2 mirrors it, promoting pages
    under the digest of their read)."""

    held: dict[bytes, bytes] = field(default_factory=dict)
    name: str = "l3"
    takes_records: bool = True
    serving: bool = True
    in_memory: bool = False

    def holds(self, key: bytes, *, queued: bool = False) -> bool:
        return key in self.held

    def children(self, parent: bytes, *, queued: bool = False) -> list[tuple[bytes, bytes]]:
        return []

    def fetch(self, keys: Sequence[bytes]) -> list[bytes | memoryview]:
        out: list[bytes | memoryview] = []
        for k in keys:
            if k not in self.held:
                break
            out.append(self.held[k])
        return out

    def fetch_digested(
        self, keys: Sequence[bytes], *, queued: bool = False
    ) -> list[tuple[bytes | memoryview, bytes | None]]:
        """What :meth:`fetch` gives, each page with its read's digest (L2 promotes by it)."""
        return [(payload, b"\x01") for payload in self.fetch(keys)]

    def digest(self, key: bytes) -> bytes | None:
        return b"\x01" if key in self.held else None

    def offer(self, record: PrefixRecord) -> bool:
        record.drop()
        return False

    def promote(self, key: bytes, payload: bytes | memoryview, prefix_tokens: int) -> None:
        pass

    def note_miss(self) -> None:
        pass

    def status(self) -> Status:
        return Status(self.name)

    def clear(self) -> None:
        self.held.clear()

    def close(self) -> None:
        pass


class FakeKV:
    """The working sequence's K/V by position, written as ``skippy_kv_cells_set`` would."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.cells: dict[int, tuple[bytes, ...]] = {}
        self.spans: list[native_ext.HostSpan] = []

    def cells_set(self, ctx: Any, seq_id: int, p0: int, spans: list[native_ext.HostSpan]) -> bool:
        if p0 != len(self.cells):
            return False  # p0 must continue the sequence
        pos = p0
        for span in spans:
            self.spans.append(span)
            for c in range(span.n_cells):
                self.cells[pos + c] = self.cell(span, c)
            pos += span.n_cells
        return True

    def cell(self, span: native_ext.HostSpan, c: int) -> tuple[bytes, ...]:
        out: list[bytes] = []
        for il, layer in enumerate(self.layout.layers):
            out.append(ctypes.string_at(int(span.k[il]) + c * layer.k_row, layer.k_row))
            if self.layout.v_trans:
                u, row = layer.v_unit, span.v_row_cells * layer.v_unit
                base = int(span.v[il]) + c * u
                out.append(
                    b"".join(ctypes.string_at(base + e * row, u) for e in range(layer.v_embd))
                )
            else:
                out.append(ctypes.string_at(int(span.v[il]) + c * layer.v_unit, layer.v_unit))
        return tuple(out)


def expected(pages: list[Page]) -> dict[int, tuple[bytes, ...]]:
    """Each position's K rows and V (row, or transposed column) per layer, from the pages."""
    out: dict[int, tuple[bytes, ...]] = {}
    for page in pages:
        for c in range(page.n_tokens):
            cell: list[bytes] = []
            for il, layer in enumerate(page.layout.layers):
                cell.append(page.k[il][c].tobytes())
                if page.layout.v_trans:
                    u = layer.v_unit
                    cell.append(np.ascontiguousarray(page.v[il][:, c * u : (c + 1) * u]).tobytes())
                else:
                    cell.append(page.v[il][c].tobytes())
            out[page.start + c] = tuple(cell)
    return out


def within(address: int, arena: HostArena) -> bool:
    return arena.address <= address < arena.address + arena.nbytes


def setup(
    monkeypatch: pytest.MonkeyPatch, spec: Spec, n: int, *, staging_pages: int
) -> tuple[KVSeam, FakeKV, list[Page], DictL3]:
    state = parse_state(build_state(make_content(spec, n, seed=3)).data)
    pages = cut_pages(state, PAGE)
    layout = pages[0].layout
    kv = FakeKV(layout)
    monkeypatch.setattr(native_ext, "cells_set", kv.cells_set)
    monkeypatch.setattr(
        arena_setup, "STAGING_BYTES", staging_pages * PAGE * layout.kv_bytes_per_cell
    )
    seam = KVSeam(None, BufferPool(), on_device=True)
    seam.page_copies = True
    seam.staging = arena_setup.open_staging(layout, PAGE, None)
    monkeypatch.setattr(seam, "cut", lambda start=0: kv.cells.clear())
    l3 = DictL3({key(i): page.to_bytes() for i, page in enumerate(pages)})
    return seam, kv, pages, l3


def plan_of(pages: list[Page], n_tokens: int) -> RestorePlan:
    refs = tuple(PageRef("l3", key(i), p.n_tokens) for i, p in enumerate(pages))
    return RestorePlan("l3", n_tokens, 0, pages=refs)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_l3_pages_go_through_the_staging_arenas_a_run_per_chunk(
    monkeypatch: pytest.MonkeyPatch, spec: Spec
) -> None:
    seam, kv, pages, l3 = setup(monkeypatch, spec, 7 * PAGE + 3, staging_pages=2)
    try:
        layout = pages[0].layout
        outcome = seam.execute(plan_of(pages, 7 * PAGE + 3), TierPages([l3]), layout)
        assert outcome.restored and not outcome.failed and outcome.fallbacks == []
        assert kv.cells == expected(pages)
        # four chunks of two pages (the last a page and the 3-token tail), each one run of
        # two consecutive staging slots, alternating between the two arenas
        assert [s.n_cells for s in kv.spans] == [16, 16, 16, 11]
        assert seam.staging is not None
        a, b = seam.staging
        homes = [a if within(int(s.k[0]), a) else b for s in kv.spans]
        assert all(within(int(s.k[0]), arena) for s, arena in zip(kv.spans, homes, strict=True))
        assert homes == [b, a, b, a]
    finally:
        seam.close()


def test_the_seam_is_busy_while_it_restores_and_idle_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``KVSeam.idle`` is clear while a plan executes (the arenas' prefault waits on it) and
    set again after, the restore failed or not."""
    seam, kv, pages, l3 = setup(monkeypatch, SPECS[1], 3 * PAGE, staging_pages=2)
    seen: list[bool] = []

    def watched(*args: Any) -> bool:
        seen.append(seam.idle.is_set())
        return kv.cells_set(*args)

    monkeypatch.setattr(native_ext, "cells_set", watched)
    try:
        assert seam.idle.is_set()
        outcome = seam.execute(plan_of(pages, 3 * PAGE), TierPages([l3]), pages[0].layout)
        assert outcome.restored and seen and not any(seen)
        assert seam.idle.is_set()
        l3.held.clear()  # nothing to read: a failed outcome, and idle again
        assert seam.execute(plan_of(pages, 3 * PAGE), TierPages([l3]), pages[0].layout).failed
        assert seam.idle.is_set()
    finally:
        seam.close()


def test_a_restore_ends_where_a_short_read_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    seam, kv, pages, l3 = setup(monkeypatch, SPECS[1], 6 * PAGE, staging_pages=2)
    try:
        del l3.held[key(3)]  # page 3 fails its read: pages 0-2 are restored, not 4 and 5
        outcome = seam.execute(plan_of(pages, 6 * PAGE), TierPages([l3]), pages[0].layout)
        assert outcome.restored and outcome.plan.n_tokens == 3 * PAGE
        assert any("served" in note for note in outcome.fallbacks), outcome.fallbacks
        assert kv.cells == expected(pages[:3])
    finally:
        seam.close()


def test_pages_promoted_while_read_are_copied_from_l2s_arena(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read that promotes its pages into L2's arena leaves them there, not in the staging
    arenas: they are copied from L2's slots (one copy of the page bytes, not two)."""
    seam, kv, pages, l3 = setup(monkeypatch, SPECS[1], 4 * PAGE, staging_pages=2)
    layout = pages[0].layout
    arena = HostArena(layout, PAGE, 8)
    ram = RamTier(8 * arena.slot_bytes, source=l3, large_prefix_tokens=1)  # promote at once
    ram.attach_arena(arena)
    try:
        outcome = seam.execute(plan_of(pages, 4 * PAGE), TierPages([ram, l3]), layout)
        assert outcome.restored and outcome.fallbacks == []
        assert kv.cells == expected(pages)
        assert kv.spans and all(within(int(s.k[0]), arena) for s in kv.spans)
        status = ram.status()
        assert status.promotions == 4 and status.arena_hits == 0  # read from L3, not L2 hits
    finally:
        seam.close()
        ram.close()


def test_warm_reads_ready_both_read_threads_for_a_staged_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``KVSeam.warm_reads`` (at load) has each of the two read-ahead threads, which read side
    by side, prepare its reads of one chunk: with staging arenas a chunk is their slots'
    worth of whole pages. A restore afterwards is the same."""
    import threading

    from skippy_llama.state.pages import page_nbytes

    seam, kv, pages, l3 = setup(monkeypatch, SPECS[1], 4 * PAGE, staging_pages=2)
    seen: list[tuple[str, int]] = []

    @dataclass
    class PreparedL3(DictL3):
        def prepare_reads(self, nbytes: int) -> None:
            seen.append((threading.current_thread().name, nbytes))

    tier = PreparedL3(l3.held)
    layout = pages[0].layout
    try:
        seam.warm_reads(TierPages([tier]), layout, PAGE)
        for pool in seam._read_pools():
            pool.submit(lambda: None).result()  # behind the preparation on its thread
        assert sorted(seen) == [
            ("skippy-direct-a_0", 2 * page_nbytes(layout, PAGE)),
            ("skippy-direct-b_0", 2 * page_nbytes(layout, PAGE)),
        ]
        outcome = seam.execute(plan_of(pages, 4 * PAGE), TierPages([tier]), layout)
        assert outcome.restored and outcome.fallbacks == []
        assert kv.cells == expected(pages)
    finally:
        seam.close()
