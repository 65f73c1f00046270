"""Append plans (an L1 prefix continued by L2/L3 pages): truncation to canonical boundaries."""

from __future__ import annotations

from skippy_llama.cache import LookupResult

# L1 holds 150 tokens; pages [128, 192) and [192, 256) continue it, the last used for 40 tokens
PLAN = LookupResult(
    "l3", 232, payloads=(b"p2", b"p3"), uses=(64, 40), base_tokens=150, base_seq_id=3
)


def test_append_plan_counts_its_split() -> None:
    assert PLAN.appended_tokens == 82
    assert LookupResult("l3", 232, payloads=(b"p",), uses=(232,)).appended_tokens == 0


def test_truncating_an_append_plan_keeps_the_base_and_cuts_the_pages() -> None:
    cut = PLAN.truncated(200)
    assert (cut.n_tokens, cut.base_tokens, cut.base_seq_id) == (200, 150, 3)
    assert cut.payloads == (b"p2", b"p3") and cut.uses == (64, 8)
    cut = PLAN.truncated(170)
    assert cut.payloads == (b"p2",) and cut.uses == (42,) and cut.appended_tokens == 20
    assert PLAN.truncated(232) is PLAN


def test_an_append_plan_cut_to_its_base_is_the_l1_hit_alone() -> None:
    for n in (150, 100):
        cut = PLAN.truncated(n)
        assert (cut.tier, cut.n_tokens, cut.seq_id, cut.payloads) == ("l1", n, 3, ())
    assert PLAN.truncated(0).tier == "cold"
