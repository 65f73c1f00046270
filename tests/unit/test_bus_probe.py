"""The load-time bus probe (``runtime/bus.py``): what it measures, kept per process (no model).

Its times are not asserted (a shared machine's copies vary); only its shape and that it is run
once per kind of copy.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from skippy_llama.costs import CostModel
from skippy_llama.runtime import bus


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    bus.forget()
    yield
    bus.forget()


def test_the_cpu_probe_is_a_memory_copy_kept_for_the_process() -> None:
    rate = bus.bus_rate("CPU", kv_offloaded=False, pinned=False)
    assert rate is not None and rate.method == "memcpy"
    assert rate.n_bytes == bus.PROBE_BYTES and 0 < rate.seconds <= rate.probe_s
    assert rate.gb_per_s > 0 and rate.to_json()["bytes"] == bus.PROBE_BYTES
    # kept: a second model in the process pays nothing, whatever it asks on the host
    assert bus.bus_rate("CPU", kv_offloaded=True, pinned=True) is rate
    assert bus.bus_rate("Vulkan", kv_offloaded=True, pinned=False) is rate


def test_a_cuda_context_without_a_cuda_runtime_falls_back_to_the_memory_copy() -> None:
    """On a machine without libcudart the device probe cannot run; the host copy still
    bounds a restore from below, so it is what the cost model gets."""
    rate = bus.bus_rate("CUDA", kv_offloaded=True, pinned=True)
    assert rate is not None
    if rate.method == "memcpy":  # no CUDA runtime here
        assert bus.bus_rate("CUDA", kv_offloaded=True, pinned=True) is rate


def test_a_failing_probe_is_an_unprobed_bus(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise OSError("no memory")

    monkeypatch.setattr(bus, "_memcpy_copier", broken)
    assert bus.bus_rate("CPU", kv_offloaded=False, pinned=False) is None
    costs = CostModel()
    assert costs.restore_cost(10**6, tier="l3") is None  # planned as before the probe


def test_the_probe_feeds_the_cost_model() -> None:
    rate = bus.bus_rate("CPU", kv_offloaded=False, pinned=False)
    assert rate is not None
    costs = CostModel()
    costs.observe_bus(rate.n_bytes, rate.seconds)
    assert costs.restore_cost(rate.n_bytes, tier="l2") == pytest.approx(rate.seconds)


def test_the_probe_gives_the_host_rate_and_first_touch_for_a_first_restore() -> None:
    """Issue 45: a process's first restore is planned with the host's copy rate and the cost
    of committing fresh memory, both from the same probe (``CostModel.observe_host``)."""
    from skippy_llama.state import KVLayout

    rate = bus.bus_rate("CPU", kv_offloaded=False, pinned=False)
    assert rate is not None and rate.method == "memcpy"
    assert rate.host_seconds == rate.seconds and rate.first_touch_seconds >= 0
    assert rate.to_json()["host_gb_per_s"] == round(rate.gb_per_s, 2)
    costs = CostModel()
    layout = KVLayout(v_trans=False, layers=())
    assert bus.seed_costs(costs, layout, "CPU", kv_offloaded=False, pinned=False) is rate
    assert costs.host_seconds_per_byte == pytest.approx(rate.seconds / rate.n_bytes)
    assert costs.first_touch_seconds_per_byte == pytest.approx(
        rate.first_touch_seconds / rate.n_bytes
    )
