"""Admission into L3: benefit per exclusive byte, from costs measured on this machine.

Pure policy: no I/O, no clocks, no llama.cpp. The orchestrator feeds it measurements
(``observe_prefill`` after a cold prefill, ``observe_restore`` after a restore); the disk tier asks
it about each record in its background writer (``DiskTier(admission=...)``) because only the store
knows how many existing prefixes already share a record's pages.

    score = reuse_probability × max(cold_cost − restore_cost, 0) / exclusive_bytes

``exclusive_bytes`` charges shared pages fractionally: a page that k prefixes reference costs
``size / k`` to each. Until both costs have been measured the policy admits everything
(reference-aware LRU write-through: the store's LRU eviction and probation do the rest), and counts
those decisions as ``fallback``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from .costs import CostModel

__all__ = ["AdmissionDecision", "AdmissionPolicy", "CostModel", "exclusive_bytes"]


@dataclass(frozen=True)
class AdmissionDecision:
    """Whether to store a record, why, and its score (None when no score was computed)."""

    admit: bool
    reason: (
        str  # 'fallback_unmeasured' | 'score' | 'no_new_bytes' | 'no_benefit' | 'below_threshold'
    )
    score: float | None


@dataclass(frozen=True)
class AdmissionCounters:
    """How many records the policy admitted, rejected, and admitted by fallback."""

    admitted: int = 0
    rejected: int = 0
    fallback: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def exclusive_bytes(pages: Iterable[tuple[int, int]]) -> float:
    """Bytes a record is charged for: ``size / refcount`` summed over ``(size, refcount)`` pairs.

    ``refcount`` is the number of prefixes that would reference the page once this record is stored
    (so at least 1); a page shared by k prefixes costs each of them ``size / k``.
    """
    return sum(size / max(refs, 1) for size, refs in pages)


class AdmissionPolicy:
    """Decides L3 admission by benefit per exclusive byte (see the module docstring).

    Args:
        costs: the shared cost model (the orchestrator feeds it); a new one by default.
        tier: the name of the tier it admits into: a record's restore is priced by the rate
            of the restores that tier served (L3's, not the network's or RAM's).
        min_score: admit when ``score > min_score`` (seconds saved per byte, weighted by reuse).
            0 admits every record whose restore is expected to beat its prefill.
    """

    def __init__(
        self, costs: CostModel | None = None, *, tier: str = "l3", min_score: float = 0.0
    ) -> None:
        self.costs = costs if costs is not None else CostModel()
        self.tier = tier
        self.min_score = min_score
        self._recorded = 0
        self._reused = 0
        self._admitted = 0
        self._rejected = 0
        self._fallback = 0
        self._lock = threading.Lock()

    def observe_recorded(self) -> None:
        """A new prefix entered the store."""
        with self._lock:
            self._recorded += 1

    def observe_reused(self) -> None:
        """A stored prefix was hit for the first time."""
        with self._lock:
            self._reused += 1

    @property
    def reuse_probability(self) -> float:
        """Laplace estimate of P(a stored prefix is hit again): (reused + 1) / (recorded + 2)."""
        with self._lock:
            return min(1.0, (self._reused + 1) / (self._recorded + 2))

    def score(
        self, n_tokens: int, total_bytes: int, exclusive: float, reuse_probability: float
    ) -> float | None:
        """The admission score, ``math.inf`` for a record that adds no bytes, None if unmeasured."""
        cold = self.costs.cold_cost(n_tokens)
        restore = self.costs.restore_cost(total_bytes, tier=self.tier)
        if cold is None or restore is None:
            return None
        benefit = reuse_probability * max(cold - restore, 0.0)
        if exclusive <= 0:
            return math.inf if benefit > 0 else 0.0
        return benefit / exclusive

    def decide(
        self,
        n_tokens: int,
        total_bytes: int,
        exclusive: float,
        reuse_probability: float | None = None,
    ) -> AdmissionDecision:
        """Decide one record.

        Args:
            n_tokens: tokens the record covers (what a hit saves from prefilling).
            total_bytes: bytes a hit has to restore (every page, shared or not).
            exclusive: bytes charged to this record (see :func:`exclusive_bytes`).
            reuse_probability: override of the policy's running estimate.
        """
        p = self.reuse_probability if reuse_probability is None else reuse_probability
        value = self.score(n_tokens, total_bytes, exclusive, p)
        if value is None:
            decision = AdmissionDecision(True, "fallback_unmeasured", None)
        elif value == math.inf:
            decision = AdmissionDecision(True, "no_new_bytes", value)
        elif value <= 0.0 and (self.costs.cold_cost(n_tokens) or 0.0) <= (
            self.costs.restore_cost(total_bytes, tier=self.tier) or 0.0
        ):
            decision = AdmissionDecision(False, "no_benefit", value)
        elif value > self.min_score:
            decision = AdmissionDecision(True, "score", value)
        else:
            decision = AdmissionDecision(False, "below_threshold", value)
        with self._lock:
            if decision.reason == "fallback_unmeasured":
                self._fallback += 1
            if decision.admit:
                self._admitted += 1
            else:
                self._rejected += 1
        return decision

    @property
    def counters(self) -> AdmissionCounters:
        """Decisions so far (fallback admissions are included in ``admitted`` too)."""
        with self._lock:
            return AdmissionCounters(self._admitted, self._rejected, self._fallback)
