"""L3 policies on PageStats alone (no store, no model): admission, eviction order, sharing."""

from __future__ import annotations

import pytest

from skippy_llama.tiers.l3.policies import (
    DEFAULT_POLICY,
    LIVE_POLICIES,
    ReusePolicy,
    ShippedPolicy,
    make_policy,
    worth_storing,
)
from skippy_llama.tiers.l3.policy_api import LruPolicy, PageStats, chain_lengths

MiB = 1 << 20


def page(key: str, **kw: float) -> PageStats:
    fields: dict[str, float] = {"size": MiB, "n_tokens": 128, "created": 0.0, "last_used": 0.0}
    fields.update(kw)
    return PageStats(key=key.encode(), **fields)  # type: ignore[arg-type]


def test_make_policy_names_and_unknown() -> None:
    assert DEFAULT_POLICY in LIVE_POLICIES
    for name in LIVE_POLICIES:
        assert make_policy(name, 64 * MiB).name == name
    assert isinstance(make_policy("lru", MiB), LruPolicy)
    with pytest.raises(ValueError, match=r"unknown L3 policy 'belady'.*lru, shipped, reuse"):
        make_policy("belady", MiB)


def test_worth_storing_refuses_only_measured_losers() -> None:
    assert worth_storing(page("a"))  # unmeasured: write-through
    assert worth_storing(page("a", prefill_s=0.5, restore_s=0.01))
    assert not worth_storing(page("a", prefill_s=0.01, restore_s=0.5))  # restore slower: GPU case
    for name in LIVE_POLICIES[1:]:
        policy = make_policy(name, 64 * MiB)
        assert not policy.admit(page("a", prefill_s=0.01, restore_s=0.5), 0.0)


def test_shipped_evicts_probation_first_then_lru() -> None:
    policy = ShippedPolicy()
    old_protected = page("p", last_used=1.0, hits=2)
    new_probation = page("n", last_used=50.0, hits=1)
    older_probation = page("o", last_used=10.0, hits=0)
    order = sorted(
        [old_protected, new_probation, older_probation], key=lambda p: policy.priority(p, 60.0)
    )
    assert [p.key for p in order] == [b"o", b"n", b"p"]


def used(policy: ReusePolicy, key: str, hits: int, at: float, **kw: float) -> PageStats:
    """Admit page ``key`` at ``at``, then return it as the store describes it after ``hits``."""
    assert policy.admit(page(key, created=at, last_used=at, **kw), at)
    return page(key, created=at, last_used=at + hits, hits=hits, **kw)  # type: ignore[arg-type]


def test_reuse_first_sighting_goes_before_reused_pages() -> None:
    policy = ReusePolicy(64 * MiB)
    hot = used(policy, "hot", hits=3, at=0.0)
    one_off = used(policy, "long", hits=0, at=5.0)
    # the one-off long prompt, though newer, sorts below the page reused three times
    assert policy.frequency_class(one_off) == 0 < policy.frequency_class(hot)
    assert policy.priority(one_off, 6.0) < policy.priority(hot, 6.0)


def test_reuse_first_sightings_of_equal_prompts_tie_so_the_deepest_goes_first() -> None:
    policy = ReusePolicy(64 * MiB)
    older, newer = used(policy, "a", hits=0, at=1.0), used(policy, "b", hits=0, at=9.0)
    assert policy.priority(older, 10.0) == policy.priority(newer, 10.0)


def test_reuse_first_sightings_of_longer_prompts_go_first_even_once_cut() -> None:
    """A first sighting written by a 13-page record goes before one of a 5-page record, also
    after an earlier pass cut the long chain back to two pages (the policy remembers)."""
    policy = ReusePolicy(64 * MiB)
    assert policy.admit(page("long", chain_pages=13), 1.0)
    assert policy.admit(page("doc", chain_pages=5), 2.0)
    cut_back = page("long", chain_pages=2)  # what the store's chain walk now finds
    doc = page("doc", chain_pages=5)
    assert policy.priority(cut_back, 3.0) < policy.priority(doc, 3.0)
    # a page another process wrote: only its stored chain is known
    assert policy.priority(page("theirs", chain_pages=7), 3.0) < policy.priority(doc, 3.0)
    # reused pages stay above every first sighting, however long their prompt
    hot = used(policy, "hot", hits=3, at=0.0, chain_pages=40)
    assert policy.priority(hot, 3.0) > policy.priority(doc, 3.0)
    policy.evicted(cut_back, 4.0)  # forgotten with the page
    assert policy.priority(page("long"), 5.0) == policy.priority(page("x"), 5.0)


