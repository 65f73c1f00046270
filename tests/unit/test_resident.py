"""L1 policy: chain-walk lookup with token-exact extension, LRU, pins, budget, supersession."""

from __future__ import annotations

import numpy as np

from skippy_llama.tiers.resident import ResidentIndex, common_prefix

ROOT = b"\x01" * 16


def _park(index: ResidentIndex, tokens: np.ndarray) -> int:
    plan = index.plan_park(ROOT, tokens)
    assert plan is not None
    index.commit_park(plan, ROOT, tokens, b"h")
    return plan.seq_id


def toks(*parts: range) -> np.ndarray:
    return np.concatenate([np.arange(p.start, p.stop, dtype=np.int32) for p in parts])


def test_common_prefix() -> None:
    assert common_prefix(toks(range(5)), toks(range(3), range(9, 12))) == 3
    assert common_prefix(toks(range(5)), toks(range(5))) == 5
    assert common_prefix(toks(range(0)), toks(range(5))) == 0


def test_lookup_extends_past_the_last_full_page() -> None:
    index = ResidentIndex([1, 2], budget_tokens=1000, page_tokens=16)
    seq = _park(index, toks(range(100)))
    prompt = toks(range(70), range(500, 520))
    hit = index.match(ROOT, prompt, len(prompt) - 1)
    assert hit is not None and hit.seq_id == seq and hit.n_tokens == 70


def test_lookup_never_exceeds_limit() -> None:
    index = ResidentIndex([1], budget_tokens=1000, page_tokens=16)
    _park(index, toks(range(100)))
    hit = index.match(ROOT, toks(range(50)), 49)
    assert hit is not None and hit.n_tokens == 49


def test_longest_of_several_entries_wins() -> None:
    index = ResidentIndex([1, 2, 3], budget_tokens=1000, page_tokens=16)
    _park(index, toks(range(40), range(900, 960)))
    best = _park(index, toks(range(80), range(700, 720)))
    hit = index.match(ROOT, toks(range(90)), 89)
    assert hit is not None and hit.seq_id == best and hit.n_tokens == 80


def test_a_longer_prefix_supersedes_its_prefixes() -> None:
    index = ResidentIndex([1, 2], budget_tokens=1000, page_tokens=16)
    first = _park(index, toks(range(50)))
    plan = index.plan_park(ROOT, toks(range(120)))
    assert plan is not None and first in plan.evict
    index.commit_park(plan, ROOT, toks(range(120)), b"h")
    assert [e.n_tokens for e in index.entries()] == [120]


def test_lru_eviction_under_budget_and_pins() -> None:
    index = ResidentIndex([1, 2], budget_tokens=200, page_tokens=16)
    a = _park(index, toks(range(100)))
    b = _park(index, toks(range(1000, 1090)))
    index.pin(a)
    plan = index.plan_park(ROOT, toks(range(2000, 2100)))
    assert plan is not None and plan.evict == (b,)  # a is pinned, b goes
    index.commit_park(plan, ROOT, toks(range(2000, 2100)), b"h")
    index.pin(plan.seq_id)
    assert index.plan_park(ROOT, toks(range(3000, 3100))) is None  # everything pinned
    index.unpin(a)
    assert index.plan_park(ROOT, toks(range(3000, 3100))) is not None


def test_over_budget_prefix_is_truncated_to_whole_pages() -> None:
    index = ResidentIndex([1], budget_tokens=100, page_tokens=16)
    plan = index.plan_park(ROOT, toks(range(300)))
    assert plan is not None and plan.n_tokens == 96


def test_remove_and_clear_forget_keys() -> None:
    index = ResidentIndex([1, 2], budget_tokens=1000, page_tokens=16)
    a = _park(index, toks(range(64)))
    _park(index, toks(range(500, 564)))
    index.remove(a)
    assert index.match(ROOT, toks(range(64)), 63) is None
    assert len(index.clear()) == 1
    assert index.entries() == [] and index.used_tokens == 0


def test_a_prefix_already_held_is_not_parked_again() -> None:
    index = ResidentIndex([1, 2], budget_tokens=1000, page_tokens=64)
    plan = index.plan_park(ROOT, toks(range(300)))
    assert plan is not None
    index.commit_park(plan, ROOT, toks(range(300)), b"meta")
    assert index.plan_park(ROOT, toks(range(200))) is None  # the entry holds it whole
    assert index.plan_park(ROOT, toks(range(300))) is None
    assert index.entry(plan.seq_id).handle == b"meta"


def test_abandoned_park_forgets_every_slot_it_touched() -> None:
    index = ResidentIndex([1, 2], budget_tokens=1000, page_tokens=64)
    first = index.plan_park(ROOT, toks(range(100)))
    assert first is not None
    index.commit_park(first, ROOT, toks(range(100)), b"a")
    longer = index.plan_park(ROOT, toks(range(200)))
    assert longer is not None and first.seq_id in longer.evict
    index.abandon_park(longer)
    assert index.entries() == []
    assert index.match(ROOT, toks(range(200)), 199) is None


def test_sliding_window_checkpoints_serve_only_their_full_length() -> None:
    """A checkpoint longer than the window lacks the window before any shorter cut."""
    index = ResidentIndex([1, 2], budget_tokens=1000, page_tokens=16, window=64)
    long_seq = _park(index, toks(range(100)))
    assert index.match(ROOT, toks(range(70), range(500, 520)), 89) is None
    hit = index.match(ROOT, toks(range(110)), 108)
    assert hit is not None and (hit.seq_id, hit.n_tokens) == (long_seq, 100)
    short_seq = _park(index, toks(range(1000, 1050)))  # within the window: any cut is exact
    hit = index.match(ROOT, toks(range(1000, 1030), range(7, 9)), 31)
    assert hit is not None and (hit.seq_id, hit.n_tokens) == (short_seq, 30)


def test_a_match_changes_no_state_and_a_touch_makes_the_entry_most_recent() -> None:
    index = ResidentIndex([1, 2], budget_tokens=1000, page_tokens=64)
    for seq_id, start in ((1, 0), (2, 500)):
        plan = index.plan_park(ROOT, toks(range(start, start + 64)))
        assert plan is not None and plan.seq_id == seq_id
        index.commit_park(plan, ROOT, toks(range(start, start + 64)), b"h")
    assert index.match(ROOT, toks(range(64)), 63) is not None
    assert [e.seq_id for e in index.entries()] == [1, 2]  # a lookup is not a use
    index.touch(1)
    assert [e.seq_id for e in index.entries()] == [2, 1]
