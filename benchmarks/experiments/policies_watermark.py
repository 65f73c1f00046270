"""A probe for issue 15: what the eviction pass's low watermark costs, and a softer rule.

Today an eviction pass, once the store is over its budget, evicts down to ``LOW_WATERMARK``
(85 %) whatever it takes. The softer rule probed here evicts pages *on probation* down to 85 %
but stops at ``--keep`` (95 %) of the budget once the next page to go is one worth keeping:
for ``reuse`` a page used more than once, for ``optimal`` one used again, for ``lru`` every
page (so LRU just evicts to ``--keep``). Each policy is replayed on the synthetic traces under
both rules; "same rules" ratios compare ``reuse`` with the optimum and LRU playing by the same
rule. Not adopted (see benchmarks/experiments/NOTEBOOK.md); no model, ~20 s.

Usage::

    .venv/bin/python benchmarks/experiments/policies_watermark.py [--keep 0.95]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from skippy_llama.tiers.l3.policies import ReusePolicy
from skippy_llama.tiers.l3.policy_api import Policy, chain_lengths
from skippy_llama.tiers.l3.simulate import Simulator, policy_for, trace_rates
from skippy_llama.tiers.l3.synthetic import workload_events

MiB = 1 << 20
#: per policy, which priorities mark a page the soft rule may evict below ``--keep``
EXPENDABLE: dict[str, Callable[[float], bool]] = {
    "reuse": lambda priority: priority <= 0.0,  # the first-sighting class
    "optimal": lambda priority: priority == -math.inf,  # never used again
    "lru": lambda priority: False,
}


class SoftSimulator(Simulator):
    """The simulator with the soft rule in its eviction pass."""

    def __init__(
        self,
        budget: int,
        policy: Policy,
        rates: tuple[float, float],
        *,
        keep: float,
        expendable: Callable[[float], bool],
    ) -> None:
        super().__init__(budget, policy, rates=rates)
        self.keep, self.expendable = keep, expendable

    def _evict_to(self, target: int) -> None:
        chains = chain_lengths({p.key: (p.parent, p.depth) for p in self.pages.values()})
        priority = {
            p.key: self.policy.priority(self._stats(p, chains[p.key]), self.now)
            for p in self.pages.values()
        }
        for page in sorted(self.pages.values(), key=lambda p: (priority[p.key], -p.depth, p.key)):
            if self.used <= target:
                break
            if self.used <= self.budget * self.keep and not self.expendable(priority[page.key]):
                break
            if page.key in self.pages:
                self._remove_subtree(page)


def saved(workload: str, seeds: range, budget: int, name: str, keep: float | None) -> float:
    total = 0.0
    for seed in seeds:
        events = workload_events(workload, seed=seed)
        policy: Policy = (
            ReusePolicy(budget) if name == "reuse" else policy_for(name, budget, events)
        )
        rates = trace_rates(events)
        if keep is None:
            sim = Simulator(budget, policy, rates=rates)
        else:
            sim = SoftSimulator(budget, policy, rates, keep=keep, expendable=EXPENDABLE[name])
        for event in events:
            sim.step(event)
        total += sim.result().saved_s
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=float, default=0.95)
    args = parser.parse_args()
    print(
        "| workload | seeds | budget | reuse soft ÷ hard | lru soft ÷ hard | reuse ÷ optimal, "
        "hard | reuse ÷ optimal, soft (same rules) | reuse ÷ lru, soft |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for workload in ("skewed", "uniform"):
        for seeds in (range(3), range(3, 23)):
            for mib in (32, 64, 128, 256):
                budget = mib * MiB
                got = {
                    (name, keep): saved(workload, seeds, budget, name, keep)
                    for name in ("reuse", "lru", "optimal")
                    for keep in (None, args.keep)
                }
                hard, soft = None, args.keep
                label = f"{seeds.start}-{seeds.stop - 1}"
                print(
                    f"| {workload} | {label} | {mib} MiB "
                    f"| {got['reuse', soft] / got['reuse', hard]:.3f} "
                    f"| {got['lru', soft] / got['lru', hard]:.3f} "
                    f"| {got['reuse', hard] / got['optimal', hard]:.3f} "
                    f"| {got['reuse', soft] / got['optimal', soft]:.3f} "
                    f"| {got['reuse', soft] / got['lru', soft]:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
