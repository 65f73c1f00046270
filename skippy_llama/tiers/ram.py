"""L2: a bounded host-RAM mirror of L3, holding only pages L3 holds with the same digest.

L2 never holds anything L3 does not: every copy carries the digest L3's read verified for the
bytes copied (offered only while L3 still holds those bytes), and
:meth:`RamTier.get` takes L3's current digest and drops the copy when they differ (or when L3 no
longer has the page). :meth:`RamTier.invalidate` is wired to the disk tier's removal listener, so
an eviction or quarantine in this process drops the copy at once; removals by other processes are
caught by the digest check.

Promotion is deliberately conservative, because RAM is the scarcer resource: a page is copied in on
its second fill within ten minutes, or at once when it belongs to a prefix of at least 4,096 tokens
(long prefixes are the ones whose reads hurt); payloads over 64 MiB never are. The budget is charged
by distinct bytes: pages are keyed by their chain key, so a page shared by many prefixes is held
and charged once.

A prefetch (:meth:`RamTier.take_prefetched`, from :meth:`skippy_llama.cache.PrefixCache.prefetch`) is
an explicit prediction that a prompt comes next, so it skips the first-fill rule, but it may only
take room that nobody is about to use: it evicts least-recently-used pages except the prompt's own
and the pages an earlier prefetch predicted within the promotion window that no request has used
yet (``predicted``); when that does not free enough room, the page is refused and the prefetch
stops. So a less likely prediction never displaces a more likely one made before it, a prefetch
larger than the budget never evicts its own first pages, and stale predictions stop blocking
after ``promote_window_s``. Real fills keep plain LRU over everything: demand beats prediction.

With a host arena attached (:meth:`RamTier.attach_arena`, where the patched llama.cpp's per-layer
cell copies are certified) pages are kept in the KV cache's own layout (:mod:`.arena`) instead of
as page bytes, each charged a whole slot; :meth:`RamTier.arena_read` hands a restore the slots of
a run of pages, and :meth:`RamTier.get` still gives page bytes to every other reader.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from ..errors import StateFormatError
from ..state import page_from_bytes
from .arena import ArenaSlot, HostArena
from .base import PrefetchFill
from .records import PrefixRecord, RamStatus

#: what L2 keeps of a page: its bytes, or its slot in the host arena
Held = bytes | ArenaSlot


class DigestSource(Protocol):
    """The tier L2 mirrors: the current digest of each page it holds."""

    @property
    def serving(self) -> bool: ...

    def digest(self, key: bytes) -> bytes | None: ...


MiB = 1 << 20
#: A second fill within this many seconds promotes a page.
PROMOTE_WINDOW_S = 600.0
#: Pages of prefixes at least this long are promoted on their first fill.
LARGE_PREFIX_TOKENS = 4096
#: Payloads larger than this are never promoted (one page must not flush the whole mirror).
MAX_PAYLOAD_BYTES = 64 * MiB
#: How many first fills are remembered while waiting for a second one.
MAX_SEEN = 65536


class RamTier:
    """LRU mirror of L3 pages in host RAM, bounded by an explicit budget in bytes.

    Thread-safe. ``clock`` returns seconds (monotonic) and is injectable for tests.
    """

    name = "l2"
    #: a mirror: pages come by promotion from L3, never from records
    takes_records = False
    in_memory = True

    def __init__(
        self,
        budget_bytes: int,
        *,
        source: DigestSource | None = None,
        clock: Callable[[], float] = time.monotonic,
        promote_window_s: float = PROMOTE_WINDOW_S,
        large_prefix_tokens: int = LARGE_PREFIX_TOKENS,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
        max_seen: int = MAX_SEEN,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"L2 budget must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        #: the tier this one mirrors (L3): its digests decide whether a copy is still valid
        self.source = source
        self._clock = clock
        self._window = promote_window_s
        self._large = large_prefix_tokens
        self._max_payload = max_payload_bytes
        self._max_seen = max_seen
        # key -> (payload or arena slot, L3 digest); order = LRU (first) to MRU (last)
        self._pages: OrderedDict[bytes, tuple[Held, bytes]] = OrderedDict()
        #: pages in the KV cache's layout (None: pages are kept as bytes)
        self.arena: HostArena | None = None
        #: the arena is page-locked (set by whoever pinned it)
        self.arena_pinned = False
        self._last_slot: int | None = None
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # key -> time of first fill
        # key -> when a prefetch predicted it; dropped on its first hit (see the module docstring)
        self._predicted: dict[bytes, float] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            (
                "hits",
                "misses",
                "promotions",
                "first_fills",
                "rejected_too_large",
                "rejected_over_budget",
                "evictions",
                "invalidations",
                "digest_mismatches",
                "prefetched",
                "prefetch_hits",
                "prefetch_refused",
                "arena_hits",
            ),
            0,
        )

    def attach_arena(self, arena: HostArena) -> None:
        """Keep pages in ``arena`` from now on (the pages held so far are dropped)."""
        with self._lock:
            for key in list(self._pages):
                self._drop(key)
            self.arena = arena
            self._last_slot = None

    def detach_arena(self) -> None:
        """Go back to keeping page bytes (the pages held in the arena are dropped, the arena
        closed): what L2 did before the arena, for comparisons."""
        with self._lock:
            for key in list(self._pages):
                self._drop(key)
            arena, self.arena = self.arena, None
            self.arena_pinned = False
        if arena is not None:
            arena.close()

    def _charge(self, payload: bytes | memoryview) -> int:
        """Bytes the budget is charged for a page: a whole slot in the arena, else its size."""
        return self.arena.slot_bytes if self.arena is not None else len(payload)

    def _keep(self, payload: bytes | memoryview) -> Held:
        """The page as L2 holds it: copied into an arena slot, else its own bytes (a page the
        arena cannot hold stays bytes). Called with room for it made."""
        if self.arena is not None:
            try:
                page = page_from_bytes(payload)
            except StateFormatError:
                page = None
            slot = self.arena.put(page, self._last_slot) if page is not None else None
            if slot is not None:
                self._last_slot = slot.index
                return slot
        # own the bytes: a memoryview would pin whatever larger buffer it slices
        return payload if isinstance(payload, bytes) else bytes(payload)

    def _held_bytes(self, held: Held) -> int:
        """Bytes the budget was charged for ``held``."""
        if isinstance(held, ArenaSlot):
            return self.arena.slot_bytes if self.arena is not None else 0
        return len(held)

    @property
    def used_bytes(self) -> int:
        """Distinct payload bytes held."""
        return self._used

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: object) -> bool:
        return key in self._pages

    def fill(
        self, key: bytes, payload: bytes | memoryview, digest: bytes, prefix_tokens: int
    ) -> bool:
        """Offer a page L3 just served (a "fill"); returns True when L2 now holds it.

        Args:
            key: the page's chain key.
            payload: the verified bytes L3 returned.
            digest: L3's digest of those bytes (checked again on every :meth:`get`).
            prefix_tokens: length of the prefix the page was read for.
        """
        with self._lock:
            size = self._charge(payload)
            if key in self._pages:
                if self._pages[key][1] == digest:
                    self._pages.move_to_end(key)
                    return True
                self._drop(key)  # L3 rewrote the page: the old copy is stale
            if len(payload) > self._max_payload:
                self._counts["rejected_too_large"] += 1
                return False
            if size > self.budget_bytes:
                self._counts["rejected_over_budget"] += 1
                return False
            now = self._clock()
            if prefix_tokens < self._large:
                first = self._seen.get(key)
                if first is None or now - first > self._window:
                    # First fill (or the previous one is too old): remember it, don't copy yet.
                    self._seen[key] = now
                    self._seen.move_to_end(key)
                    while len(self._seen) > self._max_seen:
                        self._seen.popitem(last=False)
                    self._counts["first_fills"] += 1
                    return False
            self._seen.pop(key, None)
            while self._used + size > self.budget_bytes and self._pages:
                self._drop(next(iter(self._pages)))
                self._counts["evictions"] += 1
            held = self._keep(payload)
            self._pages[key] = (held, digest)
            self._used += self._held_bytes(held)
            self._counts["promotions"] += 1
            return True

    def get(self, key: bytes, l3_digest: bytes | None) -> bytes | None:
        """The page if L2 holds it and L3 still holds the same bytes (``l3_digest``), else None.

        A copy whose digest differs from L3's, or whose page L3 no longer has (``l3_digest`` is
        None), is dropped: L2 must never serve what L3 would not.
        """
        with self._lock:
            entry = self._pages.get(key)
            if entry is None:
                self._counts["misses"] += 1
                return None
            if not self._hit(key, entry[1], l3_digest):
                return None
            held = entry[0]
            if isinstance(held, ArenaSlot):
                assert self.arena is not None
                return self.arena.page(held).to_bytes()
            return held

    def _hit(self, key: bytes, digest: bytes, l3_digest: bytes | None) -> bool:
        """Whether the held copy of ``key`` may serve (L3 still holds the same bytes); counts
        the hit or drops the stale copy. Called with the lock held."""
        if l3_digest is None or digest != l3_digest:
            self._drop(key)
            self._counts["digest_mismatches" if l3_digest is not None else "invalidations"] += 1
            self._counts["misses"] += 1
            return False
        self._pages.move_to_end(key)
        self._counts["hits"] += 1
        if self._predicted.pop(key, None) is not None:
            self._counts["prefetch_hits"] += 1  # a prediction came true; now a plain page
        return True

    def in_arena(self, keys: Sequence[bytes]) -> bool:
        """Whether every page of ``keys`` is held in the arena (no side effects)."""
        with self._lock:
            held = [self._pages.get(key) for key in keys]
        return bool(keys) and all(h is not None and isinstance(h[0], ArenaSlot) for h in held)

    @contextlib.contextmanager
    def arena_read(
        self, keys: Sequence[bytes], *, count: bool = True
    ) -> Iterator[tuple[HostArena, list[ArenaSlot]]]:
        """The arena and the slots of the longest prefix of ``keys`` held there whose L3 digest
        still matches (counted as hits, as :meth:`get` counts them, unless ``count`` is off:
        pages a restore read from L3 and promoted meanwhile), for a restore to copy from.

        L2 stays locked until the block ends, so no fill or eviction rewrites a slot while
        the restore copies it: the block must not call back into this tier.
        """
        digests = [self.source.digest(key) if self.source is not None else None for key in keys]
        with self._lock:
            arena = self.arena
            if arena is None:
                raise StateFormatError("L2 has no arena")
            slots: list[ArenaSlot] = []
            for key, l3_digest in zip(keys, digests, strict=True):
                entry = self._pages.get(key)
                if entry is None or not isinstance(entry[0], ArenaSlot):
                    if count:
                        self._counts["misses"] += 1
                    break
                if not count:
                    if l3_digest is None or entry[1] != l3_digest:
                        break  # a copy L3 would not serve (its next get drops it)
                    self._pages.move_to_end(key)
                elif not self._hit(key, entry[1], l3_digest):
                    break
                slots.append(entry[0])
            if count:
                self._counts["arena_hits"] += len(slots)
            yield arena, slots

    def prefetch_fill(
        self,
        key: bytes,
        payload: bytes | memoryview,
        digest: bytes,
        protect: frozenset[bytes] | set[bytes] = frozenset(),
    ) -> PrefetchFill:
        """Admit a page a prefetch read from L3, as a prediction (see the module docstring).

        Args:
            key: the page's chain key.
            payload: the verified bytes L3 returned (copied: a view into a read buffer is fine).
            digest: L3's digest of those bytes, from the same read.
            protect: pages this prefetch must not evict (the rest of the same prompt's path).
        """
        with self._lock:
            size = self._charge(payload)
            now = self._clock()
            if key in self._pages:
                if self._pages[key][1] == digest:
                    self._pages.move_to_end(key)
                    self._predicted[key] = now
                    return "held"
                self._drop(key)  # L3 rewrote the page: the old copy is stale
            if len(payload) > self._max_payload:
                self._counts["rejected_too_large"] += 1
                return "too_large"
            need = self._used + size - self.budget_bytes
            victims: list[bytes] = []
            if need > 0:
                for old, (data, _) in self._pages.items():  # LRU first
                    if old in protect or self._is_predicted(old, now):
                        continue
                    victims.append(old)
                    need -= self._held_bytes(data)
                    if need <= 0:
                        break
            if need > 0:
                self._counts["prefetch_refused"] += 1
                return "full"
            for old in victims:
                self._drop(old)
                self._counts["evictions"] += 1
            self._seen.pop(key, None)
            held = self._keep(payload)
            self._pages[key] = (held, digest)
            self._used += self._held_bytes(held)
            self._predicted[key] = now
            self._counts["prefetched"] += 1
            return "added"

    def predict(self, keys: Sequence[bytes]) -> int:
        """Mark the pages of ``keys`` that L2 holds as predicted (a prefetch found them here):
        they become the most recently used and later prefetches leave them alone. Returns how
        many were held."""
        held = 0
        with self._lock:
            now = self._clock()
            for key in keys:
                if key in self._pages:
                    self._pages.move_to_end(key)
                    self._predicted[key] = now
                    held += 1
        return held

    def _is_predicted(self, key: bytes, now: float) -> bool:
        at = self._predicted.get(key)
        return at is not None and now - at <= self._window

    # -- the page-tier protocol (tiers/base.py) ---------------------------------------------

    @property
    def serving(self) -> bool:
        return self.source is not None and self.source.serving

    def holds(self, key: bytes, *, queued: bool = False) -> bool:
        return key in self._pages

    def children(self, parent: bytes, *, queued: bool = False) -> list[tuple[bytes, bytes]]:
        return []  # a mirror finds whole pages by key; the branch points are L3's

    def fetch(self, keys: Sequence[bytes]) -> list[bytes | memoryview]:
        """Copies of the longest prefix of ``keys`` whose L3 digest still matches."""
        out: list[bytes | memoryview] = []
        for key in keys:
            page = self.get(key, self.source.digest(key) if self.source is not None else None)
            if page is None:
                break
            out.append(page)
        return out

    def offer(self, record: PrefixRecord) -> bool:
        record.drop()  # never offered (takes_records is False); dropped if it were
        return False

    def promote(
        self,
        key: bytes,
        payload: bytes | memoryview,
        prefix_tokens: int,
        digest: bytes | None = None,
    ) -> None:
        """Keep a copy of a page L3 served, by the promotion rules (see :meth:`fill`), under
        ``digest``, the one L3's read verified for these bytes. Not kept unless they are L3's
        current bytes: bytes with no digest from L3 (read from another tier, or from a record
        still waiting for L3's writer), or bytes L3 has rewritten or dropped since the read.
        A digest asked now, not the read's, would tag the old bytes with a rewrite's digest,
        and :meth:`get` would then serve them as the new page."""
        if digest is None or self.source is None or self.source.digest(key) != digest:
            return
        self.fill(key, payload, digest, prefix_tokens)

    def note_miss(self) -> None:
        """L2's misses are counted per page by :meth:`get`."""

    def take_prefetched(
        self,
        key: bytes,
        payload: bytes | memoryview,
        protect: frozenset[bytes] = frozenset(),
        digest: bytes | None = None,
    ) -> PrefetchFill:
        """A page a prefetch read from a deeper tier (the prefetch protocol, ``tiers/base.py``),
        kept as a prediction under ``digest``, the one L3's read verified for these bytes
        (:meth:`prefetch_fill`). ``foreign`` unless they are L3's current bytes: bytes with no
        digest from L3 (a page only the remote tier has; L2 mirrors L3 alone), or bytes L3 has
        rewritten or dropped since the read. The copy keeps the read's digest, never one asked
        now: a later :meth:`get` compares it with L3's, so a page L3 rewrites after this call
        is dropped there, not served."""
        if digest is None or self.source is None or self.source.digest(key) != digest:
            return "foreign"
        return self.prefetch_fill(key, payload, digest, protect)

    def close(self) -> None:
        self.clear()
        with self._lock:
            arena, self.arena = self.arena, None
        if arena is not None:
            arena.close()

    def invalidate(self, key: bytes) -> None:
        """Drop the copy of ``key`` (L3 removed, evicted or quarantined the page)."""
        with self._lock:
            self._seen.pop(key, None)
            if key in self._pages:
                self._drop(key)
                self._counts["invalidations"] += 1

    def clear(self) -> None:
        """Drop every copy and forget every first fill."""
        with self._lock:
            for key in list(self._pages):
                self._drop(key)
            self._seen.clear()
            self._predicted.clear()
            self._used = 0

    def _drop(self, key: bytes) -> None:
        held, _ = self._pages.pop(key)
        self._used -= self._held_bytes(held)
        self._predicted.pop(key, None)
        if isinstance(held, ArenaSlot) and self.arena is not None:
            self.arena.free(held)

    def status(self) -> RamStatus:
        """Budget, usage and counters."""
        with self._lock:
            return RamStatus(
                enabled=True,
                budget_bytes=self.budget_bytes,
                used_bytes=self._used,
                pages=len(self._pages),
                arena_bytes=self.arena.nbytes if self.arena is not None else 0,
                arena_pinned=self.arena_pinned,
                **self._counts,
            )
