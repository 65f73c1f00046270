"""What the L3 modules share: the open store, its health, counters, signer, lock and listeners.

One :class:`Parts` is built per open tier and handed to each module, so none of them reaches into
another's attributes and each can be built alone in a test.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ...config import L3Settings
from ...errors import UntrustedDirectoryError
from .auth import Signer, check_directory
from .health import Health
from .stats import Counters
from .store import DiskStore, ReadOnlyStore, StoreReader

log = logging.getLogger("skippy_llama.tiers.l3")


@dataclass
class Parts:
    """The shared state of one open tier.

    ``lock`` serializes this process's store transactions (SQLite would make a second thread
    busy-wait on its own process otherwise); ``listeners`` hear of every page this process
    removes, evicts or quarantines (L2 drops its copy).
    """

    settings: L3Settings
    health: Health
    counters: Counters
    signer: Signer
    store: StoreReader | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    listeners: list[Callable[[bytes], None]] = field(default_factory=list)

    untrusted_seen: int = 0  # the store's untrusted-row count already added to ``counters``

    def sync_untrusted(self) -> None:
        """Add the rows the store dropped as untrusted since the last call to the counters (the
        store counts them where it meets them, in any module's read)."""
        store = self.store
        if store is not None and store.untrusted_rows > self.untrusted_seen:
            self.counters.add("untrusted_rows", store.untrusted_rows - self.untrusted_seen)
            self.untrusted_seen = store.untrusted_rows

    @property
    def rw(self) -> DiskStore:
        """The store, for a write; only called where the caller checked it is writable."""
        store = self.store
        if not isinstance(store, DiskStore):
            raise RuntimeError("L3 write on a store opened read-only or not open (a bug)")
        return store

    @property
    def rw_ok(self) -> bool:
        """True when the store is open read-write (repairs and writes may run)."""
        return self.store is not None and self.store.writable

    def removed(self, keys: Iterable[bytes]) -> None:
        """Tell the listeners that pages left the store."""
        for key in keys:
            for callback in self.listeners:
                try:
                    callback(key)
                except Exception:  # a listener bug must not break the store
                    log.exception("L3 removal listener failed")

    def open(self, timeout: float, *, read_only: bool) -> bool:
        """Check the directory and open the store; False (state ``degraded``, with the reason)
        when it is refused or unusable, or, read-only, when there is no store yet."""
        health, directory = self.health, Path(self.settings.directory)
        health.set("active", None)
        try:
            exists = check_directory(
                directory, shared_group=self.settings.shared_group, create=not read_only
            )
        except UntrustedDirectoryError as exc:
            health.unavailable("storage_untrusted", str(exc))
            return False
        except OSError:
            exists = True  # an unusable path is reported below as storage_unavailable
        try:
            if read_only:
                if not exists or not (directory / "cache.db").exists():
                    return False  # no store yet: status reports an empty one
                self.store = ReadOnlyStore(directory, timeout=timeout)
            else:
                self.store = DiskStore(directory, timeout=timeout)
            self.store.volume()  # proves the database is readable
        except Exception as exc:  # any failure to open is "storage unavailable", never a crash
            self.store = None
            health.unavailable("storage_unavailable", f"{type(exc).__name__}: {exc}")
            return False
        health.available = True
        return True
