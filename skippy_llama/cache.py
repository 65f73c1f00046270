"""The orchestrator: longest-prefix lookup across tiers, restore plans, records, counters.

It decides *what* to reuse and never touches llama.cpp: the runtime carries out the plan
(``seq_cp`` for L1, ``set_data`` of an assembled blob for L2/L3) and reports back. Every deeper
tier is fail-open: a fault there is counted and the lookup falls back to a shallower answer.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .events import Tier
from .tiers.resident import ResidentIndex

Tokens = npt.NDArray[np.int32]


@dataclass(frozen=True)
class LookupResult:
    """The best reusable prefix of a prompt.

    ``tier`` says where it lives; ``n_tokens`` how many prompt tokens it covers; ``seq_id`` the
    resident sequence for L1; ``payloads`` the serialized pages (in order) for L2/L3.
    """

    tier: Tier
    n_tokens: int
    seq_id: int | None = None
    payloads: tuple[bytes | memoryview, ...] = ()
    lookup_s: float = 0.0


@dataclass
class CacheCounters:
    """In-process activity counters (hits per tier, misses, fallbacks with reasons)."""

    lookups: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    misses: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    parked: int = 0
    park_skipped: int = 0


class PrefixCache:
    """Lookup and bookkeeping across L1 (resident sequences) and the deeper tiers."""

    def __init__(self, *, root: bytes, page_tokens: int, resident: ResidentIndex | None) -> None:
        self.root = root
        self.page_tokens = page_tokens
        self.resident = resident
        self.counters = CacheCounters()

    def lookup(self, tokens: Tokens, limit: int, live: int) -> LookupResult:
        """Find the longest prefix of ``tokens[:limit]`` that beats the ``live`` sequence's match.

        ``limit`` is at most ``len(tokens) - 1``: the final prompt token is always decoded so that
        its logits are fresh.
        """
        started = time.perf_counter()
        self.counters.lookups += 1
        best = LookupResult("l1" if live > 0 else "cold", live)
        if self.resident is not None and limit > live:
            hit = self.resident.lookup(self.root, tokens, limit)
            if hit is not None and hit.n_tokens > best.n_tokens:
                best = LookupResult("l1", hit.n_tokens, seq_id=hit.seq_id)
        if best.n_tokens > 0:
            self.counters.hits[best.tier] += 1
        else:
            self.counters.misses += 1
        return LookupResult(
            best.tier, best.n_tokens, best.seq_id, best.payloads, time.perf_counter() - started
        )

    def fallback(self, reason: str) -> None:
        """Count a tier fault that was turned into a shallower hit or a cold prefill."""
        self.counters.fallbacks[reason] += 1
