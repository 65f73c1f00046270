"""L3 activity counters: this process's, and the totals every process adds to the store.

Counting is in memory (one lock, no I/O on the request path); the writer thread adds the
unflushed part to the store's ``activity`` row now and then, inside its own transaction. The
stored row is input like any other: names this build does not know and values that are not
non-negative integers are ignored.
"""

from __future__ import annotations

import threading
from collections import Counter

from ...errors import StoreDataError
from ..records import DiskActivity
from .schema import ACTIVITY, dump_json, load_json
from .store import DiskStore, StoreReader


class Counters:
    """This process's counters since open, and the part not yet added to the store's totals."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._unflushed: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n
                self._unflushed[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def process(self) -> DiskActivity:
        """This process's activity since open."""
        with self._lock:
            return DiskActivity.from_counts(dict(self._counts))

    def pending(self) -> Counter[str]:
        """Counts not yet in the store (status adds them to the stored totals)."""
        with self._lock:
            return Counter(self._unflushed)

    def take(self) -> Counter[str]:
        """Hand the unflushed counts to a flush (see :meth:`give_back` when it fails)."""
        with self._lock:
            deltas, self._unflushed = self._unflushed, Counter()
        return deltas

    def give_back(self, deltas: Counter[str]) -> None:
        """A flush failed: keep its counts for the next one."""
        with self._lock:
            self._unflushed.update(deltas)


def stored_activity(store: StoreReader) -> Counter[str]:
    """The totals every process added to the store (empty when absent or damaged)."""
    raw = store.get(ACTIVITY)
    if not raw:
        return Counter()
    try:
        data = load_json(raw, "activity")
    except StoreDataError:
        return Counter()
    return Counter(
        {k: v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}
    )


def add_to_store(store: DiskStore, deltas: Counter[str]) -> None:
    """Add ``deltas`` to the stored totals; call inside a store transaction."""
    if not deltas:
        return
    totals = stored_activity(store)
    totals.update(deltas)
    store.set(ACTIVITY, dump_json(dict(totals)))
