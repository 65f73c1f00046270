"""L3's state, its budget and free space, and how faults change them.

States: ``off``, ``active``, ``read_only_low_space`` (reads serve, writes are refused),
``degraded`` with a reason (``storage_unavailable``, ``storage_untrusted``,
``budget_below_entry_floor``, ``storage_error``). ``storage_error`` keeps serving and writing
(the fault may be transient) and clears at the next success.

A fault is classified once, here: lock contention is counted apart, a full disk turns the store
read-only, other storage faults (I/O, SQLite, damaged data) count and after a few in a row
degrade it, and anything else is a bug in L3's own code: logged as an error with its traceback
and counted as ``internal_errors``, never passed off as a storage fault.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ...config import L3Settings
from ..records import DiskState
from .stats import Counters
from .store import is_lock_error, is_no_space, is_storage_fault

log = logging.getLogger("skippy_llama.tiers.l3")

MiB = 1 << 20
GiB = 1 << 30
#: Smallest useful budget: below it one typical entry (a 2k-token prefix of a small model is
#: ~50 MB) would not fit, and the tier would only churn.
ENTRY_FLOOR = 64 * MiB
#: ``auto`` budget: min(AUTO_FRACTION × (free + managed), free − minimum_free, AUTO_CAP).
AUTO_FRACTION = 0.20
AUTO_CAP = 64 * GiB
#: Consecutive storage errors before the state turns ``degraded`` / ``storage_error``.
FAULTS_TO_DEGRADE = 3
#: Free space is re-read at most this often on hot paths.
FREE_SPACE_TTL_S = 1.0

SERVING: frozenset[str] = frozenset({"active", "read_only_low_space", "storage_error"})
WRITABLE: frozenset[str] = frozenset({"active", "storage_error"})


def statvfs_free(path: str) -> int:
    """Bytes available to unprivileged users on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def existing_parent(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (free space of a store not created yet)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


class Health:
    """State, budget and fault accounting of one open store.

    Args:
        settings: the ``l3`` settings (mode, budget, minimum_free).
        counters: where faults are counted.
        disk_free: ``path -> available bytes`` (statvfs by default; injectable for tests).
        used_bytes: the store's current size (0 while unavailable).
    """

    def __init__(
        self,
        settings: L3Settings,
        counters: Counters,
        *,
        disk_free: Callable[[str], int] | None = None,
        used_bytes: Callable[[], int] = lambda: 0,
    ) -> None:
        self.settings = settings
        self.directory = Path(settings.directory)
        self.counters = counters
        self._disk_free = disk_free or statvfs_free
        self._used = used_bytes
        self.fixed_budget = settings.budget if settings.mode == "fixed" else None
        self.state: DiskState = "off"
        self.reason: str | None = None
        self.error: str | None = None  # why the store is unavailable, for status output
        self.available = False  # a store is open
        self._faults = 0
        self._free: tuple[float, int] | None = None
        # free bytes when a write failed for a full disk: read-only until space really grows
        # (statvfs may report room a quota or a reserved-blocks filesystem does not give)
        self._full_at: int | None = None
        self._lock = threading.Lock()

    def set(self, state: DiskState, reason: str | None) -> None:
        if (state, reason) != (self.state, self.reason):
            if state != "active" and self.state != "off":
                log.warning("L3 state %s (%s) at %s", state, reason, self.directory)
            self.state, self.reason = state, reason

    def unavailable(self, reason: str, error: str) -> None:
        """The store cannot be used at all (fixed for the life of this tier)."""
        self.available = False
        self.set("degraded", reason)
        self.error = error

    @property
    def mode(self) -> str:
        """The state, with ``degraded`` replaced by its reason."""
        return self.reason if self.state == "degraded" and self.reason else self.state

    @property
    def serving(self) -> bool:
        return self.available and self.mode in SERVING

    @property
    def writable(self) -> bool:
        return self.available and self.mode in WRITABLE

    def free_bytes(self, *, fresh: bool = False) -> int | None:
        """Bytes available on the store's filesystem (cached for a second), None if unknown."""
        now = time.monotonic()
        cached = self._free
        if not fresh and cached and now - cached[0] < FREE_SPACE_TTL_S:
            return cached[1]
        try:
            free = int(self._disk_free(str(existing_parent(self.directory))))
        except OSError as exc:
            self.fault(exc, "statvfs")
            return None
        self._free = (now, free)
        return free

    def budget_bytes(self) -> int:
        """``fixed`` as configured; ``auto`` recomputed from free space and the store's size."""
        if self.fixed_budget is not None:
            return int(self.fixed_budget)
        free = self.free_bytes() or 0
        managed = self._used()
        return max(
            0,
            min(
                int(AUTO_FRACTION * (free + managed)),
                free - self.settings.minimum_free,
                AUTO_CAP,
            ),
        )

    def refresh(self, *, force: bool = False) -> None:
        """Re-derive active / read_only_low_space / budget_below_entry_floor from free space.

        ``off``, ``storage_unavailable`` and ``storage_untrusted`` are fixed for the life of the
        tier; ``storage_error`` is cleared by the next success, not by free space.
        """
        if self.state == "off" or self.reason in (
            "storage_unavailable",
            "storage_untrusted",
            "storage_error",
        ):
            return
        free = self.free_bytes(fresh=force)
        if self._full_at is not None:
            if free is None or free < self._full_at + ENTRY_FLOOR:
                self.set("read_only_low_space", None)
                return
            self._full_at = None
        if self.fixed_budget is not None and self.fixed_budget < ENTRY_FLOOR:
            self.set("degraded", "budget_below_entry_floor")
        elif free is not None and free < self.settings.minimum_free:
            self.set("read_only_low_space", None)
        elif self.budget_bytes() < ENTRY_FLOOR:
            self.set("degraded", "budget_below_entry_floor")
        else:
            self.set("active", None)

    def fault(self, exc: BaseException, where: str) -> None:
        """Count a fault (see the module docstring); the caller fails open."""
        if is_lock_error(exc):
            self.counters.add("lock_timeouts")
            log.debug("L3 lock contention during %s: %s", where, exc)
            return
        if not is_storage_fault(exc):
            self.counters.add("internal_errors")
            log.error("L3 internal error during %s (a bug)", where, exc_info=exc)
            return
        self.counters.add("storage_errors")
        if is_no_space(exc):
            log.warning("L3 disk full during %s: %s; writes stop", where, exc)
            self._full_at = self.free_bytes(fresh=True) or 0
            self.set("read_only_low_space", None)
            return
        with self._lock:
            self._faults += 1
            faults = self._faults
        log.warning("L3 storage error during %s: %s: %s", where, type(exc).__name__, exc)
        if faults >= FAULTS_TO_DEGRADE and self.state != "read_only_low_space":
            self.set("degraded", "storage_error")

    def ok(self) -> None:
        """An operation succeeded: a run of faults is over."""
        if self._faults:
            with self._lock:
                self._faults = 0
            if self.state == "degraded" and self.reason == "storage_error":
                self.set("active", None)
                self.refresh(force=True)
