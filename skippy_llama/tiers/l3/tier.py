"""``DiskTier``: the L3 façade the orchestrator, the runtime and the CLI use.

It wires the modules of this package and keeps the public API of the first release; the work is
done by ``store`` (diskcache, the trust boundary), ``tree`` (commit and removal), ``reader``,
``writer`` + ``recorder``, ``eviction`` (by a ``policies`` policy), ``reconcile`` (incremental,
in the background), ``maintain``, ``sessions``, ``pins``, ``health`` and ``admin``.

Every tier fault (I/O error, corruption, lock contention, full disk, untrusted data) is counted
and turned into a miss or a dropped write; nothing here raises to the request path. Operator
calls (``prune``, ``clear``) raise :class:`~skippy_llama.errors.ConfigError` for a bad model
identity or a store they cannot act on; a bad ``l3.secret_file`` is a ConfigError at open.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ...admission import AdmissionPolicy
from ...config import L3Settings
from ...restore_points import PointOwner, PointRole, RestorePoint
from ..records import ClearResult, DiskState, DiskStatus, PrefixRecord, PruneResult, Reconciliation
from .admin import Admin
from .auth import Signer, load_secret
from .context import Parts
from .costs import TIER
from .eviction import Evictor
from .health import ENTRY_FLOOR, Health
from .learned import LearnedCosts
from .maintain import Maintenance
from .pins import Pins
from .points import PointMeta, Points
from .policies import make_policy
from .policy_api import Policy
from .reader import Reader, ReadResult
from .reconcile import Reconciler
from .recorder import Recorder
from .schema import META
from .sessions import Sessions
from .stats import Counters
from .tree import Tree
from .writer import MAX_QUEUED_BYTES, Writer

#: SQLite busy timeout: long enough for another process's short transaction, short enough that a
#: stuck lock becomes a counted fault instead of a hung request.
SQLITE_TIMEOUT_S = 5.0


def _close_at_exit(ref: weakref.ReferenceType[DiskTier]) -> None:
    tier = ref()
    if tier is not None:
        tier.close()


class DiskTier:
    """The L3 store.

    Args:
        settings: ``l3`` settings.
        admission: the record-level admission policy (it also supplies measured costs to the
            eviction policy); without one every record is offered to the page policy alone.
        disk_free: ``path -> available bytes`` (default: statvfs).
        reconcile: reconcile in the background when due (a never-reconciled store, one whose
            last walk is old, one a process died with open); off, the tier never walks.
        verify: the background reconciliation checks digests (reads everything), and runs now.
        max_queued_bytes: payload bytes that may wait for the writer before records drop.
        timeout: SQLite busy timeout in seconds.
        close_at_exit: close (landing pending writes) at interpreter exit.
        read_only: open through a read-only connection, write nothing, not even a missing
            directory (``kv-cache status``).
        policy: eviction/admission policy object (default: ``settings.policy`` by name).
        cost_key: ``(model identity, backend)`` whose measured costs (``admission.costs``) are
            kept in the store: loaded at open, saved by the writer (``learned.py``).
    """

    #: the page-tier protocol (tiers/base.py): L3 takes the runtime's records
    name = TIER
    takes_records = True
    in_memory = False
    #: restore points (restore_points.PointTier): stored here first, kept across restarts
    role: PointRole = "durable"

    def __init__(
        self,
        settings: L3Settings,
        *,
        admission: AdmissionPolicy | None = None,
        disk_free: Callable[[str], int] | None = None,
        reconcile: bool = True,
        verify: bool = False,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        timeout: float = SQLITE_TIMEOUT_S,
        close_at_exit: bool = True,
        read_only: bool = False,
        policy: Policy | None = None,
        cost_key: tuple[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.directory = Path(settings.directory)
        self.admission = admission
        secret = None
        if settings.mode != "off" and settings.secret_file is not None:
            secret = load_secret(settings.secret_file, shared_group=settings.shared_group)
        counters = Counters()
        health = Health(settings, counters, disk_free=disk_free, used_bytes=self.used_bytes)
        self._parts = parts = Parts(settings, health, counters, Signer(secret))
        self._store_lock = parts.lock  # held while this process commits (tests hold it too)
        self._pins = Pins(parts)
        self._tree = Tree(parts, self._pins)
        self._reader = Reader(parts, self._tree, self._pins)
        budget = settings.budget or 64 << 30
        self.policy = policy or make_policy(settings.policy, max(budget, ENTRY_FLOOR))
        costs = admission.costs if admission is not None else None
        self._evictor = Evictor(parts, self._tree, self._pins, self.policy, costs)
        self._admin = Admin(parts, self._tree, self._pins, self._evictor)
        self._sessions = Sessions(parts)
        self._points = Points(parts)
        self.learned: LearnedCosts | None = None
        if admission is not None and cost_key is not None and not read_only:
            self.learned = LearnedCosts(parts, admission.costs, *cost_key)
        self._maintenance = Maintenance(
            parts, self._tree, self._reader.touches, self._sessions, admission, self.learned
        )
        self._reconciler = Reconciler(parts, self._tree, self._pins)
        recorder = Recorder(parts, self._tree, self._pins, self._evictor, self.policy, admission)
        self._recorder = recorder
        self._writer = Writer(parts, recorder.write, self._idle, max_queued_bytes=max_queued_bytes)
        self._closed = False
        self._atexit: Callable[[], None] | None = None
        if settings.mode == "off":
            return  # off touches nothing on disk, not even the directory
        if parts.open(timeout, read_only=read_only) and not read_only:
            self._start(reconcile, verify)
        health.refresh(force=True)
        if close_at_exit and not read_only:
            # a weak reference, so the registration does not keep a dropped tier alive
            self._atexit = functools.partial(_close_at_exit, weakref.ref(self))
            atexit.register(self._atexit)

    def _start(self, reconcile: bool, verify: bool) -> None:
        if self.learned is not None:
            self.learned.load()  # before the first record: admission decides with these
        try:
            crashed = self._sessions.open()
            if verify or (reconcile and self._reconciler.due(crashed=crashed)):
                self._reconciler.start(verify=verify)
                if self._reconciler.holds_nothing():
                    while self._reconciler.step():  # a new store: a few empty queries
                        pass
                else:
                    self._writer.start()  # walks in the background, batch by batch
        except Exception as exc:
            self._parts.health.fault(exc, "open")

    def _idle(self) -> bool:
        """A unit of housekeeping for the writer thread; True while a walk has more to do."""
        if self._maintenance.due:
            self._maintenance.run()
        elif self._reconciler.pending:
            try:
                self._reconciler.step()
            except Exception:
                self._reconciler.abandon()  # a later open resumes from its lease
                raise
        return self._reconciler.pending

    # ------------------------------------------------------------------ state

    @property
    def state(self) -> DiskState:
        """``off`` | ``active`` | ``read_only_low_space`` | ``degraded``."""
        return self._parts.health.state

    @property
    def reason(self) -> str | None:
        """Why the state is ``degraded``, else None."""
        return self._parts.health.reason

    @property
    def error(self) -> str | None:
        """Why the store is unavailable or refused, for status output."""
        return self._parts.health.error

    @property
    def serving(self) -> bool:
        """True when reads are served (active, read-only low space, transient storage errors)."""
        return self._parts.health.serving

    @property
    def untrusted_rows(self) -> int:
        """Rows L3 did not write (pickled or text keys/values, foreign file names), dropped."""
        store = self._parts.store
        return store.untrusted_rows if store is not None else 0

    @property
    def reconciliation(self) -> Reconciliation:
        """The latest reconciliation this process finished (``ran`` False when none)."""
        return self._reconciler.result

    def free_bytes(self, *, fresh: bool = False) -> int | None:
        """Bytes available on the store's filesystem (cached for a second), None if unknown."""
        return self._parts.health.free_bytes(fresh=fresh) if self._parts.store else None

    def used_bytes(self) -> int:
        """Bytes the store occupies (SQLite pages plus value files), 0 when unavailable."""
        return self._admin.used_bytes()

    def budget_bytes(self) -> int:
        """The effective budget: ``fixed`` as configured, ``auto`` recomputed from free space."""
        return self._parts.health.budget_bytes() if self._parts.store else 0

    # ------------------------------------------------------------------ pins and listeners

    def add_write_listener(
        self, callback: Callable[[PrefixRecord, Mapping[bytes, bytes]], None]
    ) -> None:
        """Call ``callback(record, stored)`` from the writer thread after each record is
        stored (``stored``: its new pages' bytes as L3 keeps them). A failing callback is
        counted (``internal_errors``), never fails the write."""
        self._recorder.listeners.append(callback)

    def add_removal_listener(self, callback: Callable[[bytes], None]) -> None:
        """Call ``callback(page_key)`` when this process removes, evicts or quarantines a page."""
        self._parts.listeners.append(callback)

    def pin(self, keys: Sequence[bytes]) -> bytes:
        """Mark pages in use for every process until :meth:`unpin` (or this process ends)."""
        return self._pins.pin(keys)

    def unpin(self, token: bytes) -> None:
        """Release a pin taken with :meth:`pin`."""
        self._pins.unpin(token)

    @contextlib.contextmanager
    def pinned(self, keys: Sequence[bytes]) -> Iterator[bytes]:
        """``with tier.pinned(keys):`` — :meth:`pin` for the duration of the block."""
        token = self.pin(keys)
        try:
            yield token
        finally:
            self.unpin(token)

    # ------------------------------------------------------------------ lookup API

    def contains(self, key: bytes, *, queued: bool = False) -> bool:
        """True when the store has page ``key`` (metadata only; read() still verifies it).

        With ``queued``, pages of records waiting for the writer count too.
        """
        if not self.serving:
            return False
        if queued and self._writer.queued(key):
            return True
        try:
            return self._parts.store is not None and self._parts.store.contains(META + key)
        except Exception as exc:
            self._parts.health.fault(exc, "contains")
            return False

    def children(self, parent: bytes, *, queued: bool = False) -> list[tuple[bytes, bytes]]:
        """Pages stored after node ``parent``: ``(page key, tokens as int32 bytes)``; a damaged
        or unauthentic index answers nothing. With ``queued``, also pages waiting to be written
        (:meth:`fetch` serves them).
        """
        if not self.serving:
            return []
        try:
            out = [(c.key, c.tokens) for c in self._tree.children(parent)]
        except Exception as exc:
            self._parts.health.fault(exc, "children")
            out = []
        if queued:
            known = {key for key, _ in out}
            out += [kt for kt in self._writer.queued_children(parent) if kt[0] not in known]
        return out

    def _meta_field(self, key: bytes, where: str) -> tuple[bytes, int] | None:
        return self._reader.meta_field(key, where) if self.serving else None

    def digest(self, key: bytes) -> bytes | None:
        """The stored digest of page ``key`` (metadata only), or None if the store lacks it."""
        found = self._meta_field(key, "digest")
        return None if found is None else found[0]

    def refcount(self, key: bytes) -> int:
        """How many stored prefixes reference page ``key`` (0 when absent)."""
        found = self._meta_field(key, "refcount")
        return 0 if found is None else found[1]

    def prepare_reads(self, nbytes: int) -> None:
        """Ready the calling thread for reads of up to ``nbytes`` of pages ahead of a
        restore's first read: its read buffer committed, its database connection open
        (``Reader.prepare``). Never raises."""
        if self.serving:
            self._reader.prepare(nbytes)

    def note_miss(self) -> None:
        """Count a lookup that found nothing in L3 without calling :meth:`read`."""
        self._parts.counters.add("misses")

    def read(self, keys: Sequence[bytes]) -> list[bytes | memoryview]:
        """Decoded pages of the longest prefix of ``keys`` that is stored and verifies (see
        ``reader.py`` for what happens to a page that does not, and how long a view stays
        valid); :meth:`fetch` also serves pages still waiting for the writer. Never raises."""
        result = self._stored(keys)
        self._count_read(len(result.pages), sum(m.size for m in result.metas))
        return result.pages

    def _stored(self, keys: Sequence[bytes]) -> ReadResult:
        """The stored prefix of ``keys``, uncounted."""
        if not self.serving or not keys:
            return ReadResult([], [])
        return self._reader.read(keys)

    def _count_read(self, pages: int, n_bytes: int, in_flight: int = 0) -> None:
        counters = self._parts.counters
        if not pages:
            counters.add("misses")
            return
        self._parts.health.ok()
        counters.add("hits")
        counters.add("pages_read", pages)
        counters.add("bytes_read", n_bytes)
        if in_flight:
            counters.add("pages_read_in_flight", in_flight)
        if self._parts.rw_ok:
            self._writer.start()  # stores the hits

    def holds(self, key: bytes, *, queued: bool = False) -> bool:
        """:meth:`contains` under the page-tier protocol's name (with ``queued``, a page of a
        record waiting for the writer is held: :meth:`fetch` serves it)."""
        return self.contains(key, queued=queued)

    def fetch(self, keys: Sequence[bytes]) -> list[bytes | memoryview]:
        """Pages of the longest prefix of ``keys`` held: stored ones as :meth:`read` serves
        them, then those of records still waiting for the writer, made from the capture they
        will be cut from (exact bytes, checked against the size their record announced). A
        page whose record the writer is writing is read once the write ends. So a prefix in
        flight between the request path and the disk stays servable: a lookup racing a write
        is a hit. Never raises."""
        return [page for page, _ in self.fetch_digested(keys, queued=True)]

    def fetch_digested(
        self, keys: Sequence[bytes], *, queued: bool = False
    ) -> list[tuple[bytes | memoryview, bytes | None]]:
        """:meth:`read` (stored pages only; with ``queued``, what :meth:`fetch` serves), each
        page with the digest its read verified: what a mirror (L2) keeps beside a copy. Asking
        :meth:`digest` afterwards could answer for bytes written since. A page made from a
        record still waiting for the writer has no digest yet (None: hashing it here would
        cost the request path a pass over its bytes). Never raises."""
        if not queued:
            result = self._stored(keys)
            self._count_read(len(result.pages), sum(m.size for m in result.metas))
            return [(p, m.digest) for p, m in zip(result.pages, result.metas, strict=False)]
        writer = self._writer
        if self.serving and keys:
            writer.wait_written(keys)
        result = self._stored(keys)
        pages: list[bytes | memoryview] = list(result.pages)
        digests: list[bytes | None] = [m.digest for m in result.metas[: len(pages)]]
        n_bytes = sum(m.size for m in result.metas)
        in_flight = 0
        for _ in range(2):
            if len(pages) == len(keys) or not self.serving:
                break
            made, busy = writer.read_waiting(keys[len(pages) :])
            pages += made
            digests += [None] * len(made)
            in_flight += len(made)
            n_bytes += sum(len(page) for page in made)
            if not busy:
                break
            # the writer took the record since the store was read: read the rest once written
            # (the next read reuses this thread's buffer, so the views read so far are copied)
            pages = [page if isinstance(page, bytes) else bytes(page) for page in pages]
            rest = keys[len(pages) :]
            writer.wait_written(rest)
            more = self._stored(rest)
            pages += more.pages
            digests += [m.digest for m in more.metas[: len(more.pages)]]
            n_bytes += sum(m.size for m in more.metas)
        self._count_read(len(pages), n_bytes, in_flight)
        return list(zip(pages, digests, strict=True))

    # ------------------------------------------------------------------ restore points
    # (``points.py``; the ``PointTier`` protocol of ``skippy_llama.restore_points``)

    def point_lengths(self, root: bytes) -> list[int]:
        """Token counts of the restore points stored under ``root``. Never raises."""
        return self._points.lengths(root)

    def get_point(self, root: bytes, tokens: npt.NDArray[np.int32]) -> RestorePoint | None:
        """The verified restore point after exactly ``tokens``; None when absent or damaged
        (quarantined and counted). Never raises."""
        return self._points.get(root, tokens)

    def point_metas(self) -> list[PointMeta]:
        """What the store lists about every restore point (reads only; damaged rows skipped)."""
        return self._points.metas() if self.serving else []

    def read_point(self, meta: PointMeta) -> RestorePoint | None:
        """The verified point ``meta`` lists (as :meth:`get_point`); None when gone or
        damaged. Never raises."""
        return self._points.get_key(meta.root, meta.n_tokens, meta.key)

    def put_point(self, root: bytes, point: RestorePoint, owner: PointOwner) -> bool:
        """Store a restore point (synchronously: records are one state each); False when
        refused. Never raises."""
        return self._points.put(root, point, owner)

    def offer(self, record: PrefixRecord) -> bool:
        """:meth:`record` under the page-tier protocol's name."""
        return self.record(record)

    def promote(
        self, key: bytes, payload: bytes | memoryview, prefix_tokens: int, digest: bytes | None
    ) -> None:
        """L3 is the deepest local tier: nothing is promoted into it."""

    def record(self, rec: PrefixRecord) -> bool:
        """Queue ``rec`` for the background writer; never waits on disk. False (counted) when
        the tier cannot write now or the queue is full (the record is then dropped)."""
        parts = self._parts
        if not parts.rw_ok or self._closed:
            rec.drop()
            parts.counters.add("dropped_writes")
            return False
        if parts.health.state == "read_only_low_space":
            parts.health.refresh()  # the space may have come back (rate-limited statvfs)
        if not parts.health.writable:
            rec.drop()
            parts.counters.add("dropped_writes")
            if parts.health.state == "read_only_low_space":
                parts.counters.add("dropped_low_space")
            return False
        return self._writer.record(rec)

    def defer(self, run: Callable[[], object], nbytes: int) -> bool:
        """Call ``run`` on the background writer after the records queued before it (the remote
        tier pushes restore points so, as it pushes pages from here after L3 stored them);
        ``nbytes`` it holds meanwhile count against the writer's byte bound. False when the
        tier is closed or the queue is full: nothing is queued, the caller counts the drop."""
        if self._closed or self._parts.store is None:
            return False
        return self._writer.job(run, nbytes)

    # ------------------------------------------------------------------ flush and close

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued records are written and hits/counters stored; False on timeout."""
        if self._parts.store is None:
            return True
        done = self._writer.flush(timeout)
        self._maintenance.run()
        return done

    def close(self, timeout: float = 10.0) -> None:
        """Flush pending writes (within ``timeout``), stop the writer, close. Idempotent; also
        run at interpreter exit unless ``close_at_exit=False``."""
        if self._closed:
            return
        store = self._parts.store
        if store is not None:
            self.flush(timeout)
        self._closed = True
        self._writer.stop()
        self._reader.release()
        if store is not None:
            with contextlib.suppress(Exception):
                self._maintenance.run()
            with contextlib.suppress(Exception):
                self._reconciler.abandon()  # the next process resumes the walk
            with contextlib.suppress(Exception):
                self._sessions.close()
            with contextlib.suppress(Exception):
                store.close()
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ operator API

    def status(self) -> DiskStatus:
        """Effective state, usage, activity (all processes and this one), the latest
        reconciliation, and the inventory per model identity. Writes nothing."""
        return self._admin.status(self._reconciler.result)

    def codec_summary(self) -> dict[str, Any]:
        """The page codec: configured, stored manifests per codec, codec counters (``admin``)."""
        return self._admin.codec_summary()

    def model_identities(self) -> dict[str, str]:
        """Model identities that have manifests in the store, with their model names."""
        return self._admin.model_identities()

    def check_model_identity(self, model_identity: str | None) -> None:
        """Raise ConfigError for a blank model identity or one the store has no entries for."""
        self._admin.check_model_identity(model_identity)

    def reconcile(self, *, verify: bool = False) -> Reconciliation:
        """Reconcile the whole store now (see ``reconcile.py``); with ``verify``, digests too.

        Raises:
            ConfigError: the store is unavailable or opened read-only.
        """
        self._admin.require_store("reconcile")
        self.flush()
        # not under the store lock: each batch takes it for its transaction (a background step
        # holds the walk's own lock, then the store lock; the other order would deadlock)
        return self._reconciler.run(verify=verify)

    def prune(
        self, target_bytes: int | None = None, model_identity: str | None = None
    ) -> PruneResult:
        """Evict by the store's policy down to ``target_bytes``, or all entries of one model
        (both: that model's entries down to the target); with neither, apply the budget now.
        Pages in use are kept.

        Raises:
            ConfigError: blank or unknown model identity, or the store is unavailable.
        """
        self._admin.require_store("prune")
        self.check_model_identity(model_identity)
        self.flush()
        result = self._admin.prune(target_bytes, model_identity)
        self._maintenance.run()
        return result

    def clear(self, model_identity: str | None = None) -> ClearResult:
        """Remove every manifest (of one model, or all); pinned pages stay until released.

        Raises:
            ConfigError: blank or unknown model identity, or the store is unavailable.
        """
        self._admin.require_store("clear")
        self.check_model_identity(model_identity)
        self.flush()
        result = self._admin.clear(model_identity)
        self._maintenance.run()
        return result
