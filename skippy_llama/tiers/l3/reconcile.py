"""Reconciliation: remove what interrupted writes left and quarantine what fails validation,
in small batches, in the background, never on the request path.

It runs when a store was never reconciled, when the last walk is older than
:data:`RECONCILE_EVERY_S`, or when a process died with the store open (``sessions.py``), and is
resumable: one process at a time holds a lease that also records how far it got, so a process
that stops (or is killed) mid-walk leaves the rest to the next one. Opening a store therefore
costs the same at 1k or 50k pages.

Phases, each a walk over one key range in batches of ``BATCH`` keys, every decision taken
inside a short transaction on fresh reads with pinned pages left alone (safe while other
processes use the store): untrusted rows; stale pins; manifests (damaged or foreign ones are
quarantined, those with a missing page cut back); page metadata (damaged: quarantined; stale
owners dropped; orphans removed; payload sizes, or digests with ``verify``, checked);
payloads without metadata; child-index entries; value files no row names.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields

from ...errors import StoreDataError, TransientReadError
from ..records import Reconciliation
from .context import Parts
from .pins import Pins, my_owner, owner_alive
from .schema import (
    DATA,
    KIDS,
    MAN,
    META,
    QUAR,
    RECONCILER,
    RECONCILIATION,
    PageMeta,
    Pin,
    dump_json,
    load_json,
    unpack_children,
)
from .schema import pack_children as _pack_children
from .tree import BATCH, Tree, payload_digest

#: A store is walked at most this often when nothing crashed.
RECONCILE_EVERY_S = 3600.0
#: A reconciler that has not renewed its lease for this long is gone; another one continues.
LEASE_S = 120.0
#: Value files without a row are removed only when older than this: a concurrent writer's file
#: exists briefly before its row does.
ORPHAN_FILE_GRACE_S = 600.0
PHASES = ("untrusted", "pins", "manifests", "metas", "payloads", "kids", "files")
_COUNTS = {f.name for f in fields(Reconciliation)}


@dataclass
class _Progress:
    verify: bool
    whole: bool = False  # walk everything from the start (not a left walk's remainder)
    phase: int = 0
    after: bytes | None = None
    counts: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)


def stored_reconciliation(raw: bytes | None) -> Reconciliation | None:
    """The reconciliation record of a store (None when absent or damaged)."""
    if not raw:
        return None
    try:
        data = load_json(raw, "reconciliation")
        return Reconciliation(**{k: v for k, v in data.items() if k in _COUNTS})
    except (StoreDataError, TypeError, ValueError):
        return None


class Reconciler:
    """Incremental reconciliation of one store (see the module docstring)."""

    def __init__(self, parts: Parts, tree: Tree, pins: Pins) -> None:
        self.parts = parts
        self.tree = tree
        self.pins = pins
        self.result = Reconciliation()  # the latest one this process finished
        self._run: _Progress | None = None
        self._token = os.urandom(8)  # this tier's lease (several tiers may share a process)
        self._step_lock = threading.Lock()

    @property
    def pending(self) -> bool:
        return self._run is not None

    def _lease(self) -> tuple[Pin | None, bytes | None, _Progress | None]:
        """The lease row: its holder (None when released), the holder's token, the progress."""
        raw = self.parts.rw.get(RECONCILER)
        if raw is None:
            return None, None, None
        try:
            data = load_json(raw, "reconciler lease")
            holder = data.get("owner")
            owner = None if holder is None else Pin.unpack(dump_json(holder))
            token = bytes.fromhex(str(data.get("token", "")))
            after = data.get("after")
            progress = _Progress(
                verify=bool(data.get("verify")),
                phase=min(max(int(data.get("phase", 0)), 0), len(PHASES) - 1),
                after=bytes.fromhex(after) if isinstance(after, str) else None,
                counts=Counter(
                    {k: int(v) for k, v in dict(data.get("counts", {})).items() if k in _COUNTS}
                ),
            )
        except (StoreDataError, KeyError, TypeError, ValueError):
            return None, None, None  # a damaged lease is taken over from the start
        return owner, token, progress

    def _held_elsewhere(self, owner: Pin | None, token: bytes | None) -> bool:
        return (
            owner is not None and token != self._token and owner_alive(owner, time.time(), LEASE_S)
        )

    def due(self, *, crashed: bool) -> bool:
        """Whether this store needs a walk now (cheap: two rows)."""
        owner, token, progress = self._lease()
        if progress is not None:
            return not self._held_elsewhere(owner, token)  # a walk was left unfinished
        if crashed:
            return True
        last = stored_reconciliation(self.parts.rw.get(RECONCILIATION))
        return last is None or last.at is None or time.time() - last.at >= RECONCILE_EVERY_S

    def start(self, *, verify: bool = False) -> None:
        self._run = _Progress(verify=verify)

    def holds_nothing(self) -> bool:
        """True when the store has no manifest, page or index row (a new store): a walk of it
        costs a few empty range queries, so it runs at once instead of in the background."""
        store = self.parts.rw
        return not any(store.keys(kind, limit=1) for kind in (MAN, KIDS, META, DATA))

    def abandon(self) -> None:
        """Stop this process's walk; its progress stays in the lease for the next one."""
        if self._run is not None:
            self._run = None
            with self.parts.lock, self.parts.rw.transact():
                _owner, token, progress = self._lease()
                if progress is not None and token == self._token:
                    self._write_lease(progress, held=False)

    def run(self, *, verify: bool = False) -> Reconciliation:
        """Reconcile the whole store now (an operator call; tests)."""
        with self._step_lock:
            self._run = _Progress(verify=verify, whole=True)
        while self.step():
            pass
        return self.result

    def _write_lease(self, run: _Progress, *, held: bool) -> None:
        lease = {
            "owner": load_json(my_owner().pack(), "pin") if held else None,
            "token": self._token.hex(),
            "phase": run.phase,
            "after": run.after.hex() if run.after else None,
            "verify": run.verify,
            "counts": dict(run.counts),
        }
        self.parts.rw.set(RECONCILER, dump_json(lease))

    def step(self) -> bool:
        """One batch; True while more remain.

        Steps are serialized: an operator's :meth:`run` and the writer thread's background steps
        advance one walk, never the same batch twice (two threads once pushed the phase past the
        last one).
        """
        with self._step_lock:
            return self._step()

    def _step(self) -> bool:
        run = self._run
        if run is None:
            return False
        parts = self.parts
        store = parts.rw
        with parts.lock, store.transact():
            owner, token, left = self._lease()
            # an operator's whole walk takes the lease over (every decision is taken on fresh
            # reads in a transaction, so two walks at once are safe, only wasteful)
            if self._held_elsewhere(owner, token) and not run.whole:
                self._run = None  # another process is on it
                return False
            if left is not None and token != self._token and not run.whole:
                left.verify = left.verify or run.verify
                run = self._run = left  # continue where a gone reconciler stopped
            self._write_lease(run, held=True)
        phase = PHASES[run.phase]
        done = getattr(self, f"_{phase}")(run)
        if done:
            run.phase += 1
            run.after = None
        with parts.lock, store.transact():
            if run.phase < len(PHASES):
                self._write_lease(run, held=True)
                return True
            self.result = Reconciliation(
                ran=True,
                at=time.time(),
                pid=os.getpid(),
                seconds=round(time.monotonic() - run.started, 6),
                verify="digests" if run.verify else "sizes",
                quarantined_total=store.count(QUAR),
                **{k: v for k, v in run.counts.items() if k in _COUNTS},
            )
            store.set(RECONCILIATION, dump_json(self.result.to_json()))
            store.delete(RECONCILER)
        if self._run is run:
            self._run = None
        return False

    def _batch(self, run: _Progress, kind: bytes) -> list[bytes]:
        keys = self.parts.rw.keys(kind, after=run.after, limit=BATCH)
        if keys:
            run.after = keys[-1]
        return keys

    # ------------------------------------------------------------------ phases

    def _untrusted(self, run: _Progress) -> bool:
        store = self.parts.rw
        with self.parts.lock, store.transact():
            dropped = store.sweep_untrusted()
            run.counts["untrusted_rows"] += dropped
            run.counts["unknown_keys"] = store.unknown_keys()
        return True

    def _pins(self, run: _Progress) -> bool:
        before = self.pins.stale_removed
        with self.parts.lock, self.parts.rw.transact():
            self.pins.live(local=False)  # deletes pins of processes that are gone
        run.counts["stale_pins_removed"] += self.pins.stale_removed - before
        return True

    def _manifests(self, run: _Progress) -> bool:
        parts, store, tree = self.parts, self.parts.rw, self.tree
        keys = self._batch(run, MAN)
        removed: list[bytes] = []
        with parts.lock, store.transact():
            pins = self.pins.live()
            for key in keys:
                try:
                    man = tree.manifest(key[1:])
                except StoreDataError as exc:
                    tree.record_quarantine(key, str(exc))
                    store.delete(key)
                    run.counts["manifests_quarantined"] += 1
                    parts.counters.add("damaged_manifests")
                    continue
                if man is None:
                    continue
                bad = next(
                    (
                        i
                        for i, k in enumerate(man.keys)
                        if not store.contains(META + k) or not store.contains(DATA + k)
                    ),
                    None,
                )
                if bad is not None:
                    removed += tree.cut_manifest(man, bad, pins)
                    run.counts["manifests_removed"] += 1
        parts.removed(removed)
        return len(keys) < BATCH

    def _metas(self, run: _Progress) -> bool:
        parts, store, tree = self.parts, self.parts.rw, self.tree
        keys = self._batch(run, META)
        removed: list[bytes] = []
        checks: list[tuple[bytes, PageMeta]] = []
        with parts.lock, store.transact():
            pins = self.pins.live()
            for key in keys:
                page, raw = key[1:], store.get(key)
                if raw is None or page in pins:
                    continue
                try:
                    meta = PageMeta.unpack(raw)
                except StoreDataError as exc:
                    tree.record_quarantine(key, str(exc))
                    tree.delete_page(page, None)
                    removed.append(page)
                    run.counts["quarantined"] += 1
                    continue
                owners = [o for o in meta.owners if store.contains(MAN + o)]
                if not owners:
                    tree.delete_page(page, meta)
                    removed.append(page)
                    run.counts["orphan_pages_removed"] += 1
                    continue
                if owners != meta.owners:
                    meta.owners = owners
                    store.set(key, meta.pack())
                checks.append((page, meta))
        parts.removed(removed)
        for page, meta in checks:  # outside the lock: reads only
            run.counts["pages_checked"] += 1
            problem = self._check(page, meta, run.verify)
            if problem == "missing":
                parts.counters.add("missing_pages")
                tree.cut_back(page, "missing")
            elif problem is not None:
                tree.quarantine(page, problem)
                run.counts["quarantined"] += 1
        return len(keys) < BATCH

    def _check(self, page: bytes, meta: PageMeta, verify: bool) -> str | None:
        """'missing' | 'truncated' | 'size' | 'digest_mismatch' | None (fine or unknown now)."""
        store = self.parts.rw
        try:
            if verify:
                payload = store.get(DATA + page)
                size = None if payload is None else len(payload)
            else:
                size = store.size_of(DATA + page)
                payload = None
        except (TransientReadError, OSError) as exc:
            self.parts.health.fault(exc, "reconciliation check")
            return None  # unreadable now is not absent
        except StoreDataError:
            return None
        if size is None:
            return "missing"
        if size != meta.size:
            return "truncated" if size < meta.size else "size"
        if payload is not None and payload_digest(payload) != meta.digest:
            return "digest_mismatch"
        return None

    def _payloads(self, run: _Progress) -> bool:
        store = self.parts.rw
        keys = self._batch(run, DATA)
        with self.parts.lock, store.transact():
            pins = self.pins.live()
            for key in keys:
                page = key[1:]
                if store.contains(META + page) or page in pins:
                    continue  # pinned: a write in flight elsewhere
                store.delete(key)
                run.counts["orphan_pages_removed"] += 1
        return len(keys) < BATCH

    def _kids(self, run: _Progress) -> bool:
        store = self.parts.rw
        keys = self._batch(run, KIDS)
        with self.parts.lock, store.transact():
            for key in keys:
                raw = store.get(key)
                if raw is None:
                    continue
                try:
                    entries = unpack_children(raw)
                except StoreDataError:
                    store.delete(key)
                    run.counts["index_fixed"] += 1
                    continue
                kept = [c for c in entries if store.contains(META + c.key)]
                if len(kept) != len(entries):
                    run.counts["index_fixed"] += len(entries) - len(kept)
                    if kept:
                        store.set(key, _pack_children(kept))
                    else:
                        store.delete(key)
        return len(keys) < BATCH

    def _files(self, run: _Progress) -> bool:
        """Delete value files no row names (an add() interrupted before its row landed)."""
        store = self.parts.rw
        referenced = store.referenced_files()
        cutoff = time.time() - ORPHAN_FILE_GRACE_S
        root = str(store.directory)
        for folder, _dirs, files in os.walk(root):
            for name in files:
                if not name.endswith(".val"):
                    continue
                path = os.path.join(folder, name)
                if os.path.normpath(os.path.relpath(path, root)) in referenced:
                    continue
                with contextlib.suppress(OSError):
                    if os.lstat(path).st_mtime < cutoff:
                        os.remove(path)
                        run.counts["orphan_files_removed"] += 1
        return True
