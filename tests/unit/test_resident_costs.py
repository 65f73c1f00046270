from __future__ import annotations

import pytest

from skippy_llama.tiers.resident_costs import MIN_PREFILL_TOKENS, ResidentCosts


def test_unmeasured_costs_say_yes_so_they_get_measured() -> None:
    costs = ResidentCosts()
    assert costs.restore_pays(1) and costs.park_pays(1)
    costs.observe_prefill(100, 0.1)
    assert costs.restore_pays(1) and costs.park_pays(1)  # restore and park still unknown


def test_cpu_like_costs_always_pay_and_gpu_like_costs_need_long_prefixes() -> None:
    cpu = ResidentCosts()
    cpu.observe_prefill(256, 0.5)  # ~2 ms a token
    cpu.observe_restore(0.005)
    cpu.observe_park(0.005)
    assert cpu.restore_pays(8) and cpu.park_pays(8)

    gpu = ResidentCosts()
    gpu.observe_prefill(300, 0.010)  # a small model on an H200: 33 µs a token
    gpu.observe_restore(0.065)  # fixed cost of a state call there
    gpu.observe_park(0.065)
    assert not gpu.restore_pays(256) and not gpu.park_pays(256)
    assert gpu.restore_pays(2_000) and not gpu.park_pays(2_000)
    assert gpu.park_pays(4_000)


def test_short_prefills_and_nonsense_timings_teach_nothing() -> None:
    costs = ResidentCosts()
    costs.observe_prefill(MIN_PREFILL_TOKENS - 1, 0.001)
    costs.observe_prefill(100, float("nan"))
    costs.observe_restore(-1.0)
    costs.observe_park(float("inf"))
    assert costs.prefill_seconds_per_token is None
    assert costs.restore_seconds is None and costs.park_seconds is None


def test_averages_follow_the_machine() -> None:
    costs = ResidentCosts(alpha=0.5)
    costs.observe_restore(0.1)
    costs.observe_restore(0.0)
    assert costs.restore_seconds == pytest.approx(0.05)
    with pytest.raises(ValueError, match="alpha"):
        ResidentCosts(alpha=0)
