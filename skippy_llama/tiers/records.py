"""What the deeper tiers store and report: page blobs, prefix records, and typed status results.

Everything here is plain data (frozen dataclasses) so the orchestrator, the tiers and the CLI agree
on one vocabulary without importing each other. ``to_json()`` gives the JSON-ready dict the
``kv-cache`` CLI prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

#: Length of a page key, a parent key and a payload digest (xxh3_128).
KEY_BYTES = 16

DiskState = Literal["off", "active", "read_only_low_space", "degraded"]
DegradedReason = Literal[
    "storage_unavailable", "storage_untrusted", "budget_below_entry_floor", "storage_error"
]


class PendingPayload:
    """A new page's serialized bytes, still to be made (cut out of a captured state) by the L3
    writer, off the request path.

    ``len()`` is the size the bytes will have, so queue bounds and traces need not make them.
    """

    __slots__ = ("_make", "_size")

    def __init__(self, size: int, make: Callable[[], bytes]) -> None:
        self._size = size
        self._make = make

    def __len__(self) -> int:
        return self._size

    def make(self) -> bytes:
        """The bytes.

        Raises:
            ValueError: they are not the announced size (a bug in the cutting, never stored).
        """
        data = self._make()
        if len(data) != self._size:
            raise ValueError(f"a pending page made {len(data)} bytes, announced {self._size}")
        return data


@dataclass(frozen=True)
class PageBlob:
    """One page of a record and its place in the page tree.

    Pages form a tree: every page is indexed under its ``parent`` with its tokens, so a lookup can
    use any *prefix* of a stored page (a prompt that branches off mid-page) and a later record
    hangs its next page under that branch point instead of storing the shared tokens again.

    Attributes:
        key: 16-byte chain key of this page (opaque to the tiers).
        parent: 16-byte key of the node this page follows: the previous page's key, the key of a
            branch point inside it, or the cache-identity root for position 0.
        n_tokens: tokens the page holds.
        tokens: the page's tokens as little-endian int32 (the child index stores them).
        payload: the serialized page (or a :class:`PendingPayload` the writer makes), or None
            for a page already stored that the record reuses.
        used: tokens of this page the record's prefix covers (``n_tokens`` but at a branch point).
    """

    key: bytes
    parent: bytes
    n_tokens: int
    tokens: bytes
    payload: bytes | PendingPayload | None
    used: int

    def __post_init__(self) -> None:
        if len(self.key) != KEY_BYTES or len(self.parent) != KEY_BYTES:
            raise ValueError("page key and parent must be 16 bytes (xxh3_128)")
        if self.n_tokens <= 0:
            raise ValueError(f"page n_tokens must be positive, got {self.n_tokens}")
        if not 0 < self.used <= self.n_tokens:
            raise ValueError(f"page uses {self.used} of its {self.n_tokens} tokens")
        if self.payload is not None and len(self.tokens) != 4 * self.n_tokens:
            raise ValueError("a new page needs its tokens (4 bytes each)")

    @property
    def data(self) -> bytes:
        """A new page's bytes, made now where they are pending.

        Raises:
            ValueError: a reused page (it has none), or pending bytes of the wrong size.
        """
        if isinstance(self.payload, PendingPayload):
            return self.payload.make()
        if self.payload is None:
            raise ValueError("a reused page has no bytes in the record")
        return self.payload


@dataclass(frozen=True)
class PrefixRecord:
    """A cached prefix: its identities and its pages in tree order, page 0 first.

    Every page but the last may be used partly (a branch point); the last is used whole and new.

    Attributes:
        cache_identity: hex cache identity (the chain root).
        model_identity: hex model id, as the operator passes it to ``--model-identity``.
        model_name: human-readable model name for status output.
        n_tokens: tokens covered by all pages together.
        pages: the pages, page 0 first.
        release: called (by :meth:`drop`) once the bytes pending payloads are cut from are no
            longer read: after the writer made them, or when the record is not written.
    """

    cache_identity: str
    model_identity: str
    model_name: str
    n_tokens: int
    pages: tuple[PageBlob, ...]
    release: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.pages:
            raise ValueError("a prefix record needs at least one page")
        last = self.pages[-1]
        if last.payload is None or last.used != last.n_tokens:
            raise ValueError("the last page of a prefix record must be new and used whole")
        for prev, page in zip(self.pages, self.pages[1:], strict=False):
            if prev.used == prev.n_tokens and page.parent != prev.key:
                raise ValueError("prefix record pages are not in chain order")
        if sum(page.used for page in self.pages) != self.n_tokens:
            raise ValueError("prefix record n_tokens differs from the tokens its pages cover")

    @property
    def manifest_id(self) -> bytes:
        """The manifest key: the last page's chain key (it determines the whole prefix)."""
        return self.pages[-1].key

    @property
    def payload_bytes(self) -> int:
        """Bytes of the pages this record adds (reused pages are already stored)."""
        return sum(len(page.payload) for page in self.pages if page.payload is not None)

    def drop(self) -> None:
        """Release the bytes pending payloads are cut from; only the first call does."""
        release = self.release
        if release is not None:
            object.__setattr__(self, "release", None)
            release()


