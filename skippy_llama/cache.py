"""The orchestrator: plans restores across the tiers, commits what served, records new pages.

It decides *what* to reuse and never touches llama.cpp. A request flows down and back once::

    tokens -> PrefixCache.plan() -> RestorePlan -> KV seam executes it (reading PrefixCache.pages)
           -> commit()

:meth:`PrefixCache.plan` asks the :class:`~skippy_llama.plan.Planner` (no side effects);
:attr:`PrefixCache.pages` is the page source the runtime's seam reads a plan's pages from;
:meth:`PrefixCache.commit` writes the counters, the trace and the promotions once, from what
actually served. The counters (:mod:`skippy_llama.counters`) are written only here, by
``commit`` and the ``count_*`` methods. Every deeper tier is fail-open: a fault is counted and
the request falls back to the next-shallower plan.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .costs import CostModel
from .counters import CacheCounters, is_hit
from .departures import Departures
from .identity import CacheIdentity, chain_key, token_bytes
from .page_source import TierPages
from .plan import Planner, Prompt, RestoreOutcome, RestorePlan
from .prefetch import Prefetcher, PrefetchResult, prefetch_target
from .state import SequenceState, slice_state, sort_by_position
from .tiers.base import (
    PageTier,
    ParkPlan,
    PathStep,
    ResidentTier,
    Tier,
    walk,
)
from .tiers.l3.tier import DiskTier
from .tiers.l3.trace import TraceWriter
from .tiers.ram import RamTier
from .tiers.records import PageBlob, PendingPayload, PrefixRecord
from .tiers.resident import ResidentIndex

Tokens = npt.NDArray[np.int32]


@dataclass(frozen=True)
class RecordPlan:
    """What recording a prefix adds: the stored pages it reuses and the spans of new ones.

    ``new`` holds ``(key, parent, start, end)`` of each page to cut from the captured state.
    """

    n_tokens: int
    reused: list[PathStep]
    new: list[tuple[bytes, bytes, int, int]]


class PrefixCache:
    """Plans, commits and records across an ordered list of tiers (cheapest first).

    Args:
        identity: the cache identity; every page key chains from its root.
        page_tokens: tokens per page.
        tiers: the tiers, cheapest first (``tiers.factory.build_tiers``).
        costs: the one cost model every gate asks (``costs.AlwaysRestore`` to restore always).
        bytes_per_token: state bytes per token (sizes the pages' restore cost).
        trace_file: the opt-in L3 trace for ``kv-cache simulate`` (None: off).
    """

    def __init__(
        self,
        *,
        identity: CacheIdentity,
        page_tokens: int,
        tiers: Sequence[Tier] = (),
        costs: CostModel | None = None,
        bytes_per_token: int = 0,
        trace_file: Any = None,
    ) -> None:
        self.identity = identity
        self.root = identity.root
        self.page_tokens = page_tokens
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self.costs = costs if costs is not None else CostModel()
        self.bytes_per_token = bytes_per_token
        self.planner = Planner(self.root, page_tokens, self.tiers, self.costs, bytes_per_token)
        #: what the runtime's KV seam reads a plan's pages from (and promotes them through)
        self.pages = TierPages(self.tiers)
        self._counters = CacheCounters()
        # the counters are written from the request thread and from prefetches on others
        self._count_lock = threading.Lock()
        #: the resident tier (L1), if any: parks and checkpoint restores go through it
        self._l1 = next((t for t in self.tiers if isinstance(t, ResidentTier)), None)
        self._prefetcher = Prefetcher(self.planner)
        #: prefixes that left the live sequence, for the park rule's reuse chance
        self.departures = Departures(page_tokens)
        # sorted once (the request path asks every time; a protocol isinstance is slow)
        self._page_tiers = tuple(t for t in self.tiers if isinstance(t, PageTier))
        self._record_tiers = tuple(t for t in self._page_tiers if t.takes_records)
        takes = self._record_tiers
        self.trace = TraceWriter.from_settings(trace_file, page_tokens) if takes else None
        if self.trace is not None:
            weakref.finalize(self, self.trace.close)

    # -- the tiers ------------------------------------------------------------------------

    def tier(self, name: str) -> Tier | None:
        """The tier called ``name`` (``l1``, ``l2``, ``l3``, ...), or None."""
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def resident(self) -> ResidentIndex | None:
        """L1, when it is the stock resident index (tests and tools)."""
        tier = self.tier("l1")
        return tier if isinstance(tier, ResidentIndex) else None

    @property
    def ram(self) -> RamTier | None:
        """L2, when present (tests and tools)."""
        tier = self.tier("l2")
        return tier if isinstance(tier, RamTier) else None

    @property
    def disk(self) -> DiskTier | None:
        """L3, when present (tests and tools)."""
        tier = self.tier("l3")
        return tier if isinstance(tier, DiskTier) else None

    @property
    def takes_records(self) -> bool:
        """Whether any tier takes the runtime's records (L3, a remote store ...)."""
        return bool(self._record_tiers)

    def _recorders(self) -> list[PageTier]:
        return [t for t in self._record_tiers if t.serving]

    @property
    def counters(self) -> CacheCounters:
        """The live counters, to read (they are written only by this class's methods)."""
        return self._counters

    def counters_json(self) -> dict[str, Any]:
        """A copy of the counters (``dataclasses.asdict``): what every status, page and metric
        shows, so that a new counter reaches them all."""
        with self._count_lock:
            return asdict(self._counters)

    def status(self) -> dict[str, dict[str, Any]]:
        """Each tier's status, by name, as JSON-ready dicts."""
        return {t.name: t.status().to_json() for t in self.tiers}

    def close(self) -> None:
        """Close every tier (pending L3 writes are flushed first, with a bounded wait)."""
        for tier in self.tiers:
            tier.close()

    # -- a request: plan, fetch, commit ------------------------------------------------------

    def plan(self, prompt: Prompt, *, exclude: frozenset[str] = frozenset()) -> RestorePlan:
        """The plan for ``prompt`` (no side effects; see :class:`~skippy_llama.plan.Planner`)."""
        return self.planner.plan(prompt, exclude=exclude)

    def commit(self, planned: RestorePlan, outcome: RestoreOutcome, prompt: Prompt) -> None:
        """Count, trace and promote what served the request (once, after the restore)."""
        with self._count_lock:
            counters = self._counters
            counters.lookups += 1
            if outcome.n_tokens <= 0:
                counters.misses += 1
            else:
                hit = is_hit(outcome.n_tokens, len(prompt.tokens))
                _bump(counters.hits if hit else counters.short_matches, outcome.tier)
            counters.restores_skipped += int(bool(planned.skipped))
            # the planner kept no park (park_plan counts the rest)
            counters.park_skipped += int(bool(planned.park_skipped))
            for fault in outcome.faults:
                _bump(counters.fallbacks, fault)
        if self._l1 is not None:
            # a park is worth as much as departed prefixes return (``departures.py``)
            seen = self.departures.observe(prompt.tokens, prompt.live)
            if seen.returned:
                self.costs.observe_return()
            if seen.departed:
                self.costs.observe_departure()
        for name in planned.searched:
            tier = next((t for t in self._page_tiers if t.name == name), None)
            if tier is not None:
                tier.note_miss()
        served = outcome.plan
        if served.seq_id is not None and self._l1 is not None:
            self._l1.touch(served.seq_id)
        if outcome.fetched:
            if not outcome.promoted:
                self.pages.promote(outcome.fetched, outcome.n_tokens)
            # booked to the deepest tier that served: its reads dominate the restore's time
            served_by = self._deepest(page.tier for page in outcome.fetched)
            self.costs.observe_restore(outcome.restored_bytes, outcome.restore_s, tier=served_by)
        elif served.seq_id is not None and outcome.restored:
            self.costs.observe_checkpoint_restore(outcome.restore_s)
        if self.trace is not None:
            self.trace.lookup(
                self.root, prompt.tokens, planned.limit, outcome.n_tokens, outcome.tier, self.costs
            )

    def _deepest(self, names: Iterable[str]) -> str:
        """Of tier ``names``, the one latest in the cache's order (the most expensive)."""
        order = {t.name: i for i, t in enumerate(self.tiers)}
        return max(names, key=lambda name: order.get(name, -1))

    @property
    def can_prefetch(self) -> bool:
        """Whether the cache has a tier :meth:`prefetch` fills (L2) and a page tier after it to
        read from (whether they serve now, each prefetch asks)."""
        return prefetch_target(list(self._page_tiers)) is not None

    def prefetch(
        self,
        tokens: Sequence[int] | Tokens,
        *,
        stop: Callable[[], bool] | None = None,
        skip: int = 0,
    ) -> PrefetchResult:
        """Copy the pages of ``tokens``' stored prefix that the prefetch tier (L2) lacks into
        it from the deeper page tiers (L3, remote), ahead of the request that will want them
        (see :mod:`skippy_llama.prefetch`).

        Safe on any thread beside a request: it touches neither llama.cpp nor L1. Never
        raises: a tier fault ends it as a counted miss (``prefetch_misses``). A no-op
        (``stopped == "off"``) without a tier to fill and one to read (:attr:`can_prefetch`).

        Args:
            tokens: the prompt's tokens, as the request will tokenize it.
            stop: asked before each read; once it returns True the prefetch ends there.
            skip: leading tokens the request will find elsewhere (a batch's next item shares
                them with the live sequence): pages wholly inside them are not read.
        """
        result = self._prefetcher(tokens, stop, skip)
        # prefetches may run on several threads (a batch's, the server's model thread)
        self.count_prefetch(result)
        return result

    def resident_tokens(self, prompt: Prompt) -> int:
        """Leading tokens of ``prompt`` the live sequence or L1 would serve now: the planner's
        answer without the page tiers (no side effects)."""
        pages = frozenset(t.name for t in self._page_tiers)
        return self.planner.plan(prompt, exclude=pages).n_tokens

    def fallback(self, reason: str) -> None:
        """Count a fault outside a restore (a record, a park) that was turned into nothing."""
        with self._count_lock:
            _bump(self._counters.fallbacks, reason)

    def count_prefetch(self, result: PrefetchResult) -> None:
        """Count a prefetch (any thread): the pages and bytes it copied, a miss or fault."""
        with self._count_lock:
            counters = self._counters
            counters.prefetches += 1
            counters.prefetched_pages += result.pages
            counters.prefetched_bytes += result.bytes
            counters.prefetch_misses += int(result.stopped in ("miss", "error"))

    def count_prepared(self, tokens: int) -> None:
        """Count a reply re-decoded between requests, ``tokens`` of it."""
        with self._count_lock:
            self._counters.turns_prepared += 1
            self._counters.tokens_prepared += tokens

    def count_parked_ahead(self) -> None:
        """Count a chat checkpointed in L1 between requests, ahead of its next turn (also
        counted in ``parked``, by :meth:`commit_park`)."""
        with self._count_lock:
            self._counters.parked_ahead += 1

    def count_deferred(self) -> None:
        """Count a record left for a later turn (``SkippyLlama.defer_record_tokens``)."""
        with self._count_lock:
            self._counters.records_deferred += 1

    # -- L1 parking ----------------------------------------------------------------------

    def park_plan(self, tokens: Tokens) -> ParkPlan | None:
        """Where to checkpoint ``tokens`` in L1, or None when it would not pay or fit (counted
        in ``park_skipped``). The runtime then checkpoints and calls :meth:`commit_park`, or
        :meth:`abandon_park` when the checkpoint failed."""
        resident = self._l1
        if resident is None or len(tokens) == 0:
            return None
        pays = self.costs.park_pays(len(tokens))
        plan = resident.plan_park(self.root, tokens) if pays else None
        if plan is None:
            with self._count_lock:
                self._counters.park_skipped += 1
        return plan

    def commit_park(self, plan: ParkPlan, tokens: Tokens, handle: bytes, seconds: float) -> None:
        """``plan`` was carried out in ``seconds``: ``tokens[:plan.n_tokens]`` are resident,
        restored by ``handle``; the park's time feeds the cost model."""
        assert self._l1 is not None
        self._l1.commit_park(plan, self.root, tokens, handle)
        self.costs.observe_park(seconds)
        with self._count_lock:
            self._counters.parked += 1

    def abandon_park(self, plan: ParkPlan) -> None:
        """``plan`` failed part way: L1 forgets the slots it touched."""
        if self._l1 is not None:
            self._l1.abandon_park(plan)

    # -- recording ------------------------------------------------------------------------

    def plan_record(self, tokens: Tokens, point: int) -> RecordPlan | None:
        """What recording ``tokens[:point]`` would add; None when it is all stored.

        The new pages continue the stored path (in the tiers that take records) where it ends,
        possibly at a branch point inside a stored page, cut at multiples of ``page_tokens``,
        so nothing stored is stored again.
        """
        recorders = self._recorders()
        if not recorders or point <= 0:
            return None
        if self.trace is not None:
            self.trace.record(self.root, tokens, point)
        # queued pages count: the previous request's record may still wait for the writer
        path = walk(recorders, self.root, tokens, point, self.page_tokens, queued=True)
        if path.n_tokens >= point:
            with self._count_lock:
                self._counters.records_skipped += 1
            return None
        p = self.page_tokens
        new = []
        parent, pos = path.end, path.n_tokens
        while pos < point:
            end = min(pos + p - pos % p, point)
            key = chain_key(parent, tokens[pos:end])
            new.append((key, parent, pos, end))
            parent, pos = key, end
        return RecordPlan(point, list(path.steps), new)

    def record(
        self,
        plan: RecordPlan,
        state: SequenceState,
        tokens: Tokens,
        release: Callable[[], None] | None = None,
    ) -> bool:
        """Offer ``plan``'s record to every tier that takes records; True when one took it.

        Its new pages are cut out of ``state`` by the tiers (L3's writer, off the request
        path), not here: at 32k tokens of a 1B model that is 720 MB of copies the request no
        longer waits for. ``state``'s bytes must stay untouched until ``release`` is called
        (once every tier has let go of the record, or at once when none takes it).
        """
        state = sort_by_position(state)  # once, not once per page
        payloads = []
        for _, _, start, end in plan.new:
            page = slice_state(state, start, end)  # views into the capture
            payloads.append(PendingPayload(page.nbytes, page.to_bytes))
        return self.record_payloads(plan, payloads, tokens, release)

    def record_payloads(
        self,
        plan: RecordPlan,
        payloads: Sequence[PendingPayload],
        tokens: Tokens,
        release: Callable[[], None] | None = None,
    ) -> bool:
        """:meth:`record` with the new pages' bytes still to be made, one per ``plan.new``
        (the runtime's export into arena slots makes them once its copies ended); the bytes
        they are made from stay untouched until ``release`` is called."""
        if len(payloads) != len(plan.new):
            raise ValueError(f"{len(payloads)} payloads for {len(plan.new)} new pages")
        recorders = self._recorders()
        done = _Countdown(len(recorders), release)
        if not recorders:
            done()
            return False
        try:
            records = [self._new_record(plan, payloads, tokens, done) for _ in recorders]
        except BaseException:
            for _ in recorders:
                done()
            raise
        # a record a tier does not take, it drops (releases)
        taken = sum(tier.offer(record) for tier, record in zip(recorders, records, strict=True))
        with self._count_lock:
            self._counters.records += int(taken > 0)
        return taken > 0

    def _new_record(
        self,
        plan: RecordPlan,
        payloads: Sequence[PendingPayload],
        tokens: Tokens,
        release: Callable[[], None] | None,
    ) -> PrefixRecord:
        pages = [
            PageBlob(step.key, step.parent, step.n_tokens, b"", None, step.used)
            for step in plan.reused
        ]
        for (key, parent, start, end), payload in zip(plan.new, payloads, strict=True):
            pages.append(
                PageBlob(
                    key, parent, end - start, token_bytes(tokens[start:end]), payload, end - start
                )
            )
        if self.trace is not None:
            new_bytes = sum(len(p.payload or b"") for p in pages)
            self.trace.learn_payloads(new_bytes, sum(end - start for _, _, start, end in plan.new))
        return PrefixRecord(
            cache_identity=self.identity.hex,
            model_identity=self.identity.model.id,
            model_name=self.identity.model.name,
            n_tokens=plan.n_tokens,
            pages=tuple(pages),
            release=release,
        )


def _bump(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


class _Countdown:
    """Calls ``release`` once, at the ``n``-th call (every recipient let go of a record);
    recipients release from their own threads."""

    def __init__(self, n: int, release: Callable[[], None] | None) -> None:
        self._left = max(n, 1)
        self._release = release
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self._left -= 1
            fire = self._left == 0
        if fire and self._release is not None:
            self._release()
