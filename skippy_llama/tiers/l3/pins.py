"""Pins: pages in use, which eviction, prune, quarantine cut-backs and reconciliation keep.

A writer pins the pages of a record in the store (for every process) before it writes payloads,
so another process's eviction or reconciliation never deletes a payload whose metadata is about
to be written. Readers pin in-process only: a page another process removes mid-read is a counted
miss, so reads do not pay for a store write.

A store pin names its owner by pid *and* process start time, and carries a lease: it holds while
the lease runs and, on this host, while that very process runs. A pid reused by another process
(pid 1 in every container) therefore does not keep pages pinned, nor does a pin from another host
that stopped renewing. The same liveness rule serves sessions and the reconciliation lease.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence

from ...errors import StoreDataError
from ..records import KEY_BYTES
from .context import Parts
from .schema import PIN, Pin

#: How long any pin, session or lease counts as live without being renewed.
PIN_LEASE_S = 3600.0


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), None where unknown."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return False
    return True


HOST = socket.gethostname()


def owner_alive(owner: Pin, now: float, lease: float = PIN_LEASE_S) -> bool:
    """Whether the process that wrote ``owner`` (a pin, session or lease) still holds it."""
    if not 0 <= now - owner.at < lease:
        return False
    if owner.host != HOST:
        return True  # another host: the lease alone decides
    return pid_alive(owner.pid) and owner.start == process_start(owner.pid)


def my_owner(keys: Sequence[bytes] = ()) -> Pin:
    """A pin record naming this process, now."""
    pid = os.getpid()
    return Pin(pid, process_start(pid), HOST, time.time(), tuple(keys))


class Pins:
    """Store pins and this process's read pins."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self._local: Counter[bytes] = Counter()
        self._lock = threading.Lock()
        self.stale_removed = 0

    def pin(self, keys: Sequence[bytes]) -> bytes:
        """Pin pages for every process until :meth:`unpin`; an empty token when the store is
        not writable (nothing to protect)."""
        parts = self.parts
        if parts.store is None or not parts.store.writable:
            return b""
        token = os.urandom(KEY_BYTES)
        try:
            with parts.lock:
                parts.rw.set(PIN + token, my_owner(keys).pack())
        except Exception as exc:
            parts.health.fault(exc, "pin")
            return b""
        return token

    def unpin(self, token: bytes) -> None:
        parts = self.parts
        if not token or parts.store is None or not parts.store.writable:
            return
        try:
            with parts.lock:
                parts.rw.delete(PIN + token)
        except Exception as exc:
            parts.health.fault(exc, "unpin")

    @contextlib.contextmanager
    def local(self, keys: Sequence[bytes]) -> Iterator[None]:
        """Pin pages in this process for the block (protects a read from our own eviction)."""
        with self._lock:
            self._local.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._local.subtract(keys)
                for key in keys:
                    if self._local[key] <= 0:
                        del self._local[key]

    def live(self, *, local: bool = True) -> set[bytes]:
        """Pinned page keys: live store pins and, with ``local``, the pages this process is
        reading. Stale store pins are deleted (when the store is writable); call this inside a
        transaction when the answer decides a deletion."""
        store = self.parts.store
        pinned: set[bytes] = set()
        if store is None:
            return pinned
        now = time.time()
        for key in store.keys(PIN):
            raw = store.get(key)
            if raw is None:
                continue
            try:
                pin = Pin.unpack(raw)
                alive = owner_alive(pin, now)
            except StoreDataError:
                alive, pin = False, None
            if alive and pin is not None:
                pinned.update(pin.keys)
            elif store.writable:
                self.parts.rw.delete(key)
                self.stale_removed += 1
        if local:
            with self._lock:
                pinned.update(k for k, n in self._local.items() if n > 0)
        return pinned
