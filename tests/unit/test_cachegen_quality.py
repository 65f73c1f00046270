"""The lossy codec's quality gate (codecs/quality.py): arithmetic only, no model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from skippy_llama.codecs.quality import (
    GATE,
    Gate,
    Quality,
    Scores,
    cheapest,
    greedy_agreement,
    log_softmax,
)


def test_log_softmax_normalizes_and_is_shift_invariant() -> None:
    x = np.array([[1000.0, 1001.0, 999.0], [0.0, 0.0, 0.0]])
    lp = log_softmax(x)
    assert np.allclose(np.exp(lp).sum(axis=1), 1.0)
    assert np.allclose(lp[1], -math.log(3))
    assert np.allclose(log_softmax(x + 7.5), lp)


def test_identical_logits_score_perfectly() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 50)).astype(np.float32)
    s = Scores()
    s.add(logits, logits.copy(), rng.integers(0, 50, 64))
    assert (s.positions, s.argmax_agree) == (64, 64)
    assert s.agree_share == 1.0 and s.mean_kl == pytest.approx(0.0, abs=1e-12)
    assert s.ppl_rise == pytest.approx(0.0, abs=1e-12)


def test_kl_and_perplexity_match_hand_computed_values() -> None:
    """Two positions over a 2-token vocabulary, with every figure computed by hand."""
    p = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
    q = np.log(np.array([[0.25, 0.75], [0.9, 0.1]]))
    s = Scores()
    s.add(p, q, [0, 0])
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert s.mean_kl == pytest.approx(kl0 / 2)
    assert s.max_kl == pytest.approx(kl0)
    # argmax: position 0 ties [0.5, 0.5] -> index 0 against 1; position 1 agrees
    assert s.argmax_agree == 1 and s.agree_share == 0.5
    native_nll = -math.log(0.5) - math.log(0.9)
    lossy_nll = -math.log(0.25) - math.log(0.9)
    assert s.ppl_rise == pytest.approx(math.exp((lossy_nll - native_nll) / 2) - 1)
    # a lossy restore that predicts the targets better lowers perplexity: a negative rise
    better = Scores()
    better.add(p, q, [1, 1])
    assert better.ppl_rise < 0


def test_scores_sum_over_texts() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(2, 8, 10))
    t = rng.integers(0, 10, 8)
    one = Scores()
    one.add(a, b, t)
    two = Scores()
    two.add(a[:5], b[:5], t[:5])
    two.add(a[5:], b[5:], t[5:])
    assert two.positions == one.positions == 8
    assert two.argmax_agree == one.argmax_agree
    assert two.mean_kl == pytest.approx(one.mean_kl)
    assert two.ppl_rise == pytest.approx(one.ppl_rise)
    assert len(two.per_text_kl) == 2


def test_shapes_must_match() -> None:
    with pytest.raises(ValueError):
        Scores().add(np.zeros((4, 3)), np.zeros((4, 2)), [0] * 4)
    with pytest.raises(ValueError):
        Scores().add(np.zeros((4, 3)), np.zeros((4, 3)), [0] * 3)


def test_the_gate_thresholds_are_the_issue_s() -> None:
    assert (GATE.min_argmax_agree, GATE.max_mean_kl, GATE.max_ppl_rise) == (0.98, 0.02, 0.01)


@pytest.mark.parametrize(
    ("agree", "kl", "rise", "fails"),
    [
        (0.98, 0.02, 0.01, []),  # every bound is inclusive
        (0.999, 0.001, -0.05, []),  # a perplexity fall passes
        (0.9799, 0.0, 0.0, ["argmax"]),
        (1.0, 0.0201, 0.0, ["KL"]),
        (1.0, 0.0, 0.0101, ["perplexity"]),
        (0.5, 1.0, 0.5, ["argmax", "KL", "perplexity"]),
        (1.0, math.nan, 0.0, ["KL"]),  # a NaN never passes
    ],
)
def test_gate_verdicts(agree: float, kl: float, rise: float, fails: list[str]) -> None:
    q = Quality(agree, kl, rise, positions=4096, held_out_positions=1024)
    got = q.failures()
    assert len(got) == len(fails)
    for word, why in zip(fails, got, strict=True):
        assert word in why
    assert q.passed() is (not fails)


def test_no_positions_never_qualify() -> None:
    assert not Quality.of(Scores(), Scores()).passed()
    q = Quality(1.0, 0.0, 0.0, positions=64, held_out_positions=0)
    assert q.failures() == ["no scored positions"]


def test_a_stricter_gate_fails_what_the_default_passes() -> None:
    q = Quality(0.985, 0.01, 0.005, positions=64, held_out_positions=64)
    assert q.passed()
    assert not q.passed(Gate(min_argmax_agree=0.99))


def test_greedy_agreement_counts_tokens_before_the_first_difference() -> None:
    assert greedy_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert greedy_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert greedy_agreement([5], [6]) == 0
    assert greedy_agreement([1, 2], [1, 2, 3]) == 2


def test_cheapest_passing_set_is_the_smallest() -> None:
    assert cheapest([(0.5, True), (0.23, False), (0.37, True), (0.30, False)]) == 2
    assert cheapest([(0.5, False), (0.3, False)]) is None
    assert cheapest([]) is None
