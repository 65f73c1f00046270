"""Append plans (an L1 prefix continued by L2/L3 pages): truncation to a short fetch."""

from __future__ import annotations

from skippy_llama.plan import PageRef, RestorePlan

# L1 holds 150 tokens; pages [128, 192) and [192, 256) continue it, the last used for 40 tokens
PAGES = (PageRef("l3", b"p2" * 8, 64), PageRef("l3", b"p3" * 8, 40))
PLAN = RestorePlan("l3", 232, 0, seq_id=3, pages=PAGES, base_tokens=150, floor=150)


def test_append_plan_counts_its_split() -> None:
    assert PLAN.appended_tokens == 82
    assert RestorePlan("l3", 232, 0, pages=(PageRef("l3", b"p" * 16, 232),)).appended_tokens == 0


def test_truncating_an_append_plan_keeps_the_base_and_cuts_the_pages() -> None:
    cut = PLAN.truncated(200)
    assert (cut.n_tokens, cut.base_tokens, cut.seq_id) == (200, 150, 3)
    assert [p.key for p in cut.pages] == [b"p2" * 8, b"p3" * 8]
    assert [p.used for p in cut.pages] == [64, 8]
    cut = PLAN.truncated(170)
    assert [p.used for p in cut.pages] == [42] and cut.appended_tokens == 20
    assert PLAN.truncated(232) is PLAN
