"""L3: the durable, bounded, verified page store on ``diskcache`` (the only module that imports it).

Layout inside one ``diskcache.Cache`` (one SQLite database plus value files), every key a ``bytes``
whose first byte says what it holds. Keys sort as BLOBs (memcmp), so each kind is one contiguous
key range that can be listed without touching the others::

    \\x01 + token      pin: JSON {pid, host, at, keys} (pages in use: never evicted)
    \\x02 + page key   quarantine record: JSON {reason, at, size, pid}
    \\x03 + name       store info: b"activity" (counters of all processes), b"reconciliation"
    \\x04 + last key   manifest of one cached prefix: JSON (identities, pages, sizes, times, hits)
    \\x05 + parent     child index: packed (u32 n_tokens, 16-byte page key, n_tokens × i32 tokens)
    \\x06 + page key   page metadata: digest, size, n_tokens, indexed flag, parent, owner manifest ids
    \\x07 + page key   page payload: the stored bytes (never pickled; diskcache stores bytes natively)

Pages form a tree: each is listed with its tokens in the child index of its parent, so a lookup
can take any prefix of a stored page, and a record that branches off mid-page hangs its next page
under the branch point instead of storing the shared tokens again. Payloads are stored through a
lossless codec (:mod:`skippy_llama.codecs`); the digest covers the stored bytes.

Pages are stored once by content key and shared by every manifest that lists them (the owner list
in their metadata is the reference count). The payload digest lives in the metadata, so ``digest()``
is a metadata read and every ``read()`` verifies the payload against it.

Consistency across processes comes from SQLite transactions (``Cache.transact``) around every
multi-key change, and from *pins*: a writer pins the pages of a record (persistently, with its pid)
before writing payloads, so another process's eviction or reconciliation never deletes a payload
whose metadata is about to be written. Readers pin in-process only; a page removed by another
process mid-read is a counted miss (fail-open), never an error.

Every tier fault (I/O error, corruption, lock contention, full disk) is counted and turned into a
miss or a dropped write; nothing here raises to the request path. Operator calls (``prune``,
``clear``) raise :class:`~skippy_llama.errors.ConfigError` for a bad model identity.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import json
import logging
import os
import queue
import socket
import sqlite3
import struct
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diskcache
import xxhash

from ..admission import AdmissionPolicy
from ..codecs import decode, encode
from ..config import L3Settings
from ..errors import ConfigError, StateFormatError, UnknownCodecError
from .records import (
    KEY_BYTES,
    ClearResult,
    DiskActivity,
    DiskState,
    DiskStatus,
    DiskUsage,
    InventoryEntry,
    PrefixRecord,
    PruneResult,
    Reconciliation,
)
from .safedisk import SafeCache, UntrustedDirectoryError, check_directory

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
#: Smallest useful budget: below it one typical entry (a 2k-token prefix of a small model is
#: ~50 MB) would not fit, and the tier would only churn.
ENTRY_FLOOR = 64 * MiB
#: ``auto`` budget: min(AUTO_FRACTION × (free + managed), free − minimum_free, AUTO_CAP).
AUTO_FRACTION = 0.20
AUTO_CAP = 64 * GiB
#: Eviction goes down to this fraction of the budget, so that it runs in bursts, not per write.
LOW_WATERMARK = 0.85
#: Value files without a row are removed only when older than this: a concurrent writer's file
#: exists briefly before its row does.
ORPHAN_FILE_GRACE_S = 600.0
#: Pins from another host (a shared network directory) count as live for this long.
PIN_LEASE_S = 3600.0
#: Consecutive storage errors before the state turns ``degraded`` / ``storage_error``.
FAULTS_TO_DEGRADE = 3
#: The writer flushes hit times and counters this often when idle.
MAINTAIN_EVERY_S = 1.0
#: Free space is re-read at most this often on hot paths.
FREE_SPACE_TTL_S = 1.0
#: SQLite busy timeout: long enough for another process's short transaction, short enough that a
#: stuck lock becomes a counted fault instead of a hung request.
SQLITE_TIMEOUT_S = 5.0
#: Records waiting for the writer may hold at most this many payload bytes in RAM.
MAX_QUEUED_BYTES = 1 * GiB
#: Child-index entries kept per node, newest first out of the index: a lookup step reads and a
#: new page rewrites one node's index, so it stays bounded however many prompts branch at one
#: point (thousands of questions over one document). A page dropped from the index stays
#: stored: a whole aligned page is still found by its key, only a match inside it is lost.
MAX_CHILDREN = 256
#: Hits before a manifest leaves probation (a hit is a read() that served its pages).
PROTECT_AFTER_HITS = 2

_PIN = b"\x01"
_QUAR = b"\x02"
_INFO = b"\x03"
_MAN = b"\x04"
_KIDS = b"\x05"
_META = b"\x06"
_DATA = b"\x07"
_KINDS = (_PIN, _QUAR, _INFO, _MAN, _KIDS, _META, _DATA)
_ACTIVITY = _INFO + b"activity"
_RECONCILIATION = _INFO + b"reconciliation"

_META_HEAD = struct.Struct("<16sQIB16s")  # digest, size, n_tokens, indexed, parent; then owners
_KID_HEAD = struct.Struct("<I16s")  # n_tokens, page key; then the tokens
_MANIFEST_VERSION = 1

_SERVING: frozenset[str] = frozenset({"active", "read_only_low_space", "storage_error"})
_WRITABLE: frozenset[str] = frozenset({"active", "storage_error"})


def payload_digest(payload: bytes | memoryview) -> bytes:
    """The 16-byte xxh3_128 digest stored with every page and checked on every read."""
    return xxhash.xxh3_128_digest(payload)


def statvfs_free(path: str) -> int:
    """Bytes available to unprivileged users on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@dataclass
class _Meta:
    digest: bytes
    size: int
    n_tokens: int
    indexed: bool  # listed in the child index of ``parent``
    parent: bytes
    owners: list[bytes]

    def pack(self) -> bytes:
        head = _META_HEAD.pack(
            self.digest, self.size, self.n_tokens, int(self.indexed), self.parent
        )
        return head + b"".join(self.owners)

    @classmethod
    def unpack(cls, raw: bytes) -> _Meta:
        if len(raw) < _META_HEAD.size or (len(raw) - _META_HEAD.size) % KEY_BYTES:
            raise ValueError("malformed page metadata")
        digest, size, n_tokens, indexed, parent = _META_HEAD.unpack_from(raw)
        rest = raw[_META_HEAD.size :]
        owners = [rest[i : i + KEY_BYTES] for i in range(0, len(rest), KEY_BYTES)]
        return cls(digest, size, n_tokens, bool(indexed), parent, owners)


def _kid_entries(raw: bytes) -> list[tuple[bytes, bytes]] | None:
    """Entries of a child index as ``(page key, token bytes)``; None when it does not parse."""
    out = []
    off = 0
    while off < len(raw):
        if off + _KID_HEAD.size > len(raw):
            return None
        n, key = _KID_HEAD.unpack_from(raw, off)
        end = off + _KID_HEAD.size + 4 * n
        if n == 0 or end > len(raw):
            return None
        out.append((bytes(key), bytes(raw[off + _KID_HEAD.size : end])))
        off = end
    return out


