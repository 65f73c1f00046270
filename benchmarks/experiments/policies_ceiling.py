"""How close can an online L3 policy get to the offline optimum on the skewed trace? (issue 15)

Two yardsticks that no store can run, beside ``reuse``, as fractions of ``optimal`` (saved
prefill seconds summed over seeds), on the skewed synthetic workload:

* ``counts``: knows which document each page belongs to and ranks documents by how often they
  were requested *so far* (exact counts, no aging, last use breaking ties, pages seen once
  below the rest): the best ranking that can be learned from the requests seen, with none of
  ``reuse``'s approximations (per-page counts, a sketch that halves, classes of 1.5x).
* ``a0``: ranks documents by their true Zipf probability from the first request on (Aho,
  Denning and Ullman's A0, optimal among online policies for independent requests of
  equal-size items): what a policy that had already learned everything would save.

``reuse`` at ``counts``'s level means the gap to ``a0`` is the cost of learning the ranks from
~300 requests, which no online policy avoids; the ``late`` columns leave the first third of the
requests out. ``--shape real`` runs the real-model shape of ``bench_policies.py`` (12 documents,
120 requests, seeds 0-9) at its 64 MiB floor instead. ~10 s, no model::

    .venv/bin/python benchmarks/experiments/policies_ceiling.py [--shape real]
"""

from __future__ import annotations

import argparse
import bisect
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# bench_policies.py is a maintained benchmark one folder up
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_policies import REAL_SHAPE

from skippy_llama.tiers.l3 import synthetic
from skippy_llama.tiers.l3.policies import ReusePolicy
from skippy_llama.tiers.l3.policy_api import PageStats, Policy
from skippy_llama.tiers.l3.simulate import OptimalPolicy, Simulator, trace_rates
from skippy_llama.tiers.l3.trace import LookupEvent, TraceEvent

MiB = 1 << 20
#: (shape, budgets in MiB, seed sets) per ``--shape``
SETUPS = {
    "synthetic": (synthetic.Shape(), (32, 64, 128, 256), ((0, 1, 2), tuple(range(3, 23)))),
    "real": (REAL_SHAPE, (64,), (tuple(range(10)),)),
}
#: a document's rank or count decides; the last use breaks ties within it
_BAND = 1e10


class A0:
    """Pages ranked by their document's true probability (0 for anything else)."""

    name = "a0"

    def __init__(self, pages: dict[str, tuple[int, float]]) -> None:
        self._pages = pages

    def admit(self, page: PageStats, now: float) -> bool:
        return True

    def priority(self, page: PageStats, now: float) -> float:
        _, probability = self._pages.get(page.key.decode(), (-1, 0.0))
        return probability * _BAND + page.last_used

    def evicted(self, page: PageStats, now: float) -> None:
        return None


class DocumentCounts:
    """Pages ranked by how often their document was requested up to ``now``."""

    name = "counts"

    def __init__(self, pages: dict[str, tuple[int, float]], events: Sequence[TraceEvent]) -> None:
        self._pages = pages
        self._requests: dict[int, list[int]] = {}
        for index, event in enumerate(events):
            if isinstance(event, LookupEvent) and event.keys and event.keys[0] in pages:
                self._requests.setdefault(pages[event.keys[0]][0], []).append(index)

    def admit(self, page: PageStats, now: float) -> bool:
        return True

    def priority(self, page: PageStats, now: float) -> float:
        document = self._pages.get(page.key.decode())
        if document is None:
            return -2 * _BAND + page.last_used
        seen = bisect.bisect_right(self._requests.get(document[0], []), now)
        return (seen if seen > 1 else -1) * _BAND + page.last_used

    def evicted(self, page: PageStats, now: float) -> None:
        return None


def saved_by_request(events: Sequence[TraceEvent], budget: int, policy: Policy) -> np.ndarray:
    """Cumulative saved prefill seconds after each lookup."""
    sim = Simulator(budget, policy, rates=trace_rates(events))
    out = []
    for event in events:
        sim.step(event)
        if isinstance(event, LookupEvent):
            out.append(sim.result().saved_s)
    return np.array(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SETUPS), default="synthetic")
    shape, budgets, seed_sets = SETUPS[parser.parse_args().shape]
    names = ("reuse", "counts", "a0")
    late_from = shape.requests // 3
    print(
        f"{shape.requests} requests of {shape.documents} documents; late = after request "
        f"{late_from}"
    )
    print("| seeds | budget | " + " | ".join(f"{n} / optimal (late)" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for seeds in seed_sets:
        traces = [synthetic.workload_events("skewed", shape, seed) for seed in seeds]
        pages = [synthetic.document_pages(shape, seed) for seed in seeds]
        for mib in budgets:
            budget = mib * MiB
            totals: dict[str, np.ndarray] = {}
            for events, doc_pages in zip(traces, pages, strict=True):
                runs: dict[str, Policy] = {
                    "optimal": OptimalPolicy(events),
                    "reuse": ReusePolicy(budget),
                    "counts": DocumentCounts(doc_pages, events),
                    "a0": A0(doc_pages),
                }
                for name, policy in runs.items():
                    curve = saved_by_request(events, budget, policy)
                    totals[name] = totals.get(name, 0) + curve
            best = totals["optimal"]
            cells = []
            for name in names:
                before = late_from - 1
                late = (totals[name][-1] - totals[name][before]) / (best[-1] - best[before])
                cells.append(f"{totals[name][-1] / best[-1]:.3f} ({late:.3f})")
            label = f"{seeds[0]}-{seeds[-1]}"
            print(f"| {label} | {mib} MiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
