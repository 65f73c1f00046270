"""Admission policy: EWMA costs, score per exclusive byte, fallback, counters (pure, no I/O)."""

from __future__ import annotations

import math

import pytest

from skippy_llama.admission import AdmissionPolicy, CostModel, exclusive_bytes


def measured(prefill_s_per_token: float, restore_s_per_byte: float) -> CostModel:
    costs = CostModel()
    costs.observe_prefill(1000, prefill_s_per_token * 1000)
    costs.observe_restore(1000, restore_s_per_byte * 1000, tier="l3")
    return costs


def test_ewma() -> None:
    costs = CostModel(alpha=0.5)
    assert not costs.measured and costs.cold_cost(10) is None
    costs.observe_prefill(100, 1.0)  # 0.01 s/token
    costs.observe_prefill(100, 3.0)  # 0.03 s/token -> 0.02
    assert costs.prefill_seconds_per_token == pytest.approx(0.02)
    costs.observe_prefill(0, 5.0)  # ignored
    costs.observe_prefill(10, float("nan"))  # ignored
    assert costs.cold_cost(50) == pytest.approx(1.0)
    costs.observe_restore(1000, 0.001, tier="l3")
    assert costs.measured and costs.restore_cost(2000, tier="l3") == pytest.approx(0.002)


def test_falls_back_to_write_through_until_both_costs_are_measured() -> None:
    policy = AdmissionPolicy()
    decision = policy.decide(n_tokens=1000, total_bytes=10**6, exclusive=10**6)
    assert decision.admit and decision.reason == "fallback_unmeasured" and decision.score is None
    policy.costs.observe_prefill(1000, 1.0)
    assert policy.decide(1000, 10**6, 10**6).reason == "fallback_unmeasured"
    policy.costs.observe_restore(10**6, 0.01, tier="l3")
    assert policy.decide(1000, 10**6, 10**6).reason == "score"
    assert policy.counters.to_json() == {"admitted": 3, "rejected": 0, "fallback": 2}


def test_score_formula() -> None:
    policy = AdmissionPolicy(measured(0.004, 1e-9))
    cold, restore = 0.004 * 2048, 1e-9 * 50_000_000
    decision = policy.decide(2048, 50_000_000, exclusive=10_000_000, reuse_probability=0.5)
    assert decision.admit and decision.score == pytest.approx(0.5 * (cold - restore) / 10_000_000)


def test_rejects_when_restore_is_not_faster_than_prefill() -> None:
    policy = AdmissionPolicy(measured(1e-5, 1e-6))  # fast GPU prefill, slow storage
    decision = policy.decide(1000, 10**6, 10**6)
    assert not decision.admit and decision.reason == "no_benefit"
    assert policy.counters.rejected == 1


def test_shared_pages_are_charged_fractionally() -> None:
    assert exclusive_bytes([(1000, 1), (1000, 4), (800, 0)]) == pytest.approx(1000 + 250 + 800)
    policy = AdmissionPolicy(measured(0.001, 1e-9), min_score=1e-9)
    alone = policy.decide(1000, 10**6, exclusive_bytes([(10**6, 1)]), reuse_probability=0.5)
    shared = policy.decide(1000, 10**6, exclusive_bytes([(10**6, 8)]), reuse_probability=0.5)
    assert shared.score is not None and alone.score is not None
    assert shared.score == pytest.approx(alone.score * 8)


def test_threshold_and_no_new_bytes() -> None:
    policy = AdmissionPolicy(measured(0.001, 1e-9), min_score=1.0)
    low = policy.decide(1000, 10**6, 10**6)
    assert not low.admit and low.reason == "below_threshold"
    free = policy.decide(1000, 10**6, 0.0)
    assert free.admit and free.reason == "no_new_bytes" and free.score == math.inf


def test_reuse_probability_is_a_laplace_estimate() -> None:
    policy = AdmissionPolicy()
    assert policy.reuse_probability == pytest.approx(0.5)
    for _ in range(8):
        policy.observe_recorded()
    policy.observe_reused()
    assert policy.reuse_probability == pytest.approx(2 / 10)


def test_alpha_must_be_in_range() -> None:
    with pytest.raises(ValueError):
        CostModel(alpha=0.0)
