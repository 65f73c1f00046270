"""Housekeeping the writer thread does when idle: store hits, counters and learned costs, renew
the session.

Reads note their hits in memory; here they land in the pages' metadata (``hits``, ``last_used``,
what eviction policies rank by) in one transaction per flush, together with this process's
counters added to the store's totals and its measured costs (``learned.py``, when they changed). A failed flush keeps the counters for the next one; hits
are best effort.
"""

from __future__ import annotations

import time

from ...admission import AdmissionPolicy
from ...errors import StoreDataError
from .context import Parts
from .learned import LearnedCosts
from .reader import Touches
from .schema import META
from .sessions import Sessions
from .stats import add_to_store
from .tree import Tree

#: Hits after which a page counts as promoted out of probation (the ``promotions`` counter).
PROTECT_AFTER_HITS = 2
#: The writer flushes hits and counters this often when idle.
MAINTAIN_EVERY_S = 1.0


class Maintenance:
    def __init__(
        self,
        parts: Parts,
        tree: Tree,
        touches: Touches,
        sessions: Sessions,
        admission: AdmissionPolicy | None,
        learned: LearnedCosts | None = None,
    ) -> None:
        self.parts = parts
        self.tree = tree
        self.touches = touches
        self.sessions = sessions
        self.admission = admission
        self.learned = learned
        self.last = time.monotonic()

    @property
    def due(self) -> bool:
        return time.monotonic() - self.last >= MAINTAIN_EVERY_S

    def run(self) -> None:
        """Store pending hits and counters now."""
        self.last = time.monotonic()
        parts = self.parts
        if not parts.rw_ok:
            return
        touches = self.touches.take()
        parts.sync_untrusted()
        deltas = parts.counters.take()
        store = parts.rw
        promoted = reused = 0
        try:
            with parts.lock, store.transact():
                for key, (when, hits) in touches.items():
                    try:
                        meta = self.tree.meta(key)
                    except StoreDataError:
                        continue  # reconciliation quarantines it
                    if meta is None:
                        continue
                    before = meta.hits
                    meta.hits += hits
                    meta.last_used = max(meta.last_used, when)
                    promoted += int(before < PROTECT_AFTER_HITS <= meta.hits)
                    # a page that ends a stored prefix, hit for the first time: reuse proven
                    reused += int(before == 0 and key in meta.owners)
                    store.set(META + key, meta.pack())
                add_to_store(store, deltas)
                if self.learned is not None:
                    self.learned.save(store)
        except Exception as exc:
            parts.counters.give_back(deltas)
            if self.learned is not None:
                self.learned.unsaved()
            parts.health.fault(exc, "maintain")
            return
        parts.counters.add("promotions", promoted)
        if self.admission is not None:
            for _ in range(reused):
                self.admission.observe_reused()
        self.sessions.renew()