def _kid_pack(entries: Iterable[tuple[bytes, bytes]]) -> bytes:
    return b"".join(_KID_HEAD.pack(len(tokens) // 4, key) + tokens for key, tokens in entries)


_BATCH = 256


def _batches(keys: Sequence[bytes], size: int = _BATCH) -> Iterator[Sequence[bytes]]:
    for i in range(0, len(keys), size):
        yield keys[i : i + size]


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _manifest_keys(man: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(page[0]) for page in man["pages"]]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return False
    return True


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), None where unknown."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError, ValueError):
        return None


def _is_lock_error(exc: BaseException) -> bool:
    if isinstance(exc, diskcache.Timeout):
        return True
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def _close_at_exit(ref: weakref.ReferenceType[DiskTier]) -> None:
    tier = ref()
    if tier is not None:
        tier.close()


class DiskTier:
    """The L3 store. See the module docstring for the layout and the concurrency rules.

    Args:
        settings: ``l3`` settings (mode, budget, directory, minimum_free, writer_queue).
        admission: optional policy asked about each record in the background writer (it needs the
            store's reference counts for exclusive bytes). Without one, every record is written
            (reference-aware LRU write-through).
        disk_free: ``path -> available bytes``; injectable for tests (default: statvfs).
        reconcile: run start-up reconciliation (the CLI's ``status`` opens without it and reports
            the latest reconciliation recorded in the store).
        verify: reconciliation checks every payload's digest (reads everything) instead of sizes.
        max_queued_bytes: payload bytes that may wait for the writer before records are dropped.
        timeout: SQLite busy timeout in seconds.
        close_at_exit: register :meth:`close` with ``atexit`` so pending writes land on normal exit.
    """

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
    ) -> None:
        self.settings = settings
        self.directory = Path(settings.directory)
        self.admission = admission
        self._disk_free = disk_free or statvfs_free
        self._max_queued_bytes = max_queued_bytes
        self._host = socket.gethostname()
        self._pid = os.getpid()

        self._lock = threading.Lock()  # counters, pending touches, in-process pins
        self._store_lock = threading.RLock()  # serializes this process's store transactions
        self._counts: Counter[str] = Counter()  # this process, since open
        self._unflushed: Counter[str] = Counter()  # not yet added to the store's totals
        self._touches: dict[bytes, tuple[float, int]] = {}  # manifest id -> (last used, hits)
        self._local_pins: Counter[bytes] = Counter()
        self._listeners: list[Callable[[bytes], None]] = []
        # None is the stop signal (close() wakes the writer instead of waiting for its poll).
        self._queue: queue.Queue[PrefixRecord | None] = queue.Queue(maxsize=settings.writer_queue)
        self._queued_bytes = 0
        # new pages of queued records (key -> records holding it) and their child index
        self._queued_pages: Counter[bytes] = Counter()
        self._queued_kids: dict[bytes, dict[bytes, bytes]] = {}
        self._writer: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._consecutive_faults = 0
        self._free_cache: tuple[float, int] | None = None
        self._last_maintain = time.monotonic()
        self._stale_pins = 0
        self._atexit: Callable[[], None] | None = None

        self._cache: Any = None
        self._state: DiskState = "off"
        self._reason: str | None = None
        self.error: str | None = None  # why the store is unavailable, for status output
        self.reconciliation = Reconciliation()
        self._fixed_budget = settings.budget if settings.mode == "fixed" else None

        if settings.mode == "off":
            return  # off touches nothing on disk, not even the directory
        try:
            check_directory(self.directory, shared_group=settings.shared_group)
        except UntrustedDirectoryError as exc:
            self._set_state("degraded", "storage_untrusted")
            self.error = str(exc)
            log.warning("L3 refused: %s; continuing without it", exc)
            return
        except OSError:
            pass  # an unusable path is reported below as storage_unavailable
        try:
            self._cache = SafeCache(
                str(self.directory),
                timeout=timeout,
                eviction_policy="none",  # we evict (LRU manifests, pins, probation)
                size_limit=2**62,
                cull_limit=0,
                statistics=0,
                tag_index=0,
            )
            self._cache.volume()  # proves the database is readable
        except Exception as exc:  # any failure to open is "storage unavailable", never a crash
            self._cache = None
            self._set_state("degraded", "storage_unavailable")
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("L3 storage unavailable at %s: %s", self.directory, self.error)
            return
        self._set_state("active", None)
        if reconcile:
            try:
                self.reconciliation = self._reconcile(verify=verify)
            except Exception as exc:
                self._fault(exc, "reconciliation")
        self._refresh_state(force=True)
        if close_at_exit:
            # A weak reference, so the registration does not keep a dropped tier alive.
            self._atexit = functools.partial(_close_at_exit, weakref.ref(self))
            atexit.register(self._atexit)

    # ------------------------------------------------------------------ state and budget

    @property
    def state(self) -> DiskState:
        """``off`` | ``active`` | ``read_only_low_space`` | ``degraded``."""
        return self._state

    @property
    def reason(self) -> str | None:
        """Why the state is ``degraded`` (``storage_unavailable``, ``budget_below_entry_floor``,
        ``storage_error``), else None."""
        return self._reason

    def _set_state(self, state: DiskState, reason: str | None) -> None:
        if (state, reason) != (self._state, self._reason):
            if state != "active" and self._state != "off":
                log.warning("L3 state %s (%s) at %s", state, reason, self.directory)
            self._state, self._reason = state, reason

    @property
    def _mode(self) -> str:
        # degraded/storage_error keeps serving and writing (the fault may be transient).
        return self._reason if self._state == "degraded" and self._reason else self._state

    def free_bytes(self, *, fresh: bool = False) -> int | None:
        """Bytes available on the store's filesystem (cached for a second), None if unknown."""
        if self._cache is None:
            return None
        now = time.monotonic()
        if not fresh and self._free_cache and now - self._free_cache[0] < FREE_SPACE_TTL_S:
            return self._free_cache[1]
        try:
            free = int(self._disk_free(str(self.directory)))
        except OSError as exc:
            self._fault(exc, "statvfs")
            return None
        self._free_cache = (now, free)
        return free

    def used_bytes(self) -> int:
        """Bytes the store occupies (SQLite pages plus value files), 0 when unavailable."""
        if self._cache is None:
            return 0
        try:
            return int(self._cache.volume())
        except Exception as exc:
            self._fault(exc, "volume")
            return 0

    def budget_bytes(self) -> int:
        """The effective budget: ``fixed`` as configured, ``auto`` recomputed from free space."""
        if self._cache is None:
            return 0
        if self._fixed_budget is not None:
            return int(self._fixed_budget)
        free = self.free_bytes() or 0
        managed = self.used_bytes()
        return max(
            0,
            min(
                int(AUTO_FRACTION * (free + managed)),
                free - self.settings.minimum_free,
                AUTO_CAP,
            ),
        )

    def _refresh_state(self, *, force: bool = False) -> None:
        """Re-derive active / read_only_low_space / budget_below_entry_floor from free space.

        ``off`` and ``storage_unavailable`` are fixed for the life of this object;
        ``storage_error`` is cleared by the next successful operation, not by free space.
        """
        if self._cache is None or (self._state == "degraded" and self._reason == "storage_error"):
            return
        free = self.free_bytes(fresh=force)
        if self._fixed_budget is not None and self._fixed_budget < ENTRY_FLOOR:
            self._set_state("degraded", "budget_below_entry_floor")
        elif free is not None and free < self.settings.minimum_free:
            self._set_state("read_only_low_space", None)
        elif self.budget_bytes() < ENTRY_FLOOR:
            self._set_state("degraded", "budget_below_entry_floor")
        else:
            self._set_state("active", None)

    # ------------------------------------------------------------------ counters and faults

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n
                self._unflushed[name] += n

    def _fault(self, exc: BaseException, where: str) -> None:
        """Count a tier fault; the caller fails open (miss or dropped write)."""
        if _is_lock_error(exc):
            self._count("lock_timeouts")
            log.debug("L3 lock contention during %s: %s", where, exc)
            return
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self._count("storage_errors")
            self._set_state("read_only_low_space", None)
            return
        self._count("storage_errors")
        self._consecutive_faults += 1
        log.warning("L3 storage error during %s: %s: %s", where, type(exc).__name__, exc)
        if self._consecutive_faults >= FAULTS_TO_DEGRADE and self._state != "read_only_low_space":
            self._set_state("degraded", "storage_error")

    def _ok(self) -> None:
        if self._consecutive_faults:
            self._consecutive_faults = 0
            if self._state == "degraded" and self._reason == "storage_error":
                self._set_state("active", None)
                self._refresh_state(force=True)

    # ------------------------------------------------------------------ listeners and pins

    def add_removal_listener(self, callback: Callable[[bytes], None]) -> None:
        """Call ``callback(page_key)`` when this process removes, evicts or quarantines a page."""
        self._listeners.append(callback)

    def _removed(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            for callback in self._listeners:
                try:
                    callback(key)
                except Exception:  # a listener bug must not break the store
                    log.exception("L3 removal listener failed")

    def pin(self, keys: Sequence[bytes]) -> bytes:
        """Mark pages as in use in the store, for every process: eviction, prune and
        reconciliation keep them until :meth:`unpin` (or until this process is gone).

        Returns the pin token; an empty token when the store is unavailable (nothing to protect).
        """
        if self._cache is None:
            return b""
        token = os.urandom(KEY_BYTES)
        value: dict[str, Any] = {
            "pid": self._pid,
            "start": _start_time(self._pid),
            "host": self._host,
            "at": time.time(),
        }
        value["keys"] = [key.hex() for key in keys]
        try:
            with self._store_lock:
                self._cache.set(_PIN + token, _dumps(value))
        except Exception as exc:
            self._fault(exc, "pin")
            return b""
        return token

    def unpin(self, token: bytes) -> None:
        """Release a pin taken with :meth:`pin`."""
        if self._cache is None or not token:
            return
        try:
            with self._store_lock:
                self._cache.delete(_PIN + token)
        except Exception as exc:
            self._fault(exc, "unpin")

    @contextlib.contextmanager
    def pinned(self, keys: Sequence[bytes]) -> Iterator[bytes]:
        """``with tier.pinned(keys):`` — :meth:`pin` for the duration of the block."""
        token = self.pin(keys)
        try:
            yield token
        finally:
            self.unpin(token)

    @contextlib.contextmanager
    def _local_pin(self, keys: Sequence[bytes]) -> Iterator[None]:
        # In-process only: protects against this process's own eviction while it reads. A reader
        # in another process losing a page mid-read is a counted miss (fail-open), so reads do
        # not pay for a store write.
        with self._lock:
            self._local_pins.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._local_pins.subtract(keys)
                for key in keys:
                    if self._local_pins[key] <= 0:
                        del self._local_pins[key]

    def _live_pins(self, *, local: bool = True) -> set[bytes]:
        """Pinned page keys: live store pins (stale ones are deleted) and, with ``local``, the
        pages this process is reading."""
        pinned: set[bytes] = set()
        now = time.time()
        for key in self._keys(_PIN):
            raw = self._cache.get(key)
            if raw is None:
                continue
            try:
                pin = json.loads(raw)
                same_host = pin.get("host") == self._host
                # a lease bounds every pin; on this host the owner must also still run, as the
                # same process (a pid reused by another process does not keep pages pinned)
                alive = now - float(pin["at"]) < PIN_LEASE_S and (
                    not same_host
                    or (_pid_alive(int(pin["pid"])) and pin.get("start") == _start_time(pin["pid"]))
                )
                keys = [bytes.fromhex(k) for k in pin["keys"]]
            except (ValueError, KeyError, TypeError):
                alive, keys = False, []
            if alive:
                pinned.update(keys)
            else:
                self._cache.delete(key)
                self._stale_pins += 1
        if local:
            with self._lock:
                pinned.update(k for k, n in self._local_pins.items() if n > 0)
        return pinned

    # ------------------------------------------------------------------ key listing

    def _keys(self, kind: bytes) -> list[bytes]:
        """All keys of one kind. Kinds up to manifests are listed from the front of the key order,
        the page kinds from the back, so a listing never walks the other big range."""
        out: list[bytes] = []
        front = kind <= _MAN
        for key in self._cache.iterkeys(reverse=not front):
            if not isinstance(key, bytes):
                continue  # foreign keys (text, numbers) sort before every BLOB
            head = key[:1]
            if head == kind:
                out.append(key)
            elif (front and head > kind) or (not front and head < kind):
                break
        return out

    # ------------------------------------------------------------------ lookup API

    @property
    def untrusted_rows(self) -> int:
        """Rows L3 did not write (pickled or text keys/values, foreign file names), dropped."""
        return int(self._cache.untrusted_rows) if self._cache is not None else 0

    @property
    def serving(self) -> bool:
        """True when reads are served (active, read-only low space, or transient storage errors)."""
        return self._cache is not None and self._mode in _SERVING

    def contains(self, key: bytes, *, queued: bool = False) -> bool:
        """True when the store has page ``key`` (metadata only; read() still verifies it).

        With ``queued``, pages of records waiting for the writer count too: a record planned
        right after another can reuse its pages instead of writing the shared tokens again.
        """
        if not self.serving:
            return False
        if queued and key in self._queued_pages:
            return True
        try:
            return bool((_META + key) in self._cache)
        except Exception as exc:
            self._fault(exc, "contains")
            return False

    def children(self, parent: bytes, *, queued: bool = False) -> list[tuple[bytes, bytes]]:
        """Pages stored after node ``parent``: ``(page key, tokens as int32 bytes)``.

        With ``queued``, also the pages of records waiting for the writer (see :meth:`contains`).
        A damaged index answers nothing (reconciliation rewrites it); never raises.
        """
        if not self.serving:
            return []
        try:
            raw = self._cache.get(_KIDS + parent)
        except Exception as exc:
            self._fault(exc, "children")
            raw = None
        out = (_kid_entries(raw) or []) if raw else []
        if queued:
            with self._lock:
                waiting = list(self._queued_kids.get(parent, {}).items())
            known = {key for key, _ in out}
            out += [(key, tokens) for key, tokens in waiting if key not in known]
        return out

    def digest(self, key: bytes) -> bytes | None:
        """The stored digest of page ``key`` (metadata only), or None if the store lacks it."""
        if not self.serving:
            return None
        try:
            raw = self._cache.get(_META + key)
            return None if raw is None else _Meta.unpack(raw).digest
        except Exception as exc:
            self._fault(exc, "digest")
            return None

    def refcount(self, key: bytes) -> int:
        """How many stored prefixes reference page ``key`` (0 when absent)."""
        if not self.serving:
            return 0
        try:
            raw = self._cache.get(_META + key)
            return 0 if raw is None else len(_Meta.unpack(raw).owners)
        except Exception as exc:
            self._fault(exc, "refcount")
            return 0

    def note_miss(self) -> None:
        """Count a lookup that found nothing in L3 without calling :meth:`read`."""
        self._count("misses")

    def read(self, keys: Sequence[bytes]) -> list[bytes]:
        """Page bytes (decoded) of the longest prefix of ``keys`` that exists and verifies.

        A missing, truncated, corrupt or unreadable page ends the prefix: corrupt and truncated
        pages are quarantined, missing ones repaired (the manifests that listed them are cut back
        to the valid prefix), and each is counted. Never raises.
        """
        out: list[bytes] = []
        if not self.serving or not keys:
            self._count("misses")
            return out
        metas: list[_Meta] = []
        with self._local_pin(keys):
            for key in keys:
                try:
                    raw = self._cache.get(_META + key)
                    if raw is None:
                        break  # the chain simply ends here
                    meta = _Meta.unpack(raw)
                    payload = self._cache.get(_DATA + key)
                except Exception as exc:
                    self._fault(exc, "read")
                    break
                if not isinstance(payload, bytes):  # None: file deleted under us or lost
                    self._count("missing_pages")
                    self._cut_back(key, "missing")
                    break
                if len(payload) != meta.size:
                    self._quarantine(key, "truncated" if len(payload) < meta.size else "size")
                    break
                if payload_digest(payload) != meta.digest:
                    self._quarantine(key, "digest_mismatch")
                    break
                try:
                    page = decode(payload, meta.n_tokens)
                except UnknownCodecError:
                    self._count("unknown_codec")  # another version's data: a miss, kept
                    break
                except StateFormatError:
                    self._quarantine(key, "undecodable")
                    break
                out.append(page)
                metas.append(meta)
        if not out:
            self._count("misses")
            return out
        self._ok()
        self._count("hits")
        self._count("pages_read", len(out))
        self._count("bytes_read", sum(m.size for m in metas))
        # Hit the manifests this read served: every manifest that contains the last page served
        # (its owners), plus the shorter manifests that ended on an earlier served page.
        touched = set(metas[-1].owners)
        touched.update(k for k, m in zip(keys, metas, strict=False) if k in m.owners)
        now = time.time()
        with self._lock:
            for mid in touched:
                _, hits = self._touches.get(mid, (now, 0))
                self._touches[mid] = (now, hits + 1)
        self._ensure_writer()
        return out

    # ------------------------------------------------------------------ record (writer)

    def record(self, rec: PrefixRecord) -> bool:
        """Queue ``rec`` for the background writer; never waits on disk.

        Returns False (and counts a dropped write) when the tier is off, unavailable, read-only
        for low space, the queue is full, or the queued bytes would exceed their bound.
        """
        if self._cache is None or self._closed:
            self._count("dropped_writes")
            return False
        if self._state == "read_only_low_space":
            self._refresh_state()  # the space may have come back (rate-limited statvfs)
        if self._mode not in _WRITABLE:
            self._count("dropped_writes")
            if self._state == "read_only_low_space":
                self._count("dropped_low_space")
            return False
        size = rec.payload_bytes
        with self._lock:
            if self._queued_bytes + size > self._max_queued_bytes:
                self._counts["dropped_writes"] += 1
                self._unflushed["dropped_writes"] += 1
                self._counts["dropped_queue_full"] += 1
                self._unflushed["dropped_queue_full"] += 1
                return False
            try:
                self._queue.put_nowait(rec)
            except queue.Full:
                self._counts["dropped_writes"] += 1
                self._unflushed["dropped_writes"] += 1
                self._counts["dropped_queue_full"] += 1
                self._unflushed["dropped_queue_full"] += 1
                return False
            self._queued_bytes += size
            for page in rec.pages:
                if page.payload is not None:
                    self._queued_pages[page.key] += 1
                    self._queued_kids.setdefault(page.parent, {})[page.key] = page.tokens
        self._ensure_writer()
        return True

    def _ensure_writer(self) -> None:
        if self._writer is not None or self._cache is None or self._closed:
            return
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._writer_loop, name="skippy-l3-writer", daemon=True
                )
                self._writer.start()

    def _writer_loop(self) -> None:
        while not self._stop.is_set():
            try:
                rec = self._queue.get(timeout=MAINTAIN_EVERY_S / 4)
            except queue.Empty:
                if time.monotonic() - self._last_maintain >= MAINTAIN_EVERY_S:
                    self._maintain()
                continue
            if rec is None:
                self._queue.task_done()
                break
            try:
                self._write(rec)
            except Exception as exc:  # belt and braces: the writer thread must not die
                self._fault(exc, "record")
                self._count("dropped_writes")
            finally:
                with self._lock:
                    self._queued_bytes -= rec.payload_bytes
                    self._unqueue_pages(rec)
                self._queue.task_done()
            if time.monotonic() - self._last_maintain >= MAINTAIN_EVERY_S:
                self._maintain()

    def _unqueue_pages(self, rec: PrefixRecord) -> None:
        for page in rec.pages:
            if page.payload is None:
                continue
            self._queued_pages[page.key] -= 1
            if self._queued_pages[page.key] <= 0:
                del self._queued_pages[page.key]
                kids = self._queued_kids.get(page.parent, {})
                kids.pop(page.key, None)
                if not kids:
                    self._queued_kids.pop(page.parent, None)

    def _write(self, rec: PrefixRecord) -> None:
        """Write one record: new payloads once by content (``add``), then metadata, child index
        and manifest in one transaction; then evict if over budget.

        A record whose reused pages were removed meanwhile (evicted, quarantined) is dropped:
        its new pages would hang under a branch no lookup can reach.
        """
        size = rec.payload_bytes
        free = self.free_bytes(fresh=True)
        if free is not None and free - size < self.settings.minimum_free:
            self._set_state("read_only_low_space", None)
            self._count("dropped_writes")
            self._count("dropped_low_space")
            return
        if self._mode not in _WRITABLE:
            self._count("dropped_writes")
            return
        budget = self.budget_bytes()
        if size > budget:
            self._count("dropped_writes")  # can never fit; don't evict everything trying
            return
        mid = rec.manifest_id
        cache = self._cache
        try:
            if self.admission is not None and (_MAN + mid) not in cache:
                shares: list[tuple[int, int]] = []
                for page in rec.pages:
                    raw = cache.get(_META + page.key)
                    meta = None if raw is None else _Meta.unpack(raw)
                    page_size = meta.size if meta is not None else len(page.payload or b"")
                    shares.append((page_size, 1 if meta is None else len(meta.owners) + 1))
                excl = sum(s / r for s, r in shares)
                decision = self.admission.decide(rec.n_tokens, size, excl)
                if decision.reason == "fallback_unmeasured":
                    self._count("admission_fallback")
                if not decision.admit:
                    self._count("rejected")
                    return
                self._count("admitted")
            stored = {
                page.key: encode(page.payload, self.settings.compression)
                for page in rec.pages
                if page.payload is not None
            }
            token = self.pin([page.key for page in rec.pages])
            try:
                for key, data in stored.items():
                    if (_DATA + key) in cache:
                        self._count("pages_deduplicated")
                    # add() is atomic: of several processes writing the same page, one wins.
                    elif cache.add(_DATA + key, data):
                        self._count("writes")
                        self._count("bytes_written", len(data))
                    else:
                        self._count("pages_deduplicated")
                new_manifest = self._commit(rec, stored)
            finally:
                self.unpin(token)
        except Exception as exc:
            self._fault(exc, "record")
            self._count("dropped_writes")
            return
        self._ok()
        if new_manifest is None:
            self._count("dropped_writes")
            self._count("dropped_stale")
            return
        if new_manifest:
            self._count("manifests_written")
            if self.admission is not None:
                self.admission.observe_recorded()
        if self.used_bytes() > budget:
            self._evict_to(int(budget * LOW_WATERMARK), counter="evictions")

    def _commit(self, rec: PrefixRecord, stored: dict[bytes, bytes]) -> bool | None:
        """Metadata, child index and manifest of ``rec`` in one transaction.

        Returns True for a new manifest, False for a refreshed one, None when a reused page is
        gone (nothing is changed then).
        """
        cache = self._cache
        mid = rec.manifest_id
        with self._store_lock, cache.transact():
            metas = []
            for page in rec.pages:
                raw = cache.get(_META + page.key)
                if raw is None and page.payload is None:
                    return None
                metas.append(None if raw is None else _Meta.unpack(raw))
            sizes = []
            for page, meta in zip(rec.pages, metas, strict=True):
                if meta is None:
                    data = stored[page.key]
                    if (_DATA + page.key) not in cache:
                        # Removed between our add and this transaction (another process's
                        # eviction before our pin landed): write it again, under the lock.
                        cache.set(_DATA + page.key, data)
                        self._count("writes")
                        self._count("bytes_written", len(data))
                    meta = _Meta(
                        payload_digest(data), len(data), page.n_tokens, True, page.parent, [mid]
                    )
                    self._kid_add(page.parent, page.key, page.tokens)
                elif mid in meta.owners:
                    sizes.append(meta.size)
                    continue
                else:
                    meta.owners.append(mid)
                sizes.append(meta.size)
                cache.set(_META + page.key, meta.pack())
            now = time.time()
            raw_man = cache.get(_MAN + mid)
            if raw_man is None:
                cache.set(_MAN + mid, _dumps(self._manifest(rec, sizes, now)))
                return True
            # the same prefix again: refresh its recency, it is not a hit
            man = json.loads(raw_man)
            man["last_used"] = max(man["last_used"], now)
            cache.set(_MAN + mid, _dumps(man))
            return False

    @staticmethod
    def _manifest(rec: PrefixRecord, sizes: list[int], now: float) -> dict[str, Any]:
        return {
            "v": _MANIFEST_VERSION,
            "id": rec.manifest_id.hex(),
            "cache_identity": rec.cache_identity,
            "model_identity": rec.model_identity,
            "model_name": rec.model_name,
            "n_tokens": rec.n_tokens,
            "root": rec.pages[0].parent.hex(),
            # [key, tokens used, stored bytes, tokens in the page]
            "pages": [
                [p.key.hex(), p.used, size, p.n_tokens]
                for p, size in zip(rec.pages, sizes, strict=True)
            ],
            "bytes": sum(sizes),
            "created": now,
            "last_used": now,
            "hits": 0,
            "probation": True,
        }

    def _kid_add(self, parent: bytes, key: bytes, tokens: bytes) -> None:
        raw = self._cache.get(_KIDS + parent) or b""
        entries = _kid_entries(raw) or []  # a damaged index is rebuilt from what is added
        if all(k != key for k, _ in entries):
            entries.append((key, tokens))
            self._cache.set(_KIDS + parent, _kid_pack(entries[-MAX_CHILDREN:]))

    def _kid_remove(self, parent: bytes, key: bytes) -> None:
        raw = self._cache.get(_KIDS + parent)
        if not raw:
            return
        kept = [(k, t) for k, t in _kid_entries(raw) or [] if k != key]
        if kept:
            self._cache.set(_KIDS + parent, _kid_pack(kept))
        else:
            self._cache.delete(_KIDS + parent)

    # ------------------------------------------------------------------ flush and close

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued records are written and counters/hits are stored; False on timeout."""
        if self._cache is None:
            return True
        deadline = time.monotonic() + timeout
        done = self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._writer is None or not self._writer.is_alive():
                    return False
                done.wait(min(remaining, 0.1))
        self._maintain()
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Flush pending writes (within ``timeout``), store counters, stop the writer, close.

        Idempotent; also called at interpreter exit unless ``close_at_exit=False``.
        """
        if self._closed:
            return
        if self._cache is not None:
            self.flush(timeout)
        self._closed = True
        self._stop.set()
        if self._writer is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
            self._writer.join(timeout=1.0)
        if self._cache is not None:
            with contextlib.suppress(Exception):
                self._maintain()
            with contextlib.suppress(Exception):
                self._cache.close()
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _maintain(self) -> None:
        """Store pending hit times and counters (batched, not per read)."""
        self._last_maintain = time.monotonic()
        if self._cache is None:
            return
        with self._lock:
            touches, self._touches = self._touches, {}
            deltas, self._unflushed = self._unflushed, Counter()
        try:
            with self._store_lock, self._cache.transact():
                promoted = 0
                for mid, (when, hits) in touches.items():
                    raw = self._cache.get(_MAN + mid)
                    if raw is None:
                        continue
                    man = json.loads(raw)
                    first_hit = man["hits"] == 0
                    man["hits"] += hits
                    man["last_used"] = max(man["last_used"], when)
                    if man["probation"] and man["hits"] >= PROTECT_AFTER_HITS:
                        man["probation"] = False
                        promoted += 1
                    self._cache.set(_MAN + mid, _dumps(man))
                    if first_hit and self.admission is not None:
                        self.admission.observe_reused()
                if promoted:
                    deltas["promotions"] += promoted
                    with self._lock:
                        self._counts["promotions"] += promoted
                if deltas:
                    stored = json.loads(self._cache.get(_ACTIVITY) or b"{}")
                    for name, n in deltas.items():
                        stored[name] = int(stored.get(name, 0)) + n
                    self._cache.set(_ACTIVITY, _dumps(stored))
        except Exception as exc:
            # Put them back so a later flush stores them; touches are best effort.
            with self._lock:
                self._unflushed.update(deltas)
            self._fault(exc, "maintain")

    # ------------------------------------------------------------------ removal primitives
    # All run inside ``self._store_lock`` and a store transaction held by the caller.

    def _delete_page(self, key: bytes, meta: _Meta | None) -> None:
        self._cache.delete(_META + key)
        self._cache.delete(_DATA + key)
        if meta is not None and meta.indexed:
            self._kid_remove(meta.parent, key)

    def _remove_manifest(
        self, mid: bytes, pins: set[bytes], *, respect_pins: bool
    ) -> tuple[bool, list[bytes], int]:
        """Remove manifest ``mid``; delete pages no manifest references any more unless pinned.

        Returns (removed, deleted page keys, pinned orphan pages kept). With ``respect_pins`` a
        manifest with a pinned page is kept whole (it is in use).
        """
        raw = self._cache.get(_MAN + mid)
        if raw is None:
            return False, [], 0
        try:
            keys = _manifest_keys(json.loads(raw))
        except (ValueError, KeyError, TypeError):
            keys = []
        if respect_pins and any(key in pins for key in keys):
            return False, [], 0
        self._cache.delete(_MAN + mid)
        deleted: list[bytes] = []
        kept = 0
        for key in keys:
            raw_meta = self._cache.get(_META + key)
            if raw_meta is None:
                continue
            meta = _Meta.unpack(raw_meta)
            meta.owners = [o for o in meta.owners if o != mid]
            if meta.owners:
                self._cache.set(_META + key, meta.pack())
            elif key in pins:
                self._cache.set(_META + key, meta.pack())  # orphan, but in use: later
                kept += 1
            else:
                self._delete_page(key, meta)
                deleted.append(key)
        return True, deleted, kept

    def _cut_manifest(
        self, mid: bytes, man: dict[str, Any], bad: int, pins: set[bytes]
    ) -> list[bytes]:
        """Replace manifest ``mid`` by its valid prefix ``pages[:bad]`` (page ``bad`` is gone)."""
        keys = _manifest_keys(man)
        if bad > 0:
            new_mid = keys[bad - 1]
            if self._cache.get(_MAN + new_mid) is None:
                pages = man["pages"][:bad]
                short = dict(man, id=new_mid.hex(), pages=pages)
                short["n_tokens"] = sum(int(p[1]) for p in pages)
                short["bytes"] = sum(int(p[2]) for p in pages)
                self._cache.set(_MAN + new_mid, _dumps(short))
                for key in keys[:bad]:
                    raw_meta = self._cache.get(_META + key)
                    if raw_meta is not None:
                        meta = _Meta.unpack(raw_meta)
                        if new_mid not in meta.owners:
                            meta.owners.append(new_mid)
                            self._cache.set(_META + key, meta.pack())
        _, deleted, _ = self._remove_manifest(mid, pins, respect_pins=False)
        return deleted

    def _cut_owners(self, key: bytes, owners: Iterable[bytes], pins: set[bytes]) -> list[bytes]:
        """Cut every manifest in ``owners`` back to the pages before ``key``."""
        deleted: list[bytes] = []
        for mid in owners:
            raw = self._cache.get(_MAN + mid)
            if raw is None:
                continue
            man = json.loads(raw)
            keys = _manifest_keys(man)
            bad = keys.index(key) if key in keys else 0
            deleted += self._cut_manifest(mid, man, bad, pins)
        return deleted

    def _quarantine(self, key: bytes, reason: str) -> None:
        """Take a page that failed validation out of service, record why, cut its manifests."""
        self._count("corrupt_entries")
        log.warning("L3 page %s quarantined: %s", key.hex(), reason)
        removed = [key]
        try:
            with self._store_lock, self._cache.transact():
                # Store pins only: this read's own pins would keep the pages after the bad one,
                # which no chain walk can reach any more.
                pins = self._live_pins(local=False)
                raw = self._cache.get(_META + key)
                meta = _Meta.unpack(raw) if raw is not None else None
                record: dict[str, Any] = {"reason": reason, "at": time.time(), "pid": self._pid}
                if meta is not None:
                    record["size"] = meta.size
                self._cache.set(_QUAR + key, _dumps(record))
                self._delete_page(key, meta)
                if meta is not None:
                    removed += self._cut_owners(key, meta.owners, pins)
        except Exception as exc:
            self._fault(exc, "quarantine")
        self._removed(removed)

    def _payload_readable(self, key: bytes) -> bool:
        # A row whose value file is gone still answers ``in``; opening the value tells the truth.
        handle = self._cache.get(_DATA + key, read=True)
        if handle is None:
            return False
        if not isinstance(handle, bytes):
            handle.close()
        return True

    def _cut_back(self, key: bytes, why: str) -> None:
        """A page's payload is missing: drop its metadata and cut its manifests back."""
        removed = [key]
        try:
            with self._store_lock, self._cache.transact():
                if self._payload_readable(key):
                    return  # it came back (another process rewrote it): nothing to repair
                pins = self._live_pins(local=False)
                raw = self._cache.get(_META + key)
                meta = _Meta.unpack(raw) if raw is not None else None
                self._delete_page(key, meta)
                if meta is not None:
                    removed += self._cut_owners(key, meta.owners, pins)
        except Exception as exc:
            self._fault(exc, f"repair ({why})")
        self._removed(removed)

    # ------------------------------------------------------------------ eviction

    def _load_manifests(self) -> list[tuple[bytes, dict[str, Any]]]:
        out = []
        for key in self._keys(_MAN):
            raw = self._cache.get(key)
            if raw is None:
                continue
            try:
                man = json.loads(raw)
                _manifest_keys(man)
            except (ValueError, KeyError, TypeError):
                continue  # reconciliation removes unreadable manifests
            out.append((key[1:], man))
        return out

    def _evict_to(
        self,
        target: int,
        *,
        model_identity: str | None = None,
        counter: str,
        remove_all: bool = False,
    ) -> tuple[int, int, int]:
        """Remove LRU manifests (probation first) until used ≤ ``target``; pinned ones stay.

        Returns (manifests removed, pages removed, manifests kept because in use).
        """
        manifests = self._load_manifests()
        if model_identity is not None:
            manifests = [
                (m, man) for m, man in manifests if man["model_identity"] == model_identity
            ]
        # Probation entries go first: they have not proven reuse yet.
        manifests.sort(key=lambda item: (not item[1]["probation"], item[1]["last_used"]))
        removed = pages = kept = 0
        for mid, _ in manifests:
            if not remove_all and self.used_bytes() <= target:
                break
            deleted: list[bytes] = []
            try:
                with self._store_lock, self._cache.transact():
                    pins = self._live_pins()
                    done, deleted, _ = self._remove_manifest(mid, pins, respect_pins=True)
            except Exception as exc:
                self._fault(exc, "evict")
                continue
            if done:
                removed += 1
                pages += len(deleted)
                self._removed(deleted)
            elif (_MAN + mid) in self._cache:
                kept += 1
        self._count(counter, removed)
        if counter == "evictions":
            self._count("pages_evicted", pages)
        return removed, pages, kept

    # ------------------------------------------------------------------ reconciliation

    def _reconcile(self, *, verify: bool) -> Reconciliation:
        """Remove leftovers and quarantine invalid entries; record the result in the store.

        Every decision is taken inside a short transaction on fresh reads (never on the listing
        alone) and pinned pages are left alone, so this is safe while other processes use the
        store. Work goes in batches of :data:`_BATCH` keys per transaction.
        """
        start = time.monotonic()
        cache = self._cache
        counts: Counter[str] = Counter()
        self._stale_pins = 0
        with self._store_lock, cache.transact():
            self._live_pins()  # deletes pins of processes that are gone
        counts["stale_pins_removed"] = self._stale_pins

        # Keys of no kind we know (another program's data in our directory): reported, kept.
        counts["unknown_keys"] = self._count_unknown_keys()

        # Manifests: unreadable ones go; ones with a missing page are cut back to the valid prefix.
        removed: list[bytes] = []
        for batch in _batches(self._keys(_MAN)):
            with self._store_lock, cache.transact():
                pins = self._live_pins()
                for key in batch:
                    raw = cache.get(key)
                    if raw is None:
                        continue
                    try:
                        man = json.loads(raw)
                        keys = _manifest_keys(man)
                    except (ValueError, KeyError, TypeError):
                        cache.delete(key)
                        counts["manifests_removed"] += 1
                        continue
                    bad = next(
                        (
                            i
                            for i, k in enumerate(keys)
                            if (_META + k) not in cache or (_DATA + k) not in cache
                        ),
                        None,
                    )
                    if bad is not None:
                        removed += self._cut_manifest(key[1:], man, bad, pins)
                        counts["manifests_removed"] += 1
        self._removed(removed)

        # Page metadata: drop stale owners and orphans (no manifest, not pinned); then check
        # payload sizes (or digests with ``verify``) outside the lock and quarantine failures.
        suspects: list[tuple[bytes, str]] = []
        removed = []
        for batch in _batches(self._keys(_META)):
            checks: list[tuple[bytes, _Meta]] = []
            with self._store_lock, cache.transact():
                pins = self._live_pins()
                for key in batch:
                    page = key[1:]
                    raw = cache.get(key)
                    if raw is None:
                        continue
                    try:
                        meta = _Meta.unpack(raw)
                    except ValueError:
                        if page not in pins:
                            self._delete_page(page, None)
                            removed.append(page)
                            counts["orphan_pages_removed"] += 1
                        continue
                    owners = [o for o in meta.owners if (_MAN + o) in cache]
                    if not owners and page not in pins:
                        self._delete_page(page, meta)
                        removed.append(page)
                        counts["orphan_pages_removed"] += 1
                        continue
                    if owners != meta.owners:
                        meta.owners = owners
                        cache.set(key, meta.pack())
                    checks.append((page, meta))
            for page, meta in checks:
                counts["pages_checked"] += 1
                problem = self._check_payload(page, meta, verify)
                if problem is not None:
                    suspects.append((page, problem))
        self._removed(removed)
        for page, problem in suspects:
            if problem == "missing":
                self._count("missing_pages")
                self._cut_back(page, "missing")
            else:
                self._quarantine(page, problem)
                counts["quarantined"] += 1

        # Payloads without metadata: interrupted writes (pinned ones are in flight elsewhere).
        for batch in _batches(self._keys(_DATA)):
            with self._store_lock, cache.transact():
                pins = self._live_pins()
                for key in batch:
                    page = key[1:]
                    if (_META + page) in cache or page in pins:
                        continue
                    cache.delete(key)
                    counts["orphan_pages_removed"] += 1

        # Child index entries must parse and point at stored pages.
        for batch in _batches(self._keys(_KIDS)):
            with self._store_lock, cache.transact():
                for key in batch:
                    raw = cache.get(key)
                    if raw is None:
                        continue
                    entries = _kid_entries(raw)
                    kept = [(k, t) for k, t in entries or [] if (_META + k) in cache]
                    if entries is None or len(kept) != len(entries):
                        counts["index_fixed"] += 1 if entries is None else len(entries) - len(kept)
                        if kept:
                            cache.set(key, _kid_pack(kept))
                        else:
                            cache.delete(key)

        counts["orphan_files_removed"] = self._remove_orphan_files()
        result = Reconciliation(
            ran=True,
            at=time.time(),
            pid=self._pid,
            seconds=round(time.monotonic() - start, 6),
            verify="digests" if verify else "sizes",
            quarantined_total=len(self._keys(_QUAR)),
            **counts,
        )
        with self._store_lock:
            cache.set(_RECONCILIATION, _dumps(result.to_json()))
        return result

    def _count_unknown_keys(self) -> int:
        # Foreign keys sort before ours (text, numbers, BLOBs starting with 0x00) or after them
        # (BLOBs starting above 0x07): scan in from both ends, stop at the first key of ours.
        n = 0
        for reverse in (False, True):
            for key in self._cache.iterkeys(reverse=reverse):
                if isinstance(key, bytes) and key[:1] in _KINDS:
                    break
                n += 1
        return n

    def _sweep_orphans(self) -> int:
        """Delete pages no manifest references and nobody pins (left by clear or a crash)."""
        removed: list[bytes] = []
        for batch in _batches(self._keys(_META)):
            with self._store_lock, self._cache.transact():
                pins = self._live_pins()
                for key in batch:
                    page = key[1:]
                    raw = self._cache.get(key)
                    if raw is None or page in pins:
                        continue
                    meta = _Meta.unpack(raw)
                    if any((_MAN + o) in self._cache for o in meta.owners):
                        continue
                    self._delete_page(page, meta)
                    removed.append(page)
        self._removed(removed)
        return len(removed)

    def _check_payload(self, page: bytes, meta: _Meta, verify: bool) -> str | None:
        """'missing' | 'truncated' | 'size' | 'digest_mismatch' | None (fine)."""
        try:
            if verify:
                payload = self._cache.get(_DATA + page)
                if payload is None:
                    return "missing"
                if len(payload) != meta.size:
                    return "truncated" if len(payload) < meta.size else "size"
                return None if payload_digest(payload) == meta.digest else "digest_mismatch"
            handle = self._cache.get(_DATA + page, read=True)
            if handle is None:
                return "missing"
            if isinstance(handle, bytes):  # small values live inside SQLite
                size = len(handle)
            else:
                with handle:
                    size = os.fstat(handle.fileno()).st_size
            if size != meta.size:
                return "truncated" if size < meta.size else "size"
        except Exception as exc:
            self._fault(exc, "reconciliation check")
        return None

    def _remove_orphan_files(self) -> int:
        """Delete value files no row references (an add() interrupted before its row landed)."""
        try:
            # diskcache has no public listing of value files; its table is stable since 2016.
            rows = self._cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")
            referenced = {os.path.normpath(str(name)) for (name,) in rows.fetchall()}
        except Exception:
            return 0
        removed = 0
        cutoff = time.time() - ORPHAN_FILE_GRACE_S
        for root, _dirs, files in os.walk(self.directory):
            for name in files:
                if not name.endswith(".val"):
                    continue
                path = os.path.join(root, name)
                rel = os.path.normpath(os.path.relpath(path, self.directory))
                if rel in referenced:
                    continue
                with contextlib.suppress(OSError):
                    if os.stat(path).st_mtime < cutoff:
                        os.remove(path)
                        removed += 1
        return removed

    # ------------------------------------------------------------------ operator API

    def _stored_activity(self) -> Counter[str]:
        try:
            raw = self._cache.get(_ACTIVITY)
            return Counter(json.loads(raw)) if raw else Counter()
        except Exception as exc:
            self._fault(exc, "status")
            return Counter()

    def _stored_reconciliation(self) -> Reconciliation:
        try:
            raw = self._cache.get(_RECONCILIATION)
            if raw:
                data = json.loads(raw)
                known = set(Reconciliation.__dataclass_fields__)
                return Reconciliation(**{k: v for k, v in data.items() if k in known})
        except Exception as exc:
            self._fault(exc, "status")
        return self.reconciliation

    def status(self) -> DiskStatus:
        """Effective state, usage, activity (all processes and this one), the latest
        reconciliation, and the inventory per model identity."""
        with self._lock:
            mine = DiskActivity.from_counts(dict(self._counts))
            unflushed = Counter(self._unflushed)
        if self._cache is None:
            return DiskStatus(
                state=self._state,
                reason=self._reason,
                directory=None if self._state == "off" else str(self.directory),
                usage=DiskUsage(minimum_free_bytes=self.settings.minimum_free),
                activity=mine,
                process_activity=mine,
                reconciliation=self.reconciliation,
            )
        self._refresh_state()
        total = self._stored_activity()
        total.update(unflushed)
        inventory: dict[str, dict[str, Any]] = {}
        pages_by_model: dict[str, dict[bytes, int]] = {}
        try:
            manifests = self._load_manifests()
            n_pages = len(self._keys(_DATA))
            n_quarantined = len(self._keys(_QUAR))
        except Exception as exc:
            self._fault(exc, "status")
            manifests, n_pages, n_quarantined = [], 0, 0
        for _, man in manifests:
            model = str(man["model_identity"])
            entry = inventory.setdefault(
                model, {"model_name": man["model_name"], "manifests": 0, "tokens": 0}
            )
            entry["manifests"] += 1
            entry["tokens"] += int(man["n_tokens"])
            pages = pages_by_model.setdefault(model, {})
            for page in man["pages"]:
                pages[bytes.fromhex(page[0])] = int(page[2])
        usage = DiskUsage(
            budget_bytes=self.budget_bytes(),
            used_bytes=self.used_bytes(),
            filesystem_available_bytes=self.free_bytes(),
            minimum_free_bytes=self.settings.minimum_free,
            manifests=len(manifests),
            pages=n_pages,
            quarantined=n_quarantined,
        )
        return DiskStatus(
            state=self._state,
            reason=self._reason,
            directory=str(self.directory),
            usage=usage,
            activity=DiskActivity.from_counts(dict(total)),
            process_activity=mine,
            reconciliation=self._stored_reconciliation(),
            inventory=tuple(
                InventoryEntry(
                    model_identity=model,
                    model_name=str(entry["model_name"]),
                    manifests=entry["manifests"],
                    pages=len(pages_by_model[model]),
                    bytes=sum(pages_by_model[model].values()),
                    tokens=entry["tokens"],
                )
                for model, entry in sorted(inventory.items())
            ),
        )

    def model_identities(self) -> dict[str, str]:
        """Model identities that have manifests in the store, with their model names."""
        if self._cache is None:
            return {}
        return {str(m["model_identity"]): str(m["model_name"]) for _, m in self._load_manifests()}

    def check_model_identity(self, model_identity: str | None) -> None:
        """Raise ConfigError for a blank model identity or one the store has no entries for."""
        if model_identity is None:
            return
        if not model_identity.strip():
            raise ConfigError(
                "--model-identity is blank; pass one of the ids `skippy-llama kv-cache status` "
                "lists, or leave it out to act on every model"
            )
        known = self.model_identities()
        if model_identity not in known:
            listing = ", ".join(f"{mid} ({name})" for mid, name in sorted(known.items()))
            raise ConfigError(
                f"unknown model identity {model_identity!r} in {self.directory}; known: "
                f"{listing or 'none (the store has no entries)'}"
            )

    def _require_store(self, what: str) -> None:
        if self._cache is None:
            detail = f": {self.error}" if self.error else ""
            raise ConfigError(
                f"cannot {what}: L3 is {self._state}"
                f"{' (' + self._reason + ')' if self._reason else ''}{detail}"
            )

    def prune(
        self, target_bytes: int | None = None, model_identity: str | None = None
    ) -> PruneResult:
        """Evict LRU entries (probation first) down to ``target_bytes``, or all entries of one
        model (both: that model's LRU entries down to the target). Entries in use are kept.

        With neither argument, applies the budget now (evicts to 85 % of it when over).

        Raises:
            ConfigError: blank or unknown model identity, or the store is unavailable.
        """
        self._require_store("prune")
        self.check_model_identity(model_identity)
        self.flush()
        before = self.used_bytes()
        remove_all = False
        target = target_bytes
        if target is None and model_identity is None:
            budget = self.budget_bytes()
            target = int(budget * LOW_WATERMARK) if before > budget else before
        elif target is None:
            remove_all = True
        removed, pages, kept = self._evict_to(
            target if target is not None else 0,
            model_identity=model_identity,
            counter="pruned",
            remove_all=remove_all,
        )
        try:
            pages += self._sweep_orphans()
        except Exception as exc:
            self._fault(exc, "prune")
        self._maintain()
        after = self.used_bytes()
        reached = after <= target if target is not None else kept == 0
        return PruneResult(
            target_bytes=target_bytes,
            model_identity=model_identity,
            manifests_removed=removed,
            pages_removed=pages,
            bytes_before=before,
            bytes_after=after,
            kept_in_use=kept,
            reached_target=reached,
        )

    def clear(self, model_identity: str | None = None) -> ClearResult:
        """Remove every manifest (of one model, or all); pinned pages stay until released.

        Raises:
            ConfigError: blank or unknown model identity, or the store is unavailable.
        """
        self._require_store("clear")
        self.check_model_identity(model_identity)
        self.flush()
        before = self.used_bytes()
        removed = pages = kept = 0
        for mid, man in self._load_manifests():
            if model_identity is not None and man["model_identity"] != model_identity:
                continue
            try:
                with self._store_lock, self._cache.transact():
                    pins = self._live_pins()
                    done, deleted, kept_now = self._remove_manifest(mid, pins, respect_pins=False)
            except Exception as exc:
                self._fault(exc, "clear")
                continue
            removed += int(done)
            pages += len(deleted)
            kept += kept_now
            self._removed(deleted)
        if model_identity is None:
            with contextlib.suppress(Exception), self._store_lock:
                for key in self._keys(_QUAR):
                    self._cache.delete(key)
        try:
            pages += self._sweep_orphans()
        except Exception as exc:
            self._fault(exc, "clear")
        self._count("pruned", removed)
        self._maintain()
        left = sum(
            1
            for _, man in self._load_manifests()
            if model_identity is None or man["model_identity"] == model_identity
        )
        return ClearResult(
            model_identity=model_identity,
            manifests_removed=removed,
            pages_removed=pages,
            pages_kept_in_use=kept,
            bytes_before=before,
            bytes_after=self.used_bytes(),
            manifests_left=left,
        )
