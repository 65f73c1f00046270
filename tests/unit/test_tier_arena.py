"""L2's host arena: pages kept in the KV tensors' layout, runs of cells, and RamTier on top of it.

Independent of llama.cpp: the pages come from synthetic state blobs (``statefixtures``); what a
restore copies out of the arena is checked against the state format's own bytes, so the arena's
layout is exactly the one ``skippy_kv_cells_set`` (patch 0006) reads.
"""

from __future__ import annotations

import numpy as np
import pytest
from statefixtures import Spec, build_state, make_content

from skippy_llama.errors import StateFormatError
from skippy_llama.state import cut_pages, parse_state
from skippy_llama.state.pages import Page
from skippy_llama.tiers.arena import ArenaRun, HostArena, slot_count
from skippy_llama.tiers.ram import RamTier

SPECS = [Spec(n_layer=3, v_trans=False), Spec(n_layer=3, v_trans=True, n_embd_v=(16, 32, 16))]
IDS = ["v_rows", "v_transposed"]
PAGE = 8


def pages_of(spec: Spec, n: int, seed: int = 0) -> list[Page]:
    state = parse_state(build_state(make_content(spec, n, seed=seed)).data)
    return cut_pages(state, PAGE)


class Digests:
    """The L3 side of the mirror: every page has digest 1 unless told otherwise."""

    serving = True

    def __init__(self) -> None:
        self.gone: set[bytes] = set()

    def digest(self, key: bytes) -> bytes | None:
        return None if key in self.gone else b"\x01"


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_put_keeps_the_device_layout(spec: Spec) -> None:
    pages = pages_of(spec, 20)  # two whole pages and a 4-token tail
    arena = HostArena(pages[0].layout, PAGE, 4)
    slots = [arena.put(page) for page in pages]
    assert [s.index for s in slots if s] == [0, 1, 2]
    for slot, page in zip(slots, pages, strict=True):
        assert slot is not None
        assert arena.page(slot).to_bytes() == page.to_bytes()
        c0 = slot.index * PAGE
        for il, layer in enumerate(page.layout.layers):
            # K: cell after cell; V: cell after cell, or one row per element with the cells along it
            np.testing.assert_array_equal(arena.k[il][c0 : c0 + page.n_tokens], page.k[il])
            if page.layout.v_trans:
                u = layer.v_unit
                assert arena.v[il].shape == (layer.v_embd, arena.capacity * u)
                block = arena.v[il][:, c0 * u : (c0 + page.n_tokens) * u]
                np.testing.assert_array_equal(block, page.v[il])
            else:
                np.testing.assert_array_equal(arena.v[il][c0 : c0 + page.n_tokens], page.v[il])
    # the addresses a native copy gets are those of the arrays
    run = ArenaRun(PAGE + 3, 2)
    k, v = arena.addresses(run)
    for il, layer in enumerate(pages[0].layout.layers):
        assert int(k[il]) == arena.k[il][PAGE + 3 :].ctypes.data
        assert int(v[il]) == arena.v[il].ctypes.data + (PAGE + 3) * layer.v_unit
    arena.close()


def test_runs_merge_consecutive_slots_and_check_positions() -> None:
    pages = pages_of(SPECS[1], 32)
    arena = HostArena(pages[0].layout, PAGE, 6)
    # page 0 in slot 5, then 0, 1, 2: two runs
    slots = [arena.put(pages[0], 4), *(arena.put(p) for p in pages[1:])]
    assert [s.index for s in slots if s] == [5, 0, 1, 2]
    parts = [(s, s.start, s.end) for s in slots if s]
    assert arena.runs(parts) == [ArenaRun(5 * PAGE, PAGE), ArenaRun(0, 3 * PAGE)]
    # an append after 11 resident tokens, ending 3 tokens into the last page
    a, b = slots[1], slots[3]
    assert a is not None and b is not None
    cut = [(a, 11, a.end), (slots[2], 16, 24), (b, 24, 27)]
    assert arena.runs(cut) == [ArenaRun(3, 16)]  # type: ignore[arg-type]
    with pytest.raises(StateFormatError, match="skip"):
        arena.runs([(a, 8, 16), (b, 24, 32)])
    with pytest.raises(StateFormatError, match="not in the page"):
        arena.runs([(a, 8, 17)])


