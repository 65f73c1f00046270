"""The orchestrator: longest-prefix lookup across tiers, restore plans, records, counters.

It decides *what* to reuse and never touches llama.cpp: the runtime carries out the plan (a KV
stream copy for L1, ``set_data`` of an assembled blob for L2/L3) and reports back. Every deeper
tier is fail-open: a fault there is counted and the lookup falls back to a shallower answer.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .admission import AdmissionPolicy
from .events import Tier
from .identity import CacheIdentity, chain_key, token_bytes
from .state import SequenceState, slice_state, sort_by_position
from .tiers.disk import DiskTier
from .tiers.l3.trace import TraceWriter
from .tiers.ram import RamTier
from .tiers.records import PageBlob, PendingPayload, PrefixRecord
from .tiers.resident import ResidentIndex, common_prefix

Tokens = npt.NDArray[np.int32]


@dataclass(frozen=True)
class LookupResult:
    """The best reusable prefix of a prompt.

    ``tier`` says where it lives; ``n_tokens`` how many prompt tokens it covers; ``seq_id`` the
    resident sequence for L1; ``payloads`` the serialized pages (in order) for L2/L3, of which
    the first ``uses[i]`` tokens each are restored (a page is used partly at a branch point).
    A page L3 read uncompressed is a view into the reading thread's buffer: restore it before
    that thread's next lookup.

    An *append plan* (``base_tokens > 0``, only where the runtime can append-import) continues
    an L1 prefix with L2/L3 pages: the first ``base_tokens`` come from the live sequence
    (``base_seq_id`` None) or the resident checkpoint ``base_seq_id``, and the payloads are only
    the pages reaching past them, whose cells before ``base_tokens`` are skipped.
    """

    tier: Tier
    n_tokens: int
    seq_id: int | None = None
    payloads: tuple[bytes | memoryview, ...] = ()
    uses: tuple[int, ...] = ()
    lookup_s: float = 0.0
    fallbacks: tuple[str, ...] = ()
    base_tokens: int = 0
    base_seq_id: int | None = None

    @property
    def appended_tokens(self) -> int:
        """Tokens an append plan takes from L2/L3 pages (0 for other plans)."""
        return self.n_tokens - self.base_tokens if self.base_tokens else 0

    def truncated(self, n: int) -> LookupResult:
        """The same plan cut to its first ``n`` tokens (cold when nothing is left)."""
        if n >= self.n_tokens:
            return self
        if n <= 0:
            return LookupResult("cold", 0, lookup_s=self.lookup_s, fallbacks=self.fallbacks)
        if self.base_tokens and n <= self.base_tokens:
            # nothing left to append: the L1 part alone
            return LookupResult(
                "l1", n, seq_id=self.base_seq_id, lookup_s=self.lookup_s, fallbacks=self.fallbacks
            )
        payloads: list[bytes | memoryview] = []
        uses: list[int] = []
        # payload tokens are counted from position 0, the skipped part included
        left = n - self.base_tokens + self._skipped()
        for payload, use in zip(self.payloads, self.uses, strict=True):
            if left == 0:
                break
            payloads.append(payload)
            uses.append(min(use, left))
            left -= uses[-1]
        return dataclasses.replace(self, n_tokens=n, payloads=tuple(payloads), uses=tuple(uses))

    def _skipped(self) -> int:
        """Tokens of an append plan's first page that lie below ``base_tokens``."""
        return sum(self.uses) - self.appended_tokens if self.base_tokens else 0


@dataclass
class CacheCounters:
    """In-process activity counters (hits per tier, misses, fallbacks with reasons)."""

    lookups: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    misses: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    parked: int = 0
    #: of ``parked``, chats checkpointed between requests (``SkippyLlama.prepare_next_turn``)
    parked_ahead: int = 0
    park_skipped: int = 0
    records: int = 0
    records_skipped: int = 0
    #: L3 records left for later (``SkippyLlama.defer_record_tokens``), counted at each turn
    records_deferred: int = 0
    #: L2/L3 hits served cold because the measured costs said the restore would be slower
    restores_skipped: int = 0
    #: replies re-decoded between requests (``SkippyLlama.prepare_next_turn``) and their tokens
    turns_prepared: int = 0
    tokens_prepared: int = 0


