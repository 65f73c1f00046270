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
from skippy_llama.tiers.l3.policy_api import LruPolicy, PageStats

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


def test_reuse_first_sighting_goes_before_reused_pages() -> None:
    policy = ReusePolicy(64 * MiB)
    hot = page("hot", hits=3, last_used=1.0)
    assert policy.admit(hot, 0.0)
    one_off = page("long", created=5.0, last_used=5.0)
    assert policy.admit(one_off, 5.0)
    # the one-off long prompt, though newer, sorts below the page reused three times
    assert policy.priority(one_off, 6.0) < policy.priority(hot, 6.0)


def test_reuse_remembers_earlier_lives() -> None:
    """A page evicted after hits, then recorded again, outranks a page seen once."""
    policy = ReusePolicy(64 * MiB)
    returning = page("doc", hits=2)
    policy.admit(returning, 0.0)
    policy.evicted(returning, 1.0)
    again = page("doc", created=2.0, last_used=2.0)
    fresh = page("new", created=2.0, last_used=2.0)
    policy.admit(again, 2.0)
    policy.admit(fresh, 2.0)
    assert policy.uses(again) == 4.0  # first admission, its two hits, this admission
    assert policy.priority(again, 3.0) > policy.priority(fresh, 3.0)


def test_reuse_ages_pages_unused_since_evictions_raised_l() -> None:
    """GDSF's inflation: a once-hot page unused while L rose sinks below a newer hot page."""
    policy = ReusePolicy(64 * MiB)
    stale = page("stale", hits=2, last_used=0.0)
    policy.admit(stale, 0.0)
    for i in range(1, 6):  # evictions of valuable pages raise L
        victim = page(f"v{i}", hits=5, last_used=float(i))
        policy.admit(victim, float(i))
        policy.evicted(victim, float(i))
    fresh = page("fresh", hits=2, last_used=6.0)
    policy.admit(fresh, 6.0)
    assert policy.priority(stale, 7.0) < policy.priority(fresh, 7.0)


def test_reuse_charges_shared_pages_fractionally() -> None:
    """A system-prompt page under 50 prefixes outlives an equally used unshared page."""
    policy = ReusePolicy(64 * MiB)
    shared = page("system", hits=2, sharers=50, prefill_s=0.5, restore_s=0.01)
    alone = page("doc", hits=2, sharers=1, prefill_s=0.5, restore_s=0.01)
    policy.admit(shared, 0.0)
    policy.admit(alone, 0.0)
    assert policy.value(shared) > policy.value(alone) > 0
    assert policy.priority(alone, 1.0) < policy.priority(shared, 1.0)


def test_reuse_weighs_benefit_per_byte() -> None:
    """GDSF: of two pages used equally, the one that saves more per byte is kept."""
    policy = ReusePolicy(64 * MiB)
    cheap = page("tail", hits=2, prefill_s=0.05, restore_s=0.01)
    dear = page("full", hits=2, prefill_s=0.5, restore_s=0.01)
    policy.admit(cheap, 0.0)
    policy.admit(dear, 0.0)
    assert policy.value(cheap) < policy.value(dear)


def test_reuse_rejects_bad_budget() -> None:
    with pytest.raises(ValueError, match="budget must be positive"):
        ReusePolicy(0)