class _Json:
    """Mixin: a dataclass whose ``to_json()`` is its ``asdict`` (nested dataclasses included)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload, no-any-return]


@dataclass(frozen=True)
class DiskUsage(_Json):
    """Sizes and counts of the disk store (``usage`` in ``kv-cache status``)."""

    budget_bytes: int = 0
    used_bytes: int = 0
    filesystem_available_bytes: int | None = None
    minimum_free_bytes: int = 0
    manifests: int = 0
    pages: int = 0
    quarantined: int = 0
    # manifests left out above: damaged, of another version, or without a valid tag (a damaged
    # one is quarantined by the next reconciliation, prune or clear; status itself writes nothing)
    skipped_manifests: int = 0
    # restore points (recurrent and hybrid models, ``l3/points.py``): records and their bytes
    restore_points: int = 0
    restore_point_bytes: int = 0


@dataclass(frozen=True)
class DiskActivity(_Json):
    """Activity counters; the store keeps them summed over every process that used it."""

    hits: int = 0  # read() calls that served at least one page
    misses: int = 0  # read() calls that served nothing, plus note_miss()
    pages_read: int = 0
    bytes_read: int = 0
    pages_read_in_flight: int = 0  # of pages_read, made from records waiting for the writer
    writes: int = 0  # pages actually written (deduplicated pages are not writes)
    pages_deduplicated: int = 0  # pages a record found already stored
    bytes_written: int = 0
    manifests_written: int = 0
    evictions: int = 0  # manifests evicted for the budget (cut back to nothing)
    pages_evicted: int = 0
    pruned: int = 0  # manifests removed by prune/clear
    corrupt_entries: int = 0  # pages that failed digest/size checks (quarantined)
    missing_pages: int = 0  # pages whose payload vanished (deleted mid-read, lost files)
    unknown_codec: int = 0  # pages stored with a codec this build does not read (missed)
    dropped_writes: int = 0  # records not written: queue full, low space, off, errors
    dropped_queue_full: int = 0
    dropped_low_space: int = 0
    dropped_stale: int = 0  # records whose reused pages were removed before the write
    storage_errors: int = 0
    lock_timeouts: int = 0
    admitted: int = 0
    rejected: int = 0
    admission_fallback: int = 0  # admitted by write-through because costs were not measured yet
    promotions: int = 0  # pages that left probation (second hit)
    pages_refused: int = 0  # new pages the store's policy did not admit (the record ends there)
    unauthenticated: int = 0  # pages, index entries, manifests without a valid tag (missed)
    untrusted_rows: int = 0  # rows L3 did not write (pickled, text, foreign file names): dropped
    point_hits: int = 0  # restore points served (verified)
    point_misses: int = 0  # restore-point lookups that found none (or a damaged one)
    point_bytes_read: int = 0
    point_writes: int = 0
    point_bytes_written: int = 0
    corrupt_points: int = 0  # restore-point records that failed verification (quarantined)
    points_evicted: int = 0  # for the restore points' share of the budget
    points_dropped: int = 0  # not written: low space, off, over the share, errors
    point_pages_shared: int = 0  # attention pages a new point found stored by another
    damaged_manifests: int = 0  # damaged or foreign-version manifests quarantined
    damaged_costs: int = 0  # cost-book entries (or the book) failing validation or tag: ignored
    internal_errors: int = 0  # bugs in L3's own code (logged as errors): must stay 0

    @classmethod
    def from_counts(cls, counts: dict[str, int]) -> DiskActivity:
        """Build from a counter dict, ignoring names this version does not know."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: int(v) for k, v in counts.items() if k in known})