@dataclass(frozen=True)
class _Step:
    """One stored page on a prompt's path through the page tree, of which ``used`` tokens match."""

    key: bytes
    parent: bytes
    n_tokens: int
    used: int


@dataclass(frozen=True)
class _Path:
    steps: list[_Step]
    #: key of the node the path ends at (the parent of a page that would continue it)
    end: bytes

    @property
    def n_tokens(self) -> int:
        return sum(step.used for step in self.steps)


@dataclass(frozen=True)
class RecordPlan:
    """What recording a prefix adds to L3: the stored pages it reuses and the spans of new ones.

    ``new`` holds ``(key, parent, start, end)`` of each page to cut from the captured state.
    """

    n_tokens: int
    reused: list[_Step]
    new: list[tuple[bytes, bytes, int, int]]


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
        bytes_per_token: int = 0,
    ) -> None:
        self.identity = identity
        self.bytes_per_token = bytes_per_token
        self.root = identity.root
        self.page_tokens = page_tokens
        self.resident = resident
        self.ram = ram
        self.disk = disk
        self.admission = admission
        self.counters = CacheCounters()
        # the opt-in L3 trace (l3.trace_file or SKIPPY_TRACE) for `kv-cache simulate`
        self.trace = (
            TraceWriter.from_settings(disk.settings.trace_file, page_tokens) if disk else None
        )
        if self.trace is not None:
            weakref.finalize(self, self.trace.close)
        if ram is not None and disk is not None:
            disk.add_removal_listener(ram.invalidate)

    def lookup(
        self, tokens: Tokens, limit: int, live: int, *, append: bool = False, granule: int = 1
    ) -> LookupResult:
        """Find the longest prefix of ``tokens[:limit]`` that beats the ``live`` sequence's match.

        ``limit`` is below ``len(tokens)``: the runtime always decodes the last prompt tokens so
        that their logits are fresh and computed as a cold prefill would. L2/L3 are consulted
        only when they could beat L1. With ``append`` (the runtime can append-import) a deeper
        hit keeps the L1 prefix and reads only the pages beyond it (an append plan).

        The result is a multiple of ``granule`` tokens (the runtime's canonical batch boundary,
        see ``SkippyLlama.granule``; ``live`` already is one): what the hit counters and the
        trace see is what the runtime can serve, and no page is read only to be cut off.
        """
        started = time.perf_counter()
        self.counters.lookups += 1
        limit -= limit % granule
        best = LookupResult("l1" if live > 0 else "cold", live)
        if limit > live:
            resident = self.lookup_resident(tokens, limit)
            if resident.n_tokens > best.n_tokens:
                best = resident
        notes: tuple[str, ...] = ()
        if self.disk is not None and self.disk.serving and limit - best.n_tokens >= 1:
            base = best if append and best.n_tokens > 0 else None
            deep = self._deep_lookup(tokens, limit, best.n_tokens, base, granule)
            if deep is not None and deep.n_tokens > best.n_tokens:
                best = deep
            notes = deep.fallbacks if deep is not None else ()
        best = best.truncated(best.n_tokens - best.n_tokens % granule)
        if self.trace is not None:
            costs = self.admission.costs if self.admission is not None else None
            self.trace.lookup(self.root, tokens, limit, best.n_tokens, best.tier, costs)
        if best.n_tokens > 0:
            self.counters.hits[best.tier] += 1
        else:
            self.counters.misses += 1
        return dataclasses.replace(best, lookup_s=time.perf_counter() - started, fallbacks=notes)

    def lookup_resident(self, tokens: Tokens, limit: int) -> LookupResult:
        """L1 alone: the longest resident prefix, or cold (also the fallback after L2/L3 fail)."""
        hit = self.resident.lookup(self.root, tokens, limit) if self.resident is not None else None
        if hit is None:
            return LookupResult("cold", 0)
        return LookupResult("l1", hit.n_tokens, seq_id=hit.seq_id)

    def _walk(self, tokens: Tokens, limit: int, *, queued: bool = False) -> _Path:
        """The longest path of stored pages (L2/L3 metadata, no payloads) matching ``tokens``.

        Each step first tries the page a record would have cut at this position (one key test);
        otherwise it compares the prompt with the tokens of the pages stored after this node and
        takes the longest match, possibly a prefix of a page: a prompt that branches off inside a
        page still reuses the tokens before the branch, and continues below that branch point.
        ``queued`` also walks pages still waiting for the L3 writer (for planning records).
        """
        assert self.disk is not None
        p = self.page_tokens
        steps: list[_Step] = []
        parent, pos = self.root, 0
        while pos < limit:
            n = p - pos % p
            if pos + n <= limit:
                key = chain_key(parent, tokens[pos : pos + n])
                if (self.ram is not None and key in self.ram) or self.disk.contains(
                    key, queued=queued
                ):
                    steps.append(_Step(key, parent, n, n))
                    parent, pos = key, pos + n
                    continue
            best: _Step | None = None
            rest = tokens[pos:limit]
            for key, raw in self.disk.children(parent, queued=queued):
                child = np.frombuffer(raw, dtype="<i4")
                m = common_prefix(child, rest)
                if m > 0 and (best is None or m > best.used):
                    best = _Step(key, parent, len(child), m)
            if best is None:
                break
            steps.append(best)
            end = best.key if best.used == best.n_tokens else chain_key(parent, rest[: best.used])
            parent, pos = end, pos + best.used
        return _Path(steps, parent)

    def _deep_lookup(
        self,
        tokens: Tokens,
        limit: int,
        floor: int,
        base: LookupResult | None = None,
        granule: int = 1,
    ) -> LookupResult | None:
        """L2/L3 pages of the longest stored path, if it beats ``floor`` tokens by a granule.

        With ``base`` (an L1 hit of ``floor`` tokens the runtime can continue by append import)
        only the pages reaching past ``floor`` are read, and the result is an append plan.
        """
        assert self.disk is not None
        path = self._walk(tokens, limit)
        usable = path.n_tokens - path.n_tokens % granule
        if usable <= floor:
            if not path.steps:
                self.disk.note_miss()
            return None
        in_ram = self.ram is not None and all(step.key in self.ram for step in path.steps)
        if not self._restore_pays(usable, floor, appended=base is not None, ram=in_ram):
            self.counters.restores_skipped += 1
            return None
        steps = path.steps
        skipped = 0
        if base is not None:
            # drop the pages that lie wholly inside the L1 prefix: they are never read
            while steps and skipped + steps[0].used <= floor:
                skipped += steps[0].used
                steps = steps[1:]
        keys = [step.key for step in steps]
        disk = self.disk
        digests: dict[bytes, bytes | None] = {}

        def digest(key: bytes) -> bytes | None:
            if key not in digests:
                digests[key] = disk.digest(key)
            return digests[key]

        payloads: list[bytes | memoryview] = []
        from_ram = 0
        if self.ram is not None:
            for key in keys:
                page = self.ram.get(key, digest(key))
                if page is None:
                    break
                payloads.append(page)
            from_ram = len(payloads)
        if from_ram < len(keys):
            payloads.extend(self.disk.read(keys[from_ram:]))
        uses = tuple(step.used for step in steps[: len(payloads)])
        n_tokens = skipped + sum(uses)
        notes: tuple[str, ...] = ()
        if len(payloads) < len(keys):
            self.fallback("l3_short_read")
            notes = (
                f"l3: served {n_tokens} of {path.n_tokens} tokens; a page was missing or "
                "failed verification",
            )
        if n_tokens <= floor:
            return LookupResult("cold", 0, fallbacks=notes) if notes else None
        if self.ram is not None:
            fills = zip(keys[from_ram : len(payloads)], payloads[from_ram:], strict=True)
            for key, payload in fills:
                stored = digest(key)
                if stored is not None:
                    self.ram.offer(key, payload, stored, prefix_tokens=n_tokens)
        tier: Tier = "l2" if from_ram == len(payloads) else "l3"
        result = LookupResult(tier, n_tokens, payloads=tuple(payloads), uses=uses, fallbacks=notes)
        if base is not None:
            result = dataclasses.replace(
                result, base_tokens=floor, base_seq_id=base.seq_id if base.tier == "l1" else None
            )
        return result

    def _restore_pays(
        self, n_tokens: int, floor: int, *, appended: bool = False, ram: bool = False
    ) -> bool:
        """Whether restoring ``n_tokens`` from L2/L3 beats prefilling the ``n_tokens - floor``
        it saves, by this machine's measured costs (a restore rebuilds the whole prefix, an
        append only the part past ``floor``; ``ram``: every page is in L2, which has its own
        rate). Until both costs are measured, restores go ahead: that is how they get measured."""
        costs = self.admission.costs if self.admission is not None else None
        if costs is None or self.bytes_per_token <= 0:
            return True
        moved = n_tokens - floor if appended else n_tokens
        restore = costs.restore_cost(moved * self.bytes_per_token, ram=ram)
        cold = costs.cold_cost(n_tokens - floor)
        return restore is None or cold is None or restore < cold

    def fallback(self, reason: str) -> None:
        """Count a tier fault that was turned into a shallower hit or a cold prefill."""
        self.counters.fallbacks[reason] += 1

    # -- recording into L3 ----------------------------------------------------------------

    def plan_record(self, tokens: Tokens, point: int) -> RecordPlan | None:
        """What recording ``tokens[:point]`` would add; None when L3 already holds it all.

        The new pages continue the stored path where it ends (possibly at a branch point inside
        a stored page), cut at multiples of ``page_tokens``, so nothing stored is stored again.
        """
        if self.disk is None or not self.disk.serving or point <= 0:
            return None
        if self.trace is not None:
            self.trace.record(self.root, tokens, point)
        # queued pages count: the previous request's record may still wait for the writer
        path = self._walk(tokens, point, queued=True)
        if path.n_tokens >= point:
            self.counters.records_skipped += 1
            return None
        p = self.page_tokens
        new = []
        parent, pos = path.end, path.n_tokens
        while pos < point:
            end = min(pos + p - pos % p, point)
            key = chain_key(parent, tokens[pos:end])
            new.append((key, parent, pos, end))
            parent, pos = key, end
        return RecordPlan(point, path.steps, new)

    def record(
        self,
        plan: RecordPlan,
        state: SequenceState,
        tokens: Tokens,
        release: Callable[[], None] | None = None,
    ) -> bool:
        """Queue ``plan``'s record; True when queued.

        Its new pages are cut out of ``state`` by the L3 writer, not here: at 32k tokens of a
        1B model that is 720 MB of copies the request no longer waits for. ``state``'s bytes
        must stay untouched until ``release`` is called (by the writer once it has cut them,
        or at once when the record is not queued).
        """
        if self.disk is None:
            if release is not None:
                release()
            return False
        try:
            record = self._new_record(plan, state, tokens, release)
        except BaseException:
            if release is not None:
                release()
            raise
        queued = self.disk.record(record)  # a record it does not queue, it drops (releases)
        self.counters.records += int(queued)
        return queued

    def _new_record(
        self,
        plan: RecordPlan,
        state: SequenceState,
        tokens: Tokens,
        release: Callable[[], None] | None,
    ) -> PrefixRecord:
        pages = [
            PageBlob(step.key, step.parent, step.n_tokens, b"", None, step.used)
            for step in plan.reused
        ]
        state = sort_by_position(state)  # once, not once per page
        for key, parent, start, end in plan.new:
            page = slice_state(state, start, end)  # views into the capture
            payload = PendingPayload(page.nbytes, page.to_bytes)
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
