"""The skewed synthetic trace at 300, 1,000 and 3,000 requests: ``reuse`` and an exact-count
variant as fractions of the offline optimum (seeds 0, 1, 2 summed), to separate learning from
ranking (issue 15). ~10 s, no model.

Usage::

    .venv/bin/python benchmarks/experiments/policies_longer.py
"""

from __future__ import annotations

import skippy_llama.tiers.l3.policies as policies
from skippy_llama.tiers.l3.simulate import simulate
from skippy_llama.tiers.l3.synthetic import Shape, workload_events

MiB = 1 << 20


def main() -> None:
    print("| requests | budget | reuse / optimal | exact counts, class base 1.1 / optimal |")
    print("|---|---|---|---|")
    defaults = policies.SKETCH_BUDGETS, policies.CLASS_BASE
    for requests in (300, 1000, 3000):
        traces = [workload_events("skewed", Shape(requests=requests), seed) for seed in (0, 1, 2)]
        for budget in (32, 64, 128, 256):
            best = sum(simulate(t, budget * MiB, "optimal").saved_s for t in traces)
            shares = []
            for sketch_budgets, class_base in (defaults, (10**9, 1.1)):
                policies.SKETCH_BUDGETS, policies.CLASS_BASE = sketch_budgets, class_base
                saved = sum(simulate(t, budget * MiB, "reuse").saved_s for t in traces)
                shares.append(saved / best)
            policies.SKETCH_BUDGETS, policies.CLASS_BASE = defaults
            print(f"| {requests} | {budget} MiB | {shares[0]:.3f} | {shares[1]:.3f} |")


if __name__ == "__main__":
    main()
