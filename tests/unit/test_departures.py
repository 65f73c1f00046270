"""Departures from the live sequence and their returns: the park rule's reuse chance (pure)."""

from __future__ import annotations

import numpy as np

from skippy_llama.costs import CostModel
from skippy_llama.departures import Departures, Seen

PAGE = 64


def toks(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def test_a_prompt_that_destroys_a_page_or_more_departs_and_one_that_continues_does_not() -> None:
    d = Departures(PAGE)
    live = toks(500)
    assert d.observe(toks(600), live) == Seen(departed=False, returned=False)  # continues it
    # a question after a shared document destroys less than a page: not a departure
    assert d.observe(np.concatenate([toks(480), toks(30, 9000)]), live) == Seen(False, False)
    assert d.observe(toks(500, 10_000), live) == Seen(departed=True, returned=False)
    assert len(d) == 1


def test_two_chats_taking_turns_return_and_one_shot_prompts_never_do() -> None:
    d = Departures(PAGE)
    a, b = toks(300), toks(300, 5000)
    assert d.observe(b, a) == Seen(True, False)  # B leaves A
    # A comes back (longer), leaving B: a return and a departure at once
    assert d.observe(np.concatenate([a, toks(50, 7000)]), b) == Seen(True, True)
    # a departure returns once: A's second return finds only B's departure, which it misses
    assert d.observe(a, b) == Seen(True, False)
    shots = Departures(PAGE)
    seen = [shots.observe(toks(500, 1000 * (i + 1)), toks(500, 1000 * i)) for i in range(20)]
    assert all(s.departed and not s.returned for s in seen)
    assert len(shots) == 16  # only the recent departures are kept


def test_the_reuse_chance_starts_certain_and_follows_what_the_prompts_do() -> None:
    costs = CostModel()
    assert costs.reuse_probability == 1.0  # unmeasured: park, so it gets measured
    for _ in range(9):
        costs.observe_departure()
    one_shots = costs.reuse_probability
    assert 0.1 < one_shots < 0.2
    for _ in range(20):  # two chats taking turns: every departure returns
        costs.observe_return()
        costs.observe_departure()
    assert costs.reuse_probability > 0.8
    costs.observe_return()
    assert costs.reuse_probability <= 1.0
