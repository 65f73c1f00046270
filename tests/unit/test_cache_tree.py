"""The orchestrator over a real L3 directory with synthetic states: the page tree.

Prompts that share a prefix share its pages; a prompt that branches off inside a stored page
reuses the tokens before the branch and records only its own; nothing is stored twice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from statefixtures import Spec, build_state, make_content

from skippy_llama.cache import PrefixCache
from skippy_llama.config import L3Settings
from skippy_llama.identity import CacheIdentity, ModelIdentity
from skippy_llama.plan import PageRef, Prompt, RestoreOutcome, RestorePlan
from skippy_llama.state import assemble, page_from_bytes, parse_state
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.records import PrefixRecord

SPEC = Spec(n_layer=2, n_embd_k=16, n_embd_v=16, v_trans=True)
CONTENT = make_content(SPEC, 700, seed=3)
STATE = parse_state(build_state(CONTENT, 700).data)
IDENTITY = CacheIdentity(
    model=ModelIdentity(digest="d" * 32, architecture="llama", geometry={"n_layer": 2}),
    layout_digest=STATE.layout.digest(),
    type_k=1,
    type_v=1,
    flash_attn=False,
    v_trans=True,
    rope_freq_base=10000.0,
    rope_freq_scale=1.0,
    yarn=(-1.0, 1.0, 32.0, 1.0, 0.0, -1.0),
    n_swa=0,
    kv_unified=False,
    backend="CPU",
)


def prompt(shared: int, n: int, seed: int) -> np.ndarray:
    """``n`` tokens whose first ``shared`` are 0..shared-1 and the rest differ per seed."""
    rest = np.random.default_rng(seed).integers(1000, 30000, size=n - shared)
    return np.concatenate([np.arange(shared), rest]).astype(np.int32)


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[PrefixCache]:
    settings = L3Settings(
        mode="fixed", budget="1GiB", directory=tmp_path / "l3", minimum_free="1GiB"
    )
    disk = DiskTier(settings, disk_free=lambda _p: 1 << 40, close_at_exit=False)
    yield PrefixCache(identity=IDENTITY, page_tokens=128, tiers=[disk])
    disk.close()


def record(cache: PrefixCache, tokens: np.ndarray) -> None:
    plan = cache.plan_record(tokens, len(tokens))
    assert plan is not None
    assert cache.record(plan, STATE, tokens)
    assert cache.disk is not None and cache.disk.flush(10)


@dataclass(frozen=True)
class Found:
    tier: str
    n_tokens: int
    payloads: tuple[bytes | memoryview, ...]
    uses: tuple[int, ...]


def lookup(cache: PrefixCache, tokens: np.ndarray, limit: int, granule: int = 1) -> Found:
    """What the runtime's seam does with a plan's pages, without llama.cpp: plan, fetch, commit."""
    request = Prompt(tokens=tokens, limit=limit, granule=granule)
    plan = cache.plan(request)
    fetched = cache.pages.fetch(plan.pages)
    assert len(fetched) == len(plan.pages)
    outcome = RestoreOutcome(plan, restored=bool(fetched), fetched=tuple(fetched))
    cache.commit(plan, outcome, request)
    return Found(
        outcome.tier,
        plan.n_tokens,
        tuple(page.payload for page in fetched),
        tuple(page.used for page in plan.pages),
    )


def served(cache: PrefixCache, tokens: np.ndarray, limit: int) -> tuple[int, tuple[int, ...]]:
    """Tokens a lookup serves from L3 and how many of each page; checks the restored bytes."""
    found = lookup(cache, tokens, limit)
    if found.n_tokens:
        pages = [
            page_from_bytes(p).head(n) for p, n in zip(found.payloads, found.uses, strict=True)
        ]
        blob = assemble(pages, STATE.layout)
        assert bytes(blob) == build_state(CONTENT, found.n_tokens).data
    return found.n_tokens, found.uses


def stored_pages(cache: PrefixCache) -> int:
    assert cache.disk is not None
    return cache.disk.status().usage.pages


def test_a_branching_prompt_reuses_part_of_a_page_and_stores_only_its_own_tokens(
    cache: PrefixCache,
) -> None:
    a = prompt(300, 300, seed=1)
    record(cache, a)
    assert stored_pages(cache) == 3  # 128 + 128 + 44
    assert served(cache, a, 298) == (298, (128, 128, 42))

    b = prompt(200, 330, seed=2)  # branches off inside A's second page
    assert served(cache, b, 328) == (200, (128, 72))
    plan = cache.plan_record(b, len(b))
    assert plan is not None
    assert [s.used for s in plan.reused] == [128, 72]
    assert [(start, end) for _, _, start, end in plan.new] == [(200, 256), (256, 330)]
    record(cache, b)
    assert stored_pages(cache) == 5
    assert served(cache, b, 328) == (328, (128, 72, 56, 72))

    # C follows B past the branch point: the walk goes through the branch into B's pages
    c = np.concatenate([b[:240], prompt(0, 60, seed=3)]).astype(np.int32)
    assert served(cache, c, 298) == (240, (128, 72, 40))


def test_an_extended_prompt_continues_the_stored_tail(cache: PrefixCache) -> None:
    turn1 = prompt(150, 150, seed=1)
    record(cache, turn1)
    turn2 = np.concatenate([turn1, prompt(0, 300, seed=4)]).astype(np.int32)
    plan = cache.plan_record(turn2, len(turn2))
    assert plan is not None
    assert [s.used for s in plan.reused] == [128, 22]
    assert [(start, end) for _, _, start, end in plan.new] == [(150, 256), (256, 384), (384, 450)]
    record(cache, turn2)
    assert stored_pages(cache) == 5
    assert served(cache, turn2, 448) == (448, (128, 22, 106, 128, 64))


def test_a_stored_prefix_is_not_planned_again(cache: PrefixCache) -> None:
    a = prompt(256, 256, seed=1)
    record(cache, a)
    assert cache.plan_record(a, 256) is None
    assert cache.plan_record(a, 200) is None
    assert cache.counters.records_skipped == 2


def test_a_record_planned_while_the_previous_one_is_queued_reuses_its_pages(
    cache: PrefixCache,
) -> None:
    disk = cache.disk
    assert disk is not None
    a = prompt(300, 300, seed=1)
    b = prompt(280, 320, seed=2)
    with disk._store_lock:  # the writer cannot commit A (nor forget it) until this is released
        plan_a = cache.plan_record(a, len(a))
        assert plan_a is not None and cache.record(plan_a, STATE, a)
        plan_b = cache.plan_record(b, len(b))
        assert plan_b is not None
        assert [s.used for s in plan_b.reused] == [128, 128, 24]  # A's pages, still queued
        assert [(start, end) for _, _, start, end in plan_b.new] == [(280, 320)]
        assert cache.record(plan_b, STATE, b)
    assert disk.flush(10)
    assert stored_pages(cache) == 4 and disk.status().process_activity.dropped_writes == 0
    assert served(cache, b, 318) == (318, (128, 128, 24, 38))


def test_a_prefix_whose_record_waits_for_the_writer_is_planned_and_served(
    cache: PrefixCache,
) -> None:
    """Issue 42: a lookup racing the record of its prefix is a hit, with the exact bytes."""
    disk = cache.disk
    assert disk is not None
    gate = threading.Event()
    real_write = disk._writer._write

    def gated(rec: PrefixRecord) -> None:
        gate.wait(10)
        real_write(rec)

    disk._writer._write = gated  # type: ignore[method-assign]
    try:
        other = prompt(0, 200, seed=7)
        plan = cache.plan_record(other, len(other))
        assert plan is not None and cache.record(plan, STATE, other)  # held in the writer
        a = prompt(300, 300, seed=1)
        plan = cache.plan_record(a, len(a))
        assert plan is not None and cache.record(plan, STATE, a)  # waits behind it
        assert stored_pages(cache) == 0
        assert served(cache, a, 298) == (298, (128, 128, 42))  # the bytes are checked there
        assert cache.counters.hits["l3"] == 1
        assert disk.status().process_activity.pages_read_in_flight == 3
    finally:
        gate.set()
    assert disk.flush(10)
    assert stored_pages(cache) == 5


def test_a_plan_cut_to_fewer_tokens_keeps_whole_pages_then_a_head() -> None:
    pages = tuple(PageRef("l3", bytes([i]) * 16, used) for i, used in enumerate((128, 128, 44)))
    plan = RestorePlan("l3", 300, 0, pages=pages)
    assert plan.truncated(400) is plan
    cut = plan.truncated(200)
    assert (cut.tier, cut.n_tokens, [p.used for p in cut.pages]) == ("l3", 200, [128, 72])
    # an append plan's first page counts the cells below its L1 base too
    append = RestorePlan("l3", 300, 100, pages=pages[1:], base_tokens=172, floor=172)
    assert [p.used for p in append.truncated(260).pages] == [128, 4]


def test_a_restore_the_measured_costs_say_is_slower_than_a_prefill_is_skipped(
    cache: PrefixCache,
) -> None:
    tokens = prompt(300, 300, seed=1)
    record(cache, tokens)
    assert cache.disk is not None
    cache.disk.flush()
    cache.planner.bytes_per_token = STATE.layout.bytes_per_token
    assert lookup(cache, tokens, 298).tier == "l3"  # nothing measured yet: restore
    costs = cache.costs
    costs.observe_prefill(1000, 0.001)  # 1 µs a token
    costs.observe_restore(1 << 20, 1.0, tier="l3")  # 1 s a MiB: far slower
    slow = lookup(cache, tokens, 298)
    assert (slow.tier, slow.n_tokens) == ("cold", 0)
    # counted as what served (a miss) and as a skipped restore, never as an L3 hit
    assert cache.counters.restores_skipped == 1 and cache.counters.hits["l3"] == 1
    assert cache.counters.misses == 1
    costs.prefill_seconds_per_token = 10.0 / 1000
    costs.restore_rates["l3"] = 1e-6 / (1 << 20)
    assert lookup(cache, tokens, 298).tier == "l3"


def test_a_lookup_serves_whole_granules_and_counts_only_what_it_serves(
    cache: PrefixCache,
) -> None:
    record(cache, prompt(300, 600, seed=1))
    branch = prompt(300, 600, seed=2)  # shares 300 tokens: two whole pages and 44 of the third
    assert served(cache, branch, 599)[0] == 300
    found = lookup(cache, branch, 599, granule=64)
    assert found.n_tokens == 256 and found.uses == (128, 128)  # the third page is not read
    assert bytes(assemble([page_from_bytes(p) for p in found.payloads], STATE.layout)) == bytes(
        build_state(CONTENT, 256).data
    )
    hits = cache.counters.hits["l3"]
    # a hit shorter than one granule is a miss: not counted, nothing read
    short = prompt(50, 600, seed=3)
    found = lookup(cache, short, 599, granule=64)
    assert found.tier == "cold" and found.n_tokens == 0 and not found.payloads
    assert cache.counters.hits["l3"] == hits
    assert served(cache, short, 599)[0] == 50  # token-granular, the same lookup hits


def test_l2_restores_are_weighed_at_their_own_rate(tmp_path: Path) -> None:
    """A slow L3 rate must not refuse a hit served wholly from L2 (host RAM), and the reverse."""
    from skippy_llama.tiers.ram import RamTier

    settings = L3Settings(
        mode="fixed", budget="1GiB", directory=tmp_path / "l3", minimum_free="1GiB"
    )
    disk = DiskTier(settings, disk_free=lambda _p: 1 << 40, close_at_exit=False)
    ram = RamTier(64 << 20, source=disk, large_prefix_tokens=1)  # a first fill is promoted
    cache = PrefixCache(
        identity=IDENTITY,
        page_tokens=128,
        tiers=[ram, disk],
        bytes_per_token=STATE.layout.bytes_per_token,
    )
    try:
        tokens = prompt(300, 300, seed=1)
        record(cache, tokens)
        costs = cache.costs
        costs.observe_prefill(1000, 0.001)  # 1 µs a token
        costs.observe_restore(1 << 20, 1e-6, tier="l3")  # L3 fast for now
        assert lookup(cache, tokens, 298).tier == "l3"  # the pages are now in L2 too
        costs.restore_rates["l3"] = 1.0 / (1 << 20)  # L3 now 1 s a MiB: far slower
        assert lookup(cache, tokens, 298).tier == "l2"  # L2 not measured yet: restore
        costs.observe_restore(1 << 20, 1e-6, tier="l2")
        assert lookup(cache, tokens, 298).tier == "l2"
        assert cache.counters.restores_skipped == 0
        costs.restore_rates["l2"] = 1.0 / (1 << 20)
        assert lookup(cache, tokens, 298).tier == "cold"
        assert cache.counters.restores_skipped == 1
    finally:
        disk.close()


def test_a_page_l3_rewrites_after_a_restore_read_it_is_never_promoted_into_l2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Promotion after a restore keeps L2's copy under the digest the restore's read verified
    (it travels with the fetched page). Asked after the read, L3 would give the digest of bytes
    written since, and L2 would serve the old bytes as those (it did before the fix)."""
    from skippy_llama.identity import page_keys
    from skippy_llama.tiers.ram import RamTier

    settings = L3Settings(
        mode="fixed", budget="1GiB", directory=tmp_path / "l3", minimum_free="1GiB"
    )
    disk = DiskTier(settings, disk_free=lambda _p: 1 << 40, close_at_exit=False)
    ram = RamTier(64 << 20, source=disk, large_prefix_tokens=1)  # a first fill is promoted
    disk.add_removal_listener(ram.invalidate)
    cache = PrefixCache(identity=IDENTITY, page_tokens=128, tiers=[ram, disk])
    try:
        tokens = prompt(0, 600, seed=1)
        record(cache, tokens)
        keys = page_keys(cache.root, tokens[:512], 128)
        real_digest = disk.digest
        now: dict[bytes, bytes] = {}

        def current(key: bytes) -> bytes | None:
            return now[key] if key in now else real_digest(key)

        monkeypatch.setattr(disk, "digest", current)
        request = Prompt(tokens=tokens, limit=598)
        plan = cache.plan(request)
        assert [page.tier for page in plan.pages] == ["l3"] * 5
        fetched = cache.pages.fetch(plan.pages)  # the restore's read
        now[keys[1]] = b"\xee" * 16  # another process records page 1 anew after the read
        cache.commit(plan, RestoreOutcome(plan, restored=True, fetched=tuple(fetched)), request)
        assert ram.holds(keys[0]) and not ram.holds(keys[1])
        assert ram.fetch(keys[1:2]) == []  # never the old bytes under the new digest
        assert ram.fetch(keys[:1]) == [bytes(fetched[0].payload)]

        # a page rewritten after L2 took it: the copy keeps its read's digest, and the lookup
        # that finds L3's new one drops it (a miss), never serves it
        now[keys[0]] = b"\xdd" * 16
        mismatches = ram.status().digest_mismatches
        assert ram.fetch(keys[:1]) == []
        assert ram.status().digest_mismatches == mismatches + 1
    finally:
        disk.close()