def test_chain_lengths_walk_to_the_deepest_stored_page_and_survive_damaged_links() -> None:
    links = {
        "a": (None, 0),
        "b": ("a", 1),
        "c": ("b", 2),
        "d": ("a", 1),
        "orphan": ("gone", 3),  # its parent was evicted
        "x": ("y", 0),  # a cycle, with depths that contradict it
        "y": ("x", 0),
        "self": ("self", 2),
    }
    assert chain_lengths(links) == {
        "a": 3,
        "b": 3,
        "c": 3,
        "d": 2,
        "orphan": 4,
        "x": 1,
        "y": 1,
        "self": 3,
    }


def test_reuse_remembers_earlier_lives() -> None:
    """A page evicted after hits, then recorded again, outranks a page seen once."""
    policy = ReusePolicy(64 * MiB)
    returning = used(policy, "doc", hits=2, at=0.0)
    policy.evicted(returning, 3.0)
    again = used(policy, "doc", hits=0, at=4.0)
    fresh = used(policy, "new", hits=0, at=4.0)
    assert policy.uses(again) == 4.0  # first admission, its two hits, this admission
    assert policy.uses(fresh) == 1.0
    assert policy.priority(again, 5.0) > policy.priority(fresh, 5.0)


def test_reuse_counts_hits_a_restarted_process_finds_stored() -> None:
    """Hits are kept in the pages' metadata: a fresh policy ranks by them from the start."""
    policy = ReusePolicy(64 * MiB)
    hot = page("hot", hits=5, last_used=1.0)
    cold = page("cold", hits=0, last_used=9.0)
    assert policy.uses(hot) == 5.0 and policy.uses(hot) == 5.0  # counted once
    assert policy.priority(cold, 10.0) < policy.priority(hot, 10.0)


def test_reuse_classes_group_similar_counts_and_order_them_by_last_use() -> None:
    policy = ReusePolicy(64 * MiB)
    levels = [
        policy.frequency_class(used(policy, f"p{n}", hits=n - 1, at=0.0)) for n in range(1, 13)
    ]
    assert levels == sorted(levels) and levels[0] == 0 and levels[-1] > levels[1] > 0
    assert levels[3] == levels[4]  # 4 and 5 uses: one class
    stale = used(policy, "stale", hits=4, at=0.0)  # 5 uses, last used at 4
    recent = used(policy, "recent", hits=3, at=10.0)  # 4 uses (one class with 5), at 13
    busy = used(policy, "busy", hits=11, at=0.0)  # 12 uses, last used at 11
    order = sorted([busy, recent, stale], key=lambda p: policy.priority(p, 20.0))
    assert [p.key for p in order] == [b"stale", b"recent", b"busy"]


def test_reuse_ages_counts_so_a_page_hot_long_ago_sinks() -> None:
    """TinyLFU's halving: once the sketch has seen ``sketch_period`` more additions, a page
    unused since counts half as much and falls below one reused since."""
    policy = ReusePolicy(64 * MiB, sketch_period=16)
    stale = used(policy, "stale", hits=7, at=0.0)
    assert policy.uses(stale) == 8.0
    for i in range(40):  # traffic elsewhere: two halvings
        policy.admit(page(f"x{i}", created=10.0 + i, last_used=10.0 + i), 10.0 + i)
    assert policy.uses(stale) == 2.0
    lively = used(policy, "lively", hits=3, at=50.0)
    assert policy.priority(stale, 60.0) < policy.priority(lively, 60.0)


def test_reuse_charges_shared_pages_fractionally() -> None:
    """A system-prompt page under 50 prefixes outlives an equally used unshared page."""
    policy = ReusePolicy(64 * MiB)
    shared = used(policy, "system", hits=2, at=0.0, sharers=50, prefill_s=0.5, restore_s=0.01)
    alone = used(policy, "doc", hits=2, at=0.0, sharers=1, prefill_s=0.5, restore_s=0.01)
    assert policy.value(shared) > policy.value(alone) > 0
    assert policy.priority(alone, 5.0) < policy.priority(shared, 5.0)


def test_reuse_weighs_benefit_per_byte() -> None:
    """GDSF's cost/size: of two pages used equally, the one that saves more per byte is kept."""
    policy = ReusePolicy(64 * MiB)
    cheap = used(policy, "tail", hits=4, at=0.0, prefill_s=0.05, restore_s=0.01)
    dear = used(policy, "full", hits=4, at=0.0, prefill_s=0.5, restore_s=0.01)
    assert policy.value(cheap) < policy.value(dear)
    assert policy.priority(cheap, 5.0) < policy.priority(dear, 5.0)


def test_reuse_rejects_bad_budget() -> None:
    with pytest.raises(ValueError, match="budget must be positive"):
        ReusePolicy(0)