def test_arena_refuses_other_layouts_and_full() -> None:
    pages = pages_of(SPECS[0], 16)
    arena = HostArena(pages[0].layout, PAGE, 1)
    other = pages_of(SPECS[1], 8)[0]
    assert arena.put(other) is None  # another layout
    assert arena.put(pages_of(SPECS[0], 16)[0].head(8)) is not None
    assert arena.put(pages[1]) is None  # full
    assert arena.free_slots == 0
    assert slot_count(arena.slot_bytes * 3 + 1, pages[0].layout, PAGE) == 3


def test_ram_tier_keeps_pages_in_the_arena_within_budget() -> None:
    pages = pages_of(SPECS[1], 40)
    arena = HostArena(pages[0].layout, PAGE, 3)
    source = Digests()
    ram = RamTier(3 * arena.slot_bytes, source=source)
    ram.attach_arena(arena)
    for i, page in enumerate(pages[:3]):
        assert ram.fill(key(i), page.to_bytes(), b"\x01", prefix_tokens=1 << 20)
    assert ram.in_arena([key(0), key(1), key(2)])
    assert ram.status().used_bytes == 3 * arena.slot_bytes
    # every other reader still gets page bytes
    assert ram.get(key(1), b"\x01") == pages[1].to_bytes()
    # a fourth page evicts the least recently used one (page 0) and reuses its slot
    assert ram.fill(key(3), pages[3].to_bytes(), b"\x01", prefix_tokens=1 << 20)
    assert key(0) not in ram and arena.free_slots == 0
    with ram.arena_read([key(1), key(2), key(3)]) as (got, slots):
        assert got is arena
        assert [arena.page(s).to_bytes() for s in slots] == [p.to_bytes() for p in pages[1:4]]
    # L3 dropped page 2: the read stops there, as a fetch would
    source.gone.add(key(2))
    with ram.arena_read([key(1), key(2), key(3)]) as (_, slots):
        assert len(slots) == 1
    status = ram.status()
    assert (
        status.arena_hits == 4 and status.invalidations == 1 and status.arena_bytes == arena.nbytes
    )
    ram.close()


def test_ram_tier_keeps_bytes_for_pages_the_arena_cannot_hold() -> None:
    pages = pages_of(SPECS[0], 8)
    arena = HostArena(pages[0].layout, PAGE, 2)
    ram = RamTier(10 * arena.slot_bytes, source=Digests())
    ram.attach_arena(arena)
    other = pages_of(SPECS[1], 8)[0].to_bytes()
    assert ram.fill(key(9), other, b"\x01", prefix_tokens=1 << 20)
    assert not ram.in_arena([key(9)])
    assert ram.get(key(9), b"\x01") == other
    assert ram.fill(key(1), b"not a page", b"\x01", prefix_tokens=1 << 20)
    assert ram.get(key(1), b"\x01") == b"not a page"
    ram.clear()
    assert ram.status().used_bytes == 0 and arena.free_slots == 2


