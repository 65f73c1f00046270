"""Sessions: which processes have the store open read-write, to tell a clean restart from a crash.

Each read-write tier registers a session row (pid, process start time, host, time) when it opens,
renews it while it runs and deletes it when it closes. A session whose process is gone (or whose
lease ran out) means that process died with the store open: a killed writer may have left a
payload without metadata or a value file without a row, so the next process reconciles now
instead of waiting for the periodic walk. Opening costs a few rows, whatever the store's size.
"""

from __future__ import annotations

import os
import time

from ...errors import StoreDataError
from .context import Parts
from .pins import my_owner, owner_alive
from .schema import INFO, SESSION, Pin

#: A session is renewed this often (well inside the lease of ``pins.PIN_LEASE_S``).
SESSION_RENEW_S = 300.0


class Sessions:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.key = SESSION + os.urandom(8).hex().encode()
        self._renewed = 0.0
        self.open_ = False

    def open(self) -> bool:
        """Register this process; True when another one died with the store open."""
        parts = self.parts
        store = parts.rw
        crashed = False
        now = time.time()
        with parts.lock, store.transact():
            for key in store.keys(INFO):
                if not key.startswith(SESSION):
                    continue
                raw = store.get(key)
                try:
                    alive = raw is not None and owner_alive(Pin.unpack(raw), now)
                except StoreDataError:
                    alive = False
                if not alive:
                    store.delete(key)
                    crashed = True
            store.set(self.key, my_owner().pack())
        self._renewed = time.monotonic()
        self.open_ = True
        return crashed

    def renew(self) -> None:
        if not self.open_ or time.monotonic() - self._renewed < SESSION_RENEW_S:
            return
        parts = self.parts
        with parts.lock:
            parts.rw.set(self.key, my_owner().pack())
        self._renewed = time.monotonic()

    def close(self) -> None:
        if self.open_:
            self.open_ = False
            with self.parts.lock:
                self.parts.rw.delete(self.key)
