from __future__ import annotations

import numpy as np
import pytest
from fake_tiers import holding
from test_cache_tree import IDENTITY
from test_plan import PAGE, FakePages, FakeRemote

from skippy_llama.cache import PrefixCache
from skippy_llama.costs import MIN_PREFILL_TOKENS, AlwaysRestore, CostModel
from skippy_llama.identity import page_keys
from skippy_llama.plan import Prompt, RestoreOutcome


def test_unmeasured_costs_say_yes_so_they_get_measured() -> None:
    costs = CostModel()
    assert costs.checkpoint_pays(1) and costs.park_pays(1)
    costs.observe_prefill(100, 0.1)
    assert costs.checkpoint_pays(1) and costs.park_pays(1)  # restore and park still unknown


def test_cpu_like_costs_always_pay_and_gpu_like_costs_need_long_prefixes() -> None:
    cpu = CostModel()
    cpu.observe_prefill(256, 0.5)  # ~2 ms a token
    cpu.observe_checkpoint_restore(0.005)
    cpu.observe_park(0.005)
    assert cpu.checkpoint_pays(8) and cpu.park_pays(8)

    gpu = CostModel()
    gpu.observe_prefill(300, 0.010)  # a small model on an H200: 33 µs a token
    gpu.observe_checkpoint_restore(0.065)  # fixed cost of a state call there
    gpu.observe_park(0.065)
    assert not gpu.checkpoint_pays(256) and not gpu.park_pays(256)
    assert gpu.checkpoint_pays(2_000) and not gpu.park_pays(2_000)
    assert gpu.park_pays(4_000)


def test_short_prefills_and_nonsense_timings_teach_nothing() -> None:
    costs = CostModel()
    costs.observe_prefill(MIN_PREFILL_TOKENS - 1, 0.001)
    costs.observe_prefill(100, float("nan"))
    costs.observe_checkpoint_restore(-1.0)
    costs.observe_park(float("inf"))
    assert costs.prefill_seconds_per_token is None
    assert costs.checkpoint_restore_seconds is None and costs.park_seconds is None


def test_averages_follow_the_machine() -> None:
    costs = CostModel(alpha=0.5)
    costs.observe_checkpoint_restore(0.1)
    costs.observe_checkpoint_restore(0.0)
    assert costs.checkpoint_restore_seconds == pytest.approx(0.05)
    with pytest.raises(ValueError, match="alpha"):
        CostModel(alpha=0)


def test_page_restores_pay_by_their_own_tier_rates() -> None:
    costs = CostModel()
    assert costs.pages_pay(10**9, 1, tier="l3")  # unmeasured: restore, so it gets measured
    costs.observe_prefill(1000, 1.0)  # 1 ms a token
    costs.observe_restore(10**6, 0.010, tier="l3")  # 10 ns a byte
    costs.observe_restore(10**6, 0.001, tier="l2")  # 1 ns a byte
    assert costs.pages_pay(10**6, 11, tier="l3") and not costs.pages_pay(10**6, 9, tier="l3")
    assert costs.pages_pay(10**6, 2, tier="l2") and not costs.pages_pay(10**6, 1, tier="l2")
    assert costs.pages_pay(10**9, 1, tier="remote")  # a tier of its own, not yet measured
    assert costs.restore_cost(10**6, tier="remote") is None


def test_a_remote_restore_changes_the_remote_tiers_rate_only() -> None:
    """Committing a restore served from L3 and the remote tier books it to the deepest tier
    that served (remote): L3's and L2's rates are untouched."""
    tokens = np.arange(300, dtype=np.int32)
    keys = page_keys(IDENTITY.root, tokens[:256], PAGE)
    l2 = FakePages("l2", holding(keys[:1]), takes_records=False)
    l3 = FakePages("l3", holding(keys[:1]))
    remote = FakeRemote("remote", holding(keys))
    cache = PrefixCache(
        identity=IDENTITY, page_tokens=PAGE, tiers=[l2, l3, remote], bytes_per_token=1000
    )
    costs = cache.costs
    costs.observe_restore(10**6, 0.001, tier="l2")
    costs.observe_restore(10**6, 0.010, tier="l3")
    before = dict(costs.restore_rates)
    prompt = Prompt(tokens, 298)
    plan = cache.plan(prompt)
    assert plan.tier == "remote" and plan.page_tiers == ("l2", "remote")
    fetched = cache.pages.fetch(plan.pages)
    assert len(fetched) == len(plan.pages)
    outcome = RestoreOutcome(
        plan, restored=True, restored_bytes=256_000, restore_s=2.56, fetched=tuple(fetched)
    )
    cache.commit(plan, outcome, prompt)
    assert costs.restore_rates == {**before, "remote": pytest.approx(1e-5)}
    # a restore wholly from L2 feeds L2's rate alone
    cache.commit(plan, RestoreOutcome(plan, True, 64_000, 0.128, tuple(fetched[:1])), prompt)
    assert costs.restore_rates["l2"] == pytest.approx(0.8 * 1e-9 + 0.2 * 2e-6)
    assert costs.restore_rates["l3"] == before["l3"]
    assert costs.restore_rates["remote"] == pytest.approx(1e-5)


def test_always_restore_says_yes_to_every_rule_but_still_measures() -> None:
    costs = AlwaysRestore()
    costs.observe_prefill(300, 0.010)
    costs.observe_checkpoint_restore(0.065)
    costs.observe_park(0.065)
    costs.observe_restore(10**9, 100.0, tier="l3")
    assert costs.checkpoint_pays(1) and costs.park_pays(1) and costs.pages_pay(10**9, 1, tier="l3")
    assert costs.prefill_seconds_per_token is not None


