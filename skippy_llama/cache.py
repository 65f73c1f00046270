"""The orchestrator: longest-prefix lookup across tiers, restore plans, records, counters.

It decides *what* to reuse and never touches llama.cpp: the runtime carries out the plan (a KV
stream copy for L1, ``set_data`` of an assembled blob for L2/L3) and reports back. Every deeper
tier is fail-open: a fault there is counted and the lookup falls back to a shallower answer.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .admission import AdmissionPolicy
from .events import Tier
from .identity import CacheIdentity, chain_key
from .state import SequenceState, cut_pages, slice_state
from .tiers.disk import DiskTier
from .tiers.ram import RamTier
from .tiers.records import PageBlob, PrefixRecord
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
    payloads: tuple[bytes, ...] = ()
    lookup_s: float = 0.0
    fallbacks: tuple[str, ...] = ()


@dataclass
class CacheCounters:
    """In-process activity counters (hits per tier, misses, fallbacks with reasons)."""

    lookups: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    misses: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    parked: int = 0
    park_skipped: int = 0
    records: int = 0
    records_skipped: int = 0


@dataclass(frozen=True)
class _Chain:
    keys: list[bytes]
    lengths: list[int]

    @property
    def n_tokens(self) -> int:
        return sum(self.lengths)


class PrefixCache:
    """Lookup and bookkeeping across L1 (resident sequences), L2 (RAM) and L3 (disk)."""

    def __init__(
        self,
        *,
        identity: CacheIdentity,
        page_tokens: int,
        resident: ResidentIndex | None,
        ram: RamTier | None = None,
        disk: DiskTier | None = None,
        admission: AdmissionPolicy | None = None,
    ) -> None:
        self.identity = identity
        self.root = identity.root
        self.page_tokens = page_tokens
        self.resident = resident
        self.ram = ram
        self.disk = disk
        self.admission = admission
        self.counters = CacheCounters()
        if ram is not None and disk is not None:
            disk.add_removal_listener(ram.invalidate)

    def lookup(self, tokens: Tokens, limit: int, live: int) -> LookupResult:
        """Find the longest prefix of ``tokens[:limit]`` that beats the ``live`` sequence's match.

        ``limit`` is below ``len(tokens)``: the runtime always decodes the last prompt tokens so
        that their logits are fresh and computed as a cold prefill would. L2/L3 are consulted only when they could beat L1.
        """
        started = time.perf_counter()
        self.counters.lookups += 1
        best = LookupResult("l1" if live > 0 else "cold", live)
        if limit > live:
            resident = self.lookup_resident(tokens, limit)
            if resident.n_tokens > best.n_tokens:
                best = resident
        notes: tuple[str, ...] = ()
        if self.disk is not None and self.disk.serving and limit - best.n_tokens >= 1:
            deep = self._deep_lookup(tokens, limit, best.n_tokens)
            if deep is not None and deep.n_tokens > best.n_tokens:
                best = deep
            notes = deep.fallbacks if deep is not None else ()
        if best.n_tokens > 0:
            self.counters.hits[best.tier] += 1
        else:
            self.counters.misses += 1
        return LookupResult(
            best.tier,
            best.n_tokens,
            best.seq_id,
            best.payloads,
            time.perf_counter() - started,
            notes,
        )

    def lookup_resident(self, tokens: Tokens, limit: int) -> LookupResult:
        """L1 alone: the longest resident prefix, or cold (also the fallback after L2/L3 fail)."""
        hit = self.resident.lookup(self.root, tokens, limit) if self.resident is not None else None
        if hit is None:
            return LookupResult("cold", 0)
        return LookupResult("l1", hit.n_tokens, seq_id=hit.seq_id)

    def _walk(self, tokens: Tokens, limit: int) -> _Chain:
        """Walk the page-key chain through L2/L3 metadata, then the exact tails (no payloads)."""
        assert self.disk is not None
        p = self.page_tokens
        keys: list[bytes] = []
        lengths: list[int] = []
        parent, matched = self.root, 0
        while matched + p <= limit:
            key = chain_key(parent, tokens[matched : matched + p])
            if not ((self.ram is not None and key in self.ram) or self.disk.contains(key)):
                break
            keys.append(key)
            lengths.append(p)
            parent, matched = key, matched + p
        for n, tail_key in self.disk.tails(parent):
            if (
                n <= limit - matched
                and chain_key(parent, tokens[matched : matched + n]) == tail_key
            ):
                keys.append(tail_key)
                lengths.append(n)
                break
        return _Chain(keys, lengths)

    def _deep_lookup(self, tokens: Tokens, limit: int, floor: int) -> LookupResult | None:
        assert self.disk is not None
        chain = self._walk(tokens, limit)
        if chain.n_tokens <= floor:
            if not chain.keys:
                self.disk.note_miss()
            return None
        payloads: list[bytes] = []
        from_ram = 0
        if self.ram is not None:
            for key in chain.keys:
                page = self.ram.get(key, self.disk.digest(key))
                if page is None:
                    break
                payloads.append(page)
            from_ram = len(payloads)
        if from_ram < len(chain.keys):
            payloads.extend(self.disk.read(chain.keys[from_ram:]))
        n_tokens = sum(chain.lengths[: len(payloads)])
        notes: tuple[str, ...] = ()
        if len(payloads) < len(chain.keys):
            self.fallback("l3_short_read")
            notes = (
                f"l3: served {n_tokens} of {chain.n_tokens} tokens; a page was missing or "
                "failed verification",
            )
        if n_tokens <= floor:
            return LookupResult("cold", 0, fallbacks=notes) if notes else None
        if self.ram is not None:
            for key, page in zip(
                chain.keys[from_ram : len(payloads)], payloads[from_ram:], strict=True
            ):
                digest = self.disk.digest(key)
                if digest is not None:
                    self.ram.offer(key, page, digest, prefix_tokens=n_tokens)
        tier: Tier = "l2" if from_ram == len(payloads) else "l3"
        return LookupResult(tier, n_tokens, payloads=tuple(payloads), fallbacks=notes)

    def fallback(self, reason: str) -> None:
        """Count a tier fault that was turned into a shallower hit or a cold prefill."""
        self.counters.fallbacks[reason] += 1

    # -- recording into L3 ----------------------------------------------------------------

    def _chain_for(self, tokens: Tokens, point: int) -> list[tuple[bytes, bytes, int, int]]:
        """(key, parent, start, n_tokens) of the full pages and exact tail covering [0, point)."""
        p = self.page_tokens
        out = []
        parent = self.root
        for start in range(0, point, p):
            n = min(p, point - start)
            key = chain_key(parent, tokens[start : start + n])
            out.append((key, parent, start, n))
            parent = key
        return out

    def wants_record(self, tokens: Tokens, points: Sequence[int]) -> bool:
        """True when L3 lacks a page of some recorded prefix, so a state capture is worth it."""
        if self.disk is None or not self.disk.serving:
            return False
        for point in points:
            if point <= 0:
                continue
            for key, _, _, _ in self._chain_for(tokens, point):
                if not self.disk.contains(key):
                    return True
        self.counters.records_skipped += 1
        return False

    def record(self, state: SequenceState, tokens: Tokens, points: Sequence[int]) -> int:
        """Cut ``state`` into pages and queue one record per prefix length in ``points``.

        Returns the records queued. Pages shared between the records are serialized once.
        """
        if self.disk is None:
            return 0
        pages = {page.start: page for page in cut_pages(state, self.page_tokens, keep_tail=False)}
        serialized: dict[bytes, bytes] = {}
        queued = 0
        for point in sorted(set(points)):
            if point <= 0 or point > state.n_tokens:
                continue
            blobs = []
            for key, parent, start, n in self._chain_for(tokens, point):
                payload = serialized.get(key)
                if payload is None:
                    page = pages.get(start) if n == self.page_tokens else None
                    if page is None:
                        page = slice_state(state, start, start + n)
                    payload = serialized[key] = page.to_bytes()
                blobs.append(PageBlob(key, parent, n, n < self.page_tokens, payload))
            record = PrefixRecord(
                cache_identity=self.identity.hex,
                model_identity=self.identity.model.id,
                model_name=self.identity.model.name,
                n_tokens=point,
                pages=tuple(blobs),
            )
            if self.disk.record(record):
                queued += 1
        self.counters.records += queued
        return queued