@dataclass(frozen=True)
class Reconciliation(_Json):
    """What start-up reconciliation found and did."""

    ran: bool = False
    at: float | None = None  # unix time
    pid: int | None = None
    seconds: float = 0.0
    verify: Literal["sizes", "digests"] = "sizes"
    pages_checked: int = 0
    orphan_pages_removed: int = 0  # payloads or page metadata no manifest references
    orphan_files_removed: int = 0  # diskcache value files without a row (interrupted writes)
    unknown_keys: int = 0  # keys of no kind we know (left alone: not ours to delete)
    stale_pins_removed: int = 0  # pins of processes that are gone
    manifests_removed: int = 0  # manifests that were unreadable or whose pages are missing
    index_fixed: int = 0  # child-index entries pointing at missing pages (or unreadable)
    quarantined: int = 0  # pages quarantined by this run
    manifests_quarantined: int = 0  # damaged or foreign-version manifests moved aside
    untrusted_rows: int = 0  # rows of pickled/text values or foreign file names dropped
    quarantined_total: int = 0  # quarantine records in the store after this run


@dataclass(frozen=True)
class InventoryEntry(_Json):
    """Per-model totals (``inventory`` in ``kv-cache status``); pages and bytes are distinct."""

    model_identity: str
    model_name: str
    manifests: int
    pages: int
    bytes: int
    tokens: int


@dataclass(frozen=True)
class RestorePointEntry(_Json):
    """The restore points of one prefix family: one model's points, listed by length."""

    model_identity: str
    model_name: str
    points: int
    bytes: int
    #: ``[n_tokens, bytes]`` of each point, shortest first
    sizes: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class DiskStatus:
    """Effective state of the disk tier, for ``kv-cache status`` (configured values come from the
    CLI's LoadedSettings)."""

    state: DiskState
    reason: str | None
    directory: str | None
    usage: DiskUsage
    activity: DiskActivity  # every process, persisted, plus this process's unflushed counts
    process_activity: DiskActivity  # this process only
    reconciliation: Reconciliation  # the latest one recorded in the store
    inventory: tuple[InventoryEntry, ...] = ()
    restore_points: tuple[RestorePointEntry, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "effective": {"state": self.state, "reason": self.reason, "directory": self.directory},
            "usage": self.usage.to_json(),
            "activity": self.activity.to_json(),
            "process_activity": self.process_activity.to_json(),
            "reconciliation": self.reconciliation.to_json(),
            "inventory": [entry.to_json() for entry in self.inventory],
            "restore_points": [entry.to_json() for entry in self.restore_points],
        }


@dataclass(frozen=True)
class PruneResult(_Json):
    """What ``prune`` removed and what it had to keep."""

    target_bytes: int | None
    model_identity: str | None
    manifests_removed: int
    pages_removed: int
    bytes_before: int
    bytes_after: int
    kept_in_use: int  # manifests skipped because a page of theirs is pinned (in use)
    reached_target: bool


@dataclass(frozen=True)
class ClearResult(_Json):
    """What ``clear`` removed; ``manifests_left`` is 0 for the scope afterwards."""

    model_identity: str | None
    manifests_removed: int
    pages_removed: int
    pages_kept_in_use: int  # pinned pages left in place until released
    bytes_before: int
    bytes_after: int
    manifests_left: int


@dataclass(frozen=True)
class RamStatus(_Json):
    """State and counters of the L2 RAM mirror."""

    enabled: bool
    budget_bytes: int
    used_bytes: int
    pages: int
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    first_fills: int = 0  # offers remembered, waiting for a second fill
    rejected_too_large: int = 0
    rejected_over_budget: int = 0
    evictions: int = 0
    invalidations: int = 0  # L3 removed the page
    digest_mismatches: int = 0  # L3 holds different bytes now: the copy was dropped
    prefetched: int = 0  # pages a prefetch copied in ahead of a request
    prefetch_hits: int = 0  # hits on pages a prefetch predicted (copied in or found held)
    prefetch_refused: int = 0  # pages a prefetch left out: no room it was allowed to take
    arena_hits: int = 0  # pages a restore copied straight from the host arena (patch 0006)
    arena_bytes: int = 0  # host memory of the arena (0: pages kept as bytes)
    arena_pinned: bool = False  # the arena is page-locked (CUDA builds)
