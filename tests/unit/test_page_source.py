"""``TierPages``, the page source the KV seam reads a plan's pages from (no model)."""

from __future__ import annotations

from fake_tiers import DictPages

from skippy_llama.page_source import TierPages
from skippy_llama.plan import FetchedPage, PageRef, PageSource
from skippy_llama.tiers.base import PageTier
from skippy_llama.tiers.ram import RamTier


def ref(tier: str, key: bytes) -> PageRef:
    return PageRef(tier, key, 64)


def test_the_cache_pages_are_a_page_source() -> None:
    assert isinstance(DictPages("l3"), PageTier)
    source: PageSource = TierPages([DictPages("l3")])  # mypy checks the protocol
    assert source.fetch([]) == []


def test_a_fetch_reads_each_page_from_its_tier_and_stops_at_the_first_missing_one() -> None:
    l2 = DictPages("l2", {b"a": b"A"}, takes_records=False)
    l3 = DictPages("l3", {b"b": b"B", b"d": b"D"})
    pages = TierPages([l2, l3])
    got = pages.fetch([ref("l2", b"a"), ref("l3", b"b"), ref("l3", b"c"), ref("l3", b"d")])
    assert got == [FetchedPage("l2", b"a", b"A"), FetchedPage("l3", b"b", b"B")]
    # a tier the source does not have serves nothing
    assert pages.fetch([ref("remote", b"a")]) == []


def test_promotion_offers_a_page_to_the_shallower_tiers_only() -> None:
    l2 = DictPages("l2", takes_records=False)
    l3 = DictPages("l3")
    TierPages([l2, l3]).promote([FetchedPage("l3", b"b", b"B"), FetchedPage("l2", b"a", b"A")], 192)
    assert l2.promoted == [(b"b", 192)] and l3.promoted == []


def test_only_pages_outside_host_ram_read_storage() -> None:
    ram = RamTier(1 << 20)
    l3 = DictPages("l3")
    pages = TierPages([ram, l3])
    assert not pages.reads_storage([ref("l2", b"a")])
    assert pages.reads_storage([ref("l2", b"a"), ref("l3", b"b")])


def test_preparing_reads_reaches_the_tiers_that_can_on_the_calling_thread() -> None:
    import threading
    from dataclasses import dataclass

    seen: list[tuple[str, int]] = []

    @dataclass
    class PreparedPages(DictPages):
        def prepare_reads(self, nbytes: int) -> None:
            seen.append((threading.current_thread().name, nbytes))

    pages = TierPages([DictPages("l2"), PreparedPages("l3")])
    worker = threading.Thread(target=pages.prepare_reads, args=(1 << 20,), name="reader-x")
    worker.start()
    worker.join()
    assert seen == [("reader-x", 1 << 20)]  # the tier without it is skipped