def test_an_unmeasured_tier_is_planned_at_the_probed_bus_rate() -> None:
    """Issue 45: with the bus probed, a tier not yet measured is estimated at the bus's rate,
    a floor: a restore the bus alone cannot make faster than the prefill is not tried."""
    costs = CostModel()
    costs.observe_bus(10**6, 0.001)  # 1 GB/s: 1 ns a byte
    assert costs.restore_cost(10**6, tier="l3") == pytest.approx(0.001)
    assert costs.pages_pay(10**9, 1, tier="l3")  # no prefill measured yet: restore
    costs.observe_prefill(1000, 1.0)  # 1 ms a token
    assert costs.pages_pay(10**6, 2, tier="l3")
    assert not costs.pages_pay(10**7, 9, tier="l3")  # 10 ms of bus for 9 ms of prefill
    assert costs.restore_rate("l3") is None  # the floor is no measurement of the tier


def test_a_first_slow_restore_does_not_make_the_tier_refused() -> None:
    """The bus's rate is the prior of a tier's average: a process's first restore, which
    alone pays one-time costs, moves it by alpha. Unprobed, that restore became the rate and
    the planner refused the tier from then on (issue 45: 1.61x a cold prefill on an H100)."""
    cold_s = 0.100  # 100 tokens at 1 ms
    first_s = 1.61 * cold_s
    unprobed, probed = CostModel(), CostModel()
    probed.observe_bus(10**6, 0.0005)
    for costs in (unprobed, probed):
        costs.observe_prefill(1000, 1.0)
        costs.observe_restore(10**6, first_s, tier="l3")
    assert not unprobed.pages_pay(10**6, 100, tier="l3")
    assert probed.pages_pay(10**6, 100, tier="l3")
    assert probed.restore_rate("l3") == pytest.approx(0.8 * 5e-10 + 0.2 * first_s / 10**6)
    # a tier really slower than the prefill is refused after a few restores all the same
    for _ in range(4):
        probed.observe_restore(10**6, first_s, tier="l3")
    assert not probed.pages_pay(10**6, 100, tier="l3")


def test_nonsense_bus_probes_teach_nothing() -> None:
    costs = CostModel()
    for n_bytes, seconds in ((0, 0.001), (10**6, 0.0), (10**6, -1.0), (10**6, float("nan"))):
        costs.observe_bus(n_bytes, seconds)
    assert costs.bus_seconds_per_byte is None
    assert costs.restore_cost(10**6, tier="l3") is None
    costs.observe_restore(10**6, 0.01, tier="l3")
    assert costs.restore_rate("l3") == pytest.approx(1e-8)  # the first sample, no prior


# -- the park rule weighs the reuse chance and what L3 already holds (issue 45 item 4)


def h100_fa_off() -> CostModel:
    """An H100 with flash attention off (issue 45): 2k tokens prefill in 160 ms, a park or
    a checkpoint restore of them copies the transposed V for 60-80 ms."""
    costs = CostModel()
    costs.observe_prefill(2048, 0.160)
    costs.observe_park(0.070)
    costs.observe_checkpoint_restore(0.062)
    return costs


def test_a_park_pays_only_as_often_as_prefixes_return() -> None:
    costs = h100_fa_off()
    # certain to return, the park (70 ms) buys a 160 ms prefill for a 62 ms restore
    assert costs.park_pays(2048)
    saving, cost = costs.park_gain(2048) or (0.0, 0.0)
    assert saving == pytest.approx(0.098) and cost == pytest.approx(0.070)
    # one-shot prompts: after a few departures that never returned it no longer pays
    assert not costs.park_pays(2048, reuse=0.5)
    assert costs.park_pays(2048, reuse=0.8)


def test_a_park_never_pays_for_a_prefix_l3_brings_back_faster_than_a_checkpoint() -> None:
    costs = h100_fa_off()
    costs.observe_restore(46 << 20, 0.020, tier="l3")  # 46 MB from L3 in 20 ms
    # the last record handed all but the reply's 16 tokens to L3: a return costs 20 ms of
    # pages and 1.25 ms of prefill, less than the checkpoint restore alone
    kept = {"recorded_tokens": 2032, "recorded_bytes": 46 << 20, "tier": "l3"}
    recall = costs.recall_cost(2048, **kept)  # type: ignore[arg-type]
    assert recall == pytest.approx(0.020 + 0.160 * 16 / 2048)
    assert not costs.park_pays(2048, **kept)  # type: ignore[arg-type]
    # a tier never measured is estimated at the probed bus's rate; nothing probed: prefill
    fresh = h100_fa_off()
    unknown = {"recorded_tokens": 2032, "recorded_bytes": 46 << 20, "tier": "l3"}
    assert fresh.recall_cost(2048, **unknown) == pytest.approx(0.160)  # type: ignore[arg-type]
    fresh.observe_bus(1 << 30, 0.020)  # 54 GB/s
    assert not fresh.park_pays(2048, **unknown)  # type: ignore[arg-type]


def test_on_the_cpu_a_park_is_cheap_insurance_and_stays() -> None:
    cpu = CostModel()
    cpu.observe_prefill(500, 2.2)  # SmolLM2 on two loaded cores: 230 tokens a second
    cpu.observe_park(0.010)
    cpu.observe_checkpoint_restore(0.005)
    # even a prefix that returns one time in ten repays a 10 ms park
    assert cpu.park_pays(500, reuse=0.1)
    assert not cpu.park_pays(500, reuse=0.001)
    assert AlwaysRestore().park_pays(1, reuse=0.0)