def test_a_page_read_from_a_record_waiting_for_the_writer_is_not_promoted(
    tmp_path: Path,
) -> None:
    """A page L3 serves from a record its writer has not stored yet has no digest (hashing it
    would cost the request path a pass over its bytes): L2 does not take it."""
    from skippy_llama.plan import FetchedPage
    from skippy_llama.tiers.ram import RamTier

    settings = L3Settings(
        mode="fixed", budget="1GiB", directory=tmp_path / "l3", minimum_free="1GiB"
    )
    disk = DiskTier(settings, disk_free=lambda _p: 1 << 40, close_at_exit=False)
    ram = RamTier(64 << 20, source=disk, large_prefix_tokens=1)
    cache = PrefixCache(identity=IDENTITY, page_tokens=128, tiers=[ram, disk])
    try:
        tokens = prompt(0, 300, seed=1)
        record(cache, tokens)
        plan = cache.plan(Prompt(tokens=tokens, limit=298))
        fetched = cache.pages.fetch(plan.pages)
        assert [page.digest for page in fetched] == [disk.digest(p.key) for p in plan.pages]
        undigested = [FetchedPage(p.tier, p.key, p.payload) for p in fetched]
        cache.pages.promote(undigested, 4096)
        assert len(ram) == 0
        cache.pages.promote(fetched, 4096)
        assert len(ram) == len(fetched)
    finally:
        disk.close()