def test_prefault_commits_the_arena_and_leaves_puts_intact() -> None:
    from skippy_llama.runtime.arena_setup import prefault

    pages = pages_of(SPECS[1], 20)
    per_slot = PAGE * pages[0].layout.kv_bytes_per_cell
    arena = HostArena(pages[0].layout, PAGE, (48 << 20) // per_slot)  # ~48 MiB, 12 steps
    try:
        slots = [arena.put(page) for page in pages[:2]]
        thread = prefault(arena)
        if thread is None:
            pytest.skip("no madvise here")
        slots += [arena.put(page) for page in pages[2:]]  # puts while it runs
        thread.join(60)
        if not arena.prefaulted:
            pytest.skip("the kernel has no MADV_POPULATE_WRITE")
        for slot, page in zip(slots, pages, strict=True):
            assert slot is not None and arena.page(slot).to_bytes() == page.to_bytes()
        assert _resident(arena.address) >= arena.nbytes
    finally:
        arena.close()
    assert arena.closing


def test_prefault_waits_while_a_restore_runs_and_stops_when_the_arena_closes() -> None:
    import threading

    from skippy_llama.runtime import arena_setup

    layout = pages_of(SPECS[1], 8)[0].layout
    per_slot = PAGE * layout.kv_bytes_per_cell
    arena = HostArena(layout, PAGE, (8 << 20) // per_slot)
    idle = threading.Event()  # a restore runs (KVSeam.execute clears the seam's)
    try:
        thread = arena_setup.prefault(arena, idle=idle)
        if thread is None:
            pytest.skip("no madvise here")
        # however long it is given, nothing is committed while the restore runs
        thread.join(0.3)
        assert thread.is_alive() and not arena.prefaulted
        idle.set()  # the restore ended
        thread.join(60)
        if not arena.prefaulted:
            pytest.skip("the kernel has no MADV_POPULATE_WRITE")
    finally:
        arena.close()
    other = HostArena(layout, PAGE, 4)
    waiting = arena_setup.prefault(other, idle=threading.Event())
    assert waiting is not None
    other.close()  # closed while it waits: it ends without committing anything
    waiting.join(60)
    assert not waiting.is_alive() and not other.prefaulted


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_spans_hold_what_puts_into_the_first_slots_write(spec: Spec) -> None:
    pages = pages_of(spec, 4 * PAGE)
    arena = HostArena(pages[0].layout, PAGE, 10)
    try:
        spans = arena.spans(4)
        assert sum(n for _, n in spans) == 4 * arena.slot_bytes
        assert arena.spans(10) == arena.spans(99) == [(arena.address, arena.nbytes)]
        assert arena.spans(0) == []

        def inside(address: int, nbytes: int) -> bool:
            return any(a <= address and address + nbytes <= a + n for a, n in spans)

        for page in pages:
            slot = arena.put(page)
            assert slot is not None and slot.index < 4
            held = arena.page(slot)
            for a in (*held.k, *([] if spec.v_trans else held.v)):
                assert inside(a.ctypes.data, a.nbytes)  # rows of cells: one block
            for a in held.v if spec.v_trans else ():
                # transposed V: v_embd rows, a capacity of cells apart
                width = a.shape[1] * a.itemsize
                assert all(inside(a.ctypes.data + r * a.strides[0], width) for r in range(len(a)))
    finally:
        arena.close()


def test_prefault_commits_a_contexts_worth_of_slots_not_the_budget() -> None:
    from skippy_llama.runtime.arena_setup import _page_ranges, prefault, prefault_slots

    layout = pages_of(SPECS[1], 8)[0].layout
    per_slot = PAGE * layout.kv_bytes_per_cell
    arena = HostArena(layout, PAGE, (64 << 20) // per_slot)  # a 64 MiB L2 budget
    try:
        # a context's worth of pages, rounded up to whole slots; never more than the arena
        assert prefault_slots(arena, 100 * PAGE) == 100
        assert prefault_slots(arena, 100 * PAGE + 1) == 101
        assert prefault_slots(arena, 1 << 40) == arena.n_slots
        want = prefault_slots(arena, arena.n_slots // 16 * PAGE)
        committed = sum(n for _, n in _page_ranges(arena.spans(want)))
        assert committed < arena.nbytes // 8
        before = _resident(arena.address)
        thread = prefault(arena, want)
        if thread is None:
            pytest.skip("no madvise here")
        thread.join(60)
        if not arena.prefaulted:
            pytest.skip("the kernel has no MADV_POPULATE_WRITE")
        grew = _resident(arena.address) - before
        # the first slots' memory (what a first promotion writes), not the whole budget (the
        # mapping may share its kernel area with a little of the process's other memory)
        assert want * arena.slot_bytes <= grew <= committed + (1 << 20)
    finally:
        arena.close()


def _resident(address: int) -> int:
    """Resident bytes of the mapping that holds ``address`` (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                rss = int(line.split()[1]) * 1024
    return rss


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_page_spans_point_at_the_pages_own_cells(spec: Spec) -> None:
    """``cells_span`` over a page's bytes as L3 serves them (located by ``PageReader``, no
    views) gives the addresses of the cells ``page_from_bytes``'s views hold."""
    import ctypes

    from skippy_llama.runtime.seam import cells_span
    from skippy_llama.state import page_from_bytes
    from skippy_llama.state.pages import page_reader

    whole = pages_of(spec, 20)[1].to_bytes()  # positions [8, 16), as L3 serves it
    page = page_from_bytes(whole)
    cells = page_reader(page.layout).cells(whole)
    address = np.frombuffer(whole, dtype=np.uint8).ctypes.data
    assert (cells.start, cells.n_tokens) == (page.start, page.n_tokens)
    for first, end in [(8, 16), (8, 13), (11, 16)]:
        span = cells_span(address, cells, first, end)
        n, off = end - first, first - page.start
        assert span.n_cells == n
        for il, layer in enumerate(page.layout.layers):
            k = ctypes.string_at(int(span.k[il]), n * layer.k_row)
            assert k == page.k[il][off : end - page.start].tobytes()
            if page.layout.v_trans:
                # rows of the whole page's length: the copy strides over the page's other cells
                assert span.v_row_cells == page.n_tokens
                u = layer.v_unit
                for row in range(layer.v_embd):
                    got = ctypes.string_at(int(span.v[il]) + row * page.n_tokens * u, n * u)
                    assert got == page.v[il][row, off * u : (off + n) * u].tobytes()
            else:
                v = ctypes.string_at(int(span.v[il]), n * layer.v_unit)
                assert v == page.v[il][off : end - page.start].tobytes()
    with pytest.raises(StateFormatError):
        cells_span(address, cells, 7, 12)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_a_page_reader_refuses_what_page_from_bytes_refuses_and_other_layouts(spec: Spec) -> None:
    from skippy_llama.state import page_from_bytes
    from skippy_llama.state.pages import PageReader

    whole = pages_of(spec, 20)[1].to_bytes()
    reader = PageReader(page_from_bytes(whole).layout)
    bad = [
        whole[:20],  # truncated header
        b"XXXX" + whole[4:],  # magic
        whole[:-1],  # a size that does not add up
        whole + b"\0",
    ]
    for data in bad:
        with pytest.raises(StateFormatError):
            page_from_bytes(data)
        with pytest.raises(StateFormatError):
            reader.cells(data)
    other = Spec(n_layer=3, v_trans=spec.v_trans, n_embd_v=(16, 16, 16))
    foreign = pages_of(other, 20)[1].to_bytes()
    assert page_from_bytes(foreign).layout != reader.layout  # a page, of another layout
    with pytest.raises(StateFormatError, match="layout differs"):
        reader.cells(foreign)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_write_puts_a_page_in_a_given_slot_whatever_it_held(spec: Spec) -> None:
    """A restore's staging arena (``runtime/seam.py``) writes each chunk's pages into slots
    0, 1 ... again and again, outside the free list: consecutive slots, so a chunk is one run."""
    pages = pages_of(spec, 20)
    arena = HostArena(pages[0].layout, PAGE, 2)
    first = [arena.write(i, page) for i, page in enumerate(pages[:2])]
    assert [arena.page(s).to_bytes() for s in first] == [p.to_bytes() for p in pages[:2]]
    again = arena.write(0, pages[2])  # the 4-token tail over page 0
    assert (again.index, again.start, again.n_tokens) == (0, 16, 4)
    assert arena.page(again).to_bytes() == pages[2].to_bytes()
    assert arena.free_slots == 2  # the free list is the caller's
    parts = [(s, s.start, s.end) for s in first]
    assert arena.runs(parts) == [ArenaRun(0, 2 * PAGE)]
    with pytest.raises(ValueError):
        arena.write(2, pages[0])
    arena.close()


def test_staging_arenas_hold_a_chunk_each_and_close_unpinned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``arena_setup.open_staging``: two arenas of ``STAGING_BYTES`` (at least a page), pinned
    by the pinner where it can, unpinned when closed."""
    from skippy_llama.runtime import arena_setup

    layout = pages_of(SPECS[1], 8)[0].layout

    class Pins:
        def __init__(self) -> None:
            self.pinned: list[int] = []

        def pin(self, buf: object) -> bool:
            self.pinned.append(id(buf))
            return True

        def unpin(self, buf: object) -> None:
            self.pinned.remove(id(buf))

        def stats(self) -> dict[str, int | bool]:
            return {}

    pins = Pins()
    a, b = arena_setup.open_staging(layout, PAGE, pins)
    per = PAGE * layout.kv_bytes_per_cell
    assert a.n_slots == b.n_slots == max(1, arena_setup.STAGING_BYTES // per)
    assert len(pins.pinned) == 2 and a.prefault_thread is None
    a.close()
    b.close()
    assert pins.pinned == []
    monkeypatch.setattr(arena_setup, "STAGING_BYTES", 1)  # a page larger than a chunk
    c, d = arena_setup.open_staging(layout, PAGE, None)
    assert c.n_slots == 1
    for arena in (c, d):
        if arena.prefault_thread is not None:
            arena.prefault_thread.join()
        arena.close()


def test_a_promoted_read_finds_pages_read_from_l3_in_l2s_arena_without_counting_hits() -> None:
    """A direct restore that promoted the pages it read from L3 copies them from L2's arena
    (``TierPages.promoted_read``): by key, whatever tier the plan names, checked against
    L3's digest, and not counted as L2 hits (the plan read them from L3)."""
    from skippy_llama.page_source import TierPages
    from skippy_llama.plan import PageRef

    pages = pages_of(SPECS[1], 24)
    arena = HostArena(pages[0].layout, PAGE, 3)
    source = Digests()
    ram = RamTier(3 * arena.slot_bytes, source=source)
    ram.attach_arena(arena)
    tiers = TierPages([ram])
    refs = [PageRef("l3", key(i), PAGE) for i in range(3)]
    assert not tiers.promoted_in_arena(refs[:1])
    for i, page in enumerate(pages[:2]):
        assert ram.fill(key(i), page.to_bytes(), b"\x01", prefix_tokens=1 << 20)
    assert tiers.promoted_in_arena(refs[:2]) and not tiers.promoted_in_arena(refs)
    assert not tiers.in_arena(refs[:2])  # the plan's tier (l3) has no arena
    with tiers.promoted_read(refs) as held:
        assert held is not None
        got, slots = held
        assert got is arena and len(slots) == 2
        assert [arena.page(s).to_bytes() for s in slots] == [p.to_bytes() for p in pages[:2]]
    source.gone.add(key(0))
    with tiers.promoted_read(refs) as held:
        assert held is not None and held[1] == []
    status = ram.status()
    assert status.arena_hits == 0 and status.hits == 0 and status.misses == 0
    ram.close()
    assert not TierPages([]).promoted_in_arena(refs)
    with TierPages([]).promoted_read(refs) as none:
        assert none is None


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_reserved_slots_hold_what_is_written_into_them_as_pages(spec: Spec) -> None:
    # the runtime's export writes a record's cells straight into reserved slots (patch 0006's
    # skippy_kv_cells_get); here the same bytes are written through the arena's views
    pages = pages_of(spec, 20)
    arena = HostArena(pages[0].layout, PAGE, 3)
    slots = [arena.reserve(page.start, page.n_tokens) for page in pages]
    assert all(slots) and [s.index for s in slots if s] == [0, 1, 2]
    assert arena.reserve(20, 1) is None  # full
    for slot, page in zip(slots, pages, strict=True):
        assert slot is not None and slot.nbytes == page.nbytes
        view = arena.page(slot)
        for il in range(page.layout.n_layer):
            view.k[il][...] = page.k[il]
            view.v[il][...] = page.v[il]
        assert arena.page(slot).to_bytes() == page.to_bytes()
    runs = arena.runs((s, s.start, s.end) for s in slots if s is not None)
    assert runs == [ArenaRun(0, 20)]
    assert slots[0] is not None
    arena.free(slots[0])
    assert arena.reserve(0, PAGE + 1) is None  # longer than a slot
    again = arena.reserve(0, PAGE, after=-1)  # the export reuses the lowest, warm slots
    assert again is not None and again.index == 0


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_write_cells_puts_a_serialized_page_in_a_slot_as_write_does(spec: Spec) -> None:
    """A restore's staging arena takes each page from its bytes as L3 serves them, located by
    ``PageReader`` (``runtime/seam.py``): the slot then holds what :meth:`HostArena.write` of
    the parsed page puts there, a tail page included, whatever the slot held."""
    from skippy_llama.state import page_from_bytes
    from skippy_llama.state.pages import page_reader

    pages = pages_of(spec, 20)
    arena = HostArena(pages[0].layout, PAGE, 2)
    reader = page_reader(arena.layout)
    for index, page in [(0, pages[0]), (1, pages[1]), (0, pages[2])]:
        whole = page.to_bytes()
        cells = reader.cells(whole)
        assert arena.fits_cells(cells)
        slot = arena.write_cells(index, memoryview(whole), cells)
        want = HostArena(arena.layout, PAGE, 2)
        expect = want.write(index, page_from_bytes(whole))
        assert (slot.index, slot.start, slot.n_tokens, slot.ext, slot.nbytes) == (
            expect.index,
            expect.start,
            expect.n_tokens,
            expect.ext,
            expect.nbytes,
        )
        assert arena.page(slot).to_bytes() == whole
        want.close()
    assert arena.free_slots == 2  # the free list is the caller's
    with pytest.raises(ValueError):
        arena.write_cells(2, pages[0].to_bytes(), reader.cells(pages[0].to_bytes()))
    arena.close()
