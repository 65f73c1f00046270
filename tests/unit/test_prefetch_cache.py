"""Prefetch (L3 -> L2 ahead of a request) over a real L3 directory with synthetic states.

The cache layer alone, no model: prompts are recorded into L3 from a synthetic sequence state,
prefetched into a real L2 (``RamTier`` mirroring the ``DiskTier``), and then looked up as the
runtime would (plan, fetch, commit). Also L2's admission rule for predictions and the server's
record of recent conversations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from fake_tiers import holding
from test_cache_tree import IDENTITY, lookup, prompt, record, served
from test_plan import PAGE as PLAN_PAGE
from test_plan import FakePages, FakeRemote
from test_tier_disk import raw_store

from skippy_llama.cache import PrefixCache
from skippy_llama.config import L3Settings
from skippy_llama.identity import page_keys
from skippy_llama.plan import Prompt
from skippy_llama.server.recent import RecentConversations
from skippy_llama.tiers.base import PrefetchFill, PrefetchTier
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.ram import PROMOTE_WINDOW_S, RamTier

PAGE = 128

Make = Callable[..., PrefixCache]


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Make]:
    """``make(l2_budget)``: a cache over one L3 directory (L2 on top when a budget is given)."""
    disks: list[DiskTier] = []

    def build(l2_budget: int | None = 1 << 30, *, disk: bool = True) -> PrefixCache:
        settings = L3Settings(
            mode="fixed", budget="1GiB", directory=tmp_path / "l3", minimum_free="1GiB"
        )
        tiers: list[DiskTier | RamTier] = []
        l3 = DiskTier(settings, disk_free=lambda _p: 1 << 40, close_at_exit=False)
        disks.append(l3)
        if l2_budget is not None:
            ram = RamTier(l2_budget, source=l3 if disk else None)
            l3.add_removal_listener(ram.invalidate)
            tiers.append(ram)
        if disk:
            tiers.append(l3)
        return PrefixCache(identity=IDENTITY, page_tokens=PAGE, tiers=tiers)

    yield build
    for d in disks:
        d.close()


def stored_sizes(cache: PrefixCache, tokens: np.ndarray) -> list[int]:
    """Payload sizes of the aligned pages of ``tokens`` that L3 holds."""
    assert cache.disk is not None
    keys = page_keys(cache.root, tokens[: len(tokens) - len(tokens) % PAGE], PAGE)
    return [len(page) for page in cache.disk.read(keys)]


def lookup_keys(cache: PrefixCache, tokens: np.ndarray) -> list[bytes]:
    """The keys of the pages a lookup of ``tokens`` (all but two) restores."""
    plan = cache.plan(Prompt(tokens=tokens, limit=len(tokens) - 2))
    return [page.key for page in plan.pages]


def test_a_prefetch_turns_the_next_l3_restore_into_an_l2_one(make: Make) -> None:
    cache = make()
    a = prompt(0, 600, seed=1)
    record(cache, a)  # 128 * 4 + 88: five pages in L3
    ram = cache.ram
    assert ram is not None and len(ram) == 0

    result = cache.prefetch(a)

    assert result.stopped == "complete"
    assert (result.pages, result.held) == (5, 0)
    assert result.tokens == result.stored_tokens == 599  # the last token is never reused
    assert result.bytes == ram.used_bytes > 0
    assert len(ram) == 5 and ram.status().prefetched == 5
    counters = cache.counters
    assert (counters.prefetches, counters.prefetched_pages) == (1, 5)
    assert counters.prefetched_bytes == result.bytes and counters.prefetch_misses == 0

    # the request: every page from L2, bytes equal to a cold state's (checked by served)
    assert served(cache, a, 598) == (598, (128, 128, 128, 128, 86))
    assert lookup(cache, a, 598).tier == "l2"
    assert ram.status().prefetch_hits == 5

    again = cache.prefetch(a)  # everything held: nothing read
    assert (again.pages, again.held, again.stopped) == (0, 5, "complete")
    assert again.tokens == 599


def test_prefetch_is_a_no_op_without_l2_or_l3(make: Make) -> None:
    cache = make()
    a = prompt(0, 300, seed=1)
    record(cache, a)
    no_l2 = make(None)
    assert no_l2.prefetch(a).stopped == "off"
    assert no_l2.counters.prefetched_pages == 0
    no_l3 = make(1 << 30, disk=False)
    assert no_l3.prefetch(a).stopped == "off"
    assert cache.prefetch(np.arange(1, dtype=np.int32)).stopped == "off"  # nothing reusable
    assert cache.prefetch(prompt(0, 300, seed=9)[::-1].copy()).stopped == "not_stored"


def test_a_prefetch_larger_than_l2_keeps_its_first_pages(make: Make) -> None:
    cache = make()
    a = prompt(0, 600, seed=1)
    record(cache, a)
    sizes = stored_sizes(cache, a)
    # room for two and a half pages: the third page would only fit by evicting the first
    small = make(sizes[0] + sizes[1] + sizes[2] // 2)
    result = small.prefetch(a)
    assert result.stopped == "full"
    assert (result.pages, result.tokens) == (2, 256)
    ram = small.ram
    assert ram is not None and ram.status().prefetch_refused == 1
    assert ram.status().evictions == 0
    found = lookup(small, a, 598)  # two pages from L2, the rest from L3
    assert found.tier == "l3" and found.n_tokens == 598


def test_a_later_prefetch_never_evicts_an_earlier_unused_one(make: Make) -> None:
    cache = make()
    a, b = prompt(0, 300, seed=1), prompt(0, 300, seed=2)
    record(cache, a)
    record(cache, b)
    size = max(stored_sizes(cache, a) + stored_sizes(cache, b))
    assert cache.disk is not None
    a_bytes = sum(len(p) for p in cache.disk.read(lookup_keys(cache, a)))
    small = make(a_bytes + size // 2)  # a's pages, and not one of b's besides
    assert small.prefetch(a).stopped == "complete"
    first = small.prefetch(b)
    assert first.stopped == "full" and first.pages == 0  # a is still the better bet
    lookup(small, a, 298)  # a's request came: its pages are plain LRU pages now
    second = small.prefetch(b)
    assert second.stopped == "complete" and second.pages == 3
    assert lookup(small, b, 298).tier == "l2"


def test_predictions_expire_after_the_promotion_window() -> None:
    now = [1000.0]
    ram = RamTier(2000, clock=lambda: now[0])
    assert ram.prefetch_fill(b"a" * 16, bytes(1000), b"d" * 16) == "added"
    assert ram.prefetch_fill(b"b" * 16, bytes(1000), b"d" * 16) == "added"
    assert ram.prefetch_fill(b"c" * 16, bytes(1000), b"d" * 16) == "full"
    now[0] += PROMOTE_WINDOW_S + 1
    assert ram.prefetch_fill(b"c" * 16, bytes(1000), b"d" * 16) == "added"
    assert b"a" * 16 not in ram and b"b" * 16 in ram  # the LRU one made room
    assert ram.prefetch_fill(b"c" * 16, bytes(1000), b"d" * 16) == "held"
    assert ram.prefetch_fill(b"x" * 16, bytes(3000), b"d" * 16) == "full"  # over the budget
    # a real fill is not held back by predictions: demand beats them
    assert ram.fill(b"y" * 16, bytes(1000), b"d" * 16, prefix_tokens=1 << 20)
    assert ram.status().prefetched == 3


def test_a_damaged_l3_page_is_a_counted_miss(make: Make) -> None:
    cache = make()
    a = prompt(0, 600, seed=1)
    record(cache, a)
    disk = cache.disk
    assert disk is not None
    third = page_keys(cache.root, a[:384], PAGE)[2]
    data = bytearray(raw_store(disk).get(b"\x07" + third) or b"")
    assert data
    data[len(data) // 2] ^= 0x01
    raw_store(disk).set(b"\x07" + third, bytes(data))

    result = cache.prefetch(a)  # never raises

    assert result.stopped == "miss"
    assert (result.pages, result.tokens) == (2, 256)
    assert cache.counters.prefetch_misses == 1
    assert disk.status().process_activity.corrupt_entries == 1
    found = lookup(cache, a, 598)  # the request serves what is left, from L2
    assert (found.tier, found.n_tokens) == ("l2", 256)


def test_stop_ends_a_prefetch_before_its_next_read(make: Make) -> None:
    cache = make()
    a = prompt(0, 600, seed=1)
    record(cache, a)
    result = cache.prefetch(a, stop=lambda: True)
    assert (result.stopped, result.pages) == ("stopped", 0)
    assert cache.ram is not None and len(cache.ram) == 0


def test_pages_inside_the_skipped_prefix_are_not_read(make: Make) -> None:
    cache = make()
    a = prompt(0, 600, seed=1)
    record(cache, a)  # five pages: 0-127, 128-255, 256-383, 384-511, 512-599
    # the live sequence will hold the first 300 tokens: pages 0 and 1 are wholly inside them,
    # page 2 (256-383) is not
    result = cache.prefetch(a, skip=300)
    assert (result.stopped, result.pages, result.held) == ("complete", 3, 0)
    assert result.tokens == 599
    ram = cache.ram
    assert ram is not None and len(ram) == 3
    keys = page_keys(cache.root, a[:512], PAGE)
    assert [ram.holds(key) for key in keys] == [False, False, True, True]


def test_prefetch_on_another_thread_beside_requests(make: Make) -> None:
    """A prefetch thread and a request thread read L3 at once: each has its own read buffer,
    and every restore still assembles the exact state."""
    cache = make()
    prompts = [prompt(100, 500, seed=s) for s in range(4)]
    for p in prompts:
        record(cache, p)
    errors: list[BaseException] = []

    def prefetch_all() -> None:
        try:
            for p in reversed(prompts):
                assert cache.prefetch(p).stopped == "complete"
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=prefetch_all)
    thread.start()
    for p in prompts:
        assert served(cache, p, 498)[0] == 498
    thread.join()
    assert not errors
    assert cache.counters.prefetches == 4


def test_recent_conversations_keep_one_entry_per_conversation() -> None:
    recent = RecentConversations(capacity=3)
    a1 = np.arange(10, dtype=np.int32)
    b = np.arange(100, 110, dtype=np.int32)
    recent.add(a1)
    recent.add(b)
    a2 = np.arange(20, dtype=np.int32)  # a's next turn
    recent.add(a2)
    assert [len(t) for t in recent.latest(5)] == [20, 10]
    recent.add(a1)  # a repeat of a's first turn: the longer conversation is kept, first
    assert [t[0] for t in recent.latest(5)] == [0, 100] and len(recent.latest(1)[0]) == 20
    for start in (200, 300, 400):
        recent.add(np.arange(start, start + 5, dtype=np.int32))
    assert [t[0] for t in recent.latest(5)] == [400, 300, 200]
    recent.add(np.zeros(0, dtype=np.int32))
    assert len(recent) == 3


# -- prefetch through the tier protocol: any page tier a source, any prefetch tier a target


@dataclass
class FakeMirror(FakePages):
    """A prefetch target holding whatever it is offered, up to ``room`` pages."""

    room: int = 100
    predicted: list[bytes] = field(default_factory=list)

    def predict(self, keys: Sequence[bytes]) -> int:
        held = [key for key in keys if key in self.pages]
        self.predicted += held
        return len(held)

    def take_prefetched(
        self,
        key: bytes,
        payload: bytes | memoryview,
        protect: frozenset[bytes],
        digest: bytes | None = None,
    ) -> PrefetchFill:
        if key in self.pages:
            return "held"
        if len(self.pages) >= self.room:
            return "full"
        self.pages[key] = bytes(payload)
        return "added"


def fake_cache(*tiers: FakePages) -> PrefixCache:
    return PrefixCache(identity=IDENTITY, page_tokens=PLAN_PAGE, tiers=tiers, bytes_per_token=1)


def test_a_remote_tier_is_a_prefetch_source_and_any_prefetch_tier_a_target() -> None:
    tokens = np.arange(300, dtype=np.int32)
    keys = page_keys(IDENTITY.root, tokens[:256], PLAN_PAGE)
    mirror = FakeMirror("mirror", holding(keys[:1]), takes_records=False)
    disk = FakePages("disk", holding(keys[:2]))
    remote = FakeRemote("remote", holding(keys))
    assert isinstance(mirror, PrefetchTier) and not isinstance(disk, PrefetchTier)
    cache = fake_cache(mirror, disk, remote)
    assert cache.can_prefetch

    result = cache.prefetch(tokens)

    # page 0 was held, page 1 came from the disk tier, pages 2 and 3 from the remote one
    assert (result.stopped, result.held, result.pages, result.tokens) == ("complete", 1, 3, 256)
    assert set(mirror.pages) == set(keys) and mirror.predicted == [keys[0]]
    assert remote.asked == 1
    plan = cache.plan(Prompt(tokens, 298))
    assert (plan.tier, plan.page_tiers) == ("mirror", ("mirror",))


def test_a_prefetch_needs_a_target_and_a_deeper_source() -> None:
    tokens = np.arange(300, dtype=np.int32)
    only_source = fake_cache(FakePages("disk"), FakeRemote("remote"))
    only_target = fake_cache(FakeMirror("mirror", takes_records=False))
    for cache in (only_source, only_target):
        assert not cache.can_prefetch and cache.prefetch(tokens).stopped == "off"
    full = FakeMirror("mirror", takes_records=False, room=1)
    remote = FakeRemote("remote", holding(page_keys(IDENTITY.root, tokens[:256], PLAN_PAGE)))
    result = fake_cache(full, remote).prefetch(tokens)
    assert (result.stopped, result.pages, result.tokens) == ("full", 1, 64)


def test_l2_takes_no_page_l3_lacks_from_a_prefetch(make: Make) -> None:
    """L2 mirrors L3: a page only the remote tier holds is ``foreign`` to it."""
    cache = make()
    a = prompt(0, 600, seed=1)
    record(cache, a)
    ram = cache.ram
    assert ram is not None
    key = page_keys(cache.root, a[:128], PAGE)[0]
    digest = cache.disk.digest(key) if cache.disk is not None else None
    assert digest is not None
    assert ram.take_prefetched(b"\x09" * 16, b"payload", digest=digest) == "foreign"
    # bytes read from a tier that keeps no L3 digest (the remote one), though L3 has the page
    assert ram.take_prefetched(key, b"payload") == "foreign" and not ram.holds(key)
    assert ram.take_prefetched(key, b"payload", digest=digest) == "added" and ram.holds(key)


def test_a_page_l3_rewrites_after_a_prefetch_read_it_is_never_served_from_l2(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L2 keeps a prefetched copy under the digest the read verified. Asked after the read, L3
    would give the digest of bytes written since, and L2 would serve the old bytes as those."""
    cache = make()
    a = prompt(0, 600, seed=1)
    record(cache, a)
    ram, disk = cache.ram, cache.disk
    assert ram is not None and disk is not None
    keys = page_keys(cache.root, a[:512], PAGE)
    real_fetch, real_digest = disk.fetch_digested, disk.digest
    now = {key: real_digest(key) for key in keys}

    def rewritten(key: bytes) -> bytes | None:
        return now[key] if key in now else real_digest(key)

    def read_then_rewrite(
        ks: Sequence[bytes], *, queued: bool = False
    ) -> list[tuple[bytes | memoryview, bytes | None]]:
        got = real_fetch(ks, queued=queued)
        now[keys[1]] = b"\xee" * 16  # another process records page 1 anew after this read
        return got

    monkeypatch.setattr(disk, "digest", rewritten)
    monkeypatch.setattr(disk, "fetch_digested", read_then_rewrite)
    result = cache.prefetch(a)
    assert (result.stopped, result.pages, result.tokens) == ("foreign", 1, PAGE)
    assert ram.holds(keys[0]) and not ram.holds(keys[1])

    # a page rewritten after L2 took it: the copy keeps its read's digest, and the lookup that
    # finds L3's new one drops it (a miss), never serves it
    now[keys[0]] = b"\xdd" * 16
    mismatches = ram.status().digest_mismatches
    assert ram.fetch(keys[:1]) == []
    assert not ram.holds(keys[0]) and ram.status().digest_mismatches == mismatches + 1
