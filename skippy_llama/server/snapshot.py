"""One read of the served model's cache tiers, shared by ``/metrics``, the status JSON and page.

The L3 status walks the store's manifests, so a snapshot is kept for a short while: a status
page polling every two seconds and a Prometheus scrape then cost one walk, not one each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from ..counters import CacheCounters
from ..runtime.llama import SkippyLlama
from ..tiers.records import DiskStatus, RamStatus
from ..tiers.resident import ResidentStatus

L3_STATES = ("off", "active", "read_only_low_space", "degraded")


@dataclass(frozen=True)
class ResidentSnapshot:
    """L1: prefixes resident in spare sequences of the live context."""

    enabled: bool
    prefixes: int = 0
    tokens: int = 0
    budget_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "prefixes": self.prefixes,
            "tokens": self.tokens,
            "budget_tokens": self.budget_tokens,
        }


@dataclass(frozen=True)
class TierSnapshot:
    """Every tier's size and this process's cache counters at ``taken_at``."""

    taken_at: float
    l1: ResidentSnapshot
    l2: RamStatus | None
    l3: DiskStatus | None
    #: this process's cache counters (``PrefixCache.counters_json``; see
    #: :mod:`skippy_llama.counters`), all zero when no model is loaded
    counters: dict[str, Any] = field(default_factory=lambda: asdict(CacheCounters()))
    #: the status (JSON) of every other tier, by name (the remote tier, registered tiers)
    others: dict[str, dict[str, Any]] = field(default_factory=dict)

    def counters_json(self) -> dict[str, Any]:
        """The cache counters, every one (a new counter shows without an edit here)."""
        return dict(self.counters)


T = TypeVar("T")


def _read(read: Callable[[], T], empty: T) -> T:
    """``read()``, retried: the request thread may change a dict while this thread walks it."""
    for _ in range(5):
        try:
            return read()
        except RuntimeError:  # dictionary changed size during iteration
            continue
    return empty


def take_snapshot(llm: SkippyLlama | None) -> TierSnapshot:
    """Read the tiers of ``llm`` (an empty snapshot when no model is loaded)."""
    now = time.time()
    if llm is None:
        return TierSnapshot(taken_at=now, l1=ResidentSnapshot(enabled=False), l2=None, l3=None)
    cache = llm.prefix_cache
    statuses = {tier.name: _read(tier.status, None) for tier in cache.tiers}
    resident = statuses.get("l1")
    l1 = (
        ResidentSnapshot(
            enabled=True,
            prefixes=resident.prefixes,
            tokens=resident.tokens,
            budget_tokens=resident.budget_tokens,
        )
        if isinstance(resident, ResidentStatus)
        else ResidentSnapshot(enabled=False)
    )
    l2, l3 = statuses.get("l2"), statuses.get("l3")
    return TierSnapshot(
        taken_at=now,
        l1=l1,
        l2=l2 if isinstance(l2, RamStatus) else None,
        l3=l3 if isinstance(l3, DiskStatus) else None,
        counters=cache.counters_json(),
        others={
            name: status.to_json()
            for name, status in statuses.items()
            if name not in ("l1", "l2", "l3") and status is not None
        },
    )


class SnapshotCache:
    """The latest :class:`TierSnapshot`, re-read when older than ``max_age_s``."""

    def __init__(self, model: Callable[[], SkippyLlama | None], max_age_s: float = 1.0) -> None:
        self._model = model
        self._max_age = max_age_s
        self._lock = threading.Lock()
        self._latest: TierSnapshot | None = None

    def get(self, *, fresh: bool = False) -> TierSnapshot:
        with self._lock:
            latest = self._latest
            if fresh or latest is None or time.time() - latest.taken_at > self._max_age:
                latest = self._latest = take_snapshot(self._model())
            return latest
