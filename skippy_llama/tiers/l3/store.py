"""The L3 store on disk: the only module that imports ``diskcache``, and its trust boundary.

diskcache's default ``Disk`` unpickles keys and values when a row's mode column says so, and joins
file names from its database onto the store directory. A store several processes share is input
like any other: one planted row would run code in every process that opens it, or make eviction
delete, and reads open, any file the process can reach. :class:`SafeDisk` reads only what L3
writes (raw ``bytes`` keys; raw or file-backed ``bytes`` values) and file names of the exact
shape diskcache generates, never through a symlink; anything else raises
:class:`~skippy_llama.errors.UntrustedRowError`, which callers turn into a quarantine and a
counter. A value that fails to read for any reason but a missing file raises
:class:`~skippy_llama.errors.TransientReadError` instead of looking like absence.

:class:`DiskStore` is the read-write store (one ``diskcache.Cache``); :class:`ReadOnlyStore`
reads the same database through a read-only SQLite connection, for ``kv-cache status``, which
must not write (opening a ``diskcache.Cache`` rewrites its settings table). Both list one key
kind with an index range query instead of walking every key.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sqlite3
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, Protocol

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW

from ...errors import TierError, TransientReadError, UntrustedRowError
from .schema import kind_range

#: diskcache's own file names: two 2-hex-digit folders and 28 hex digits + ".val"
_FILENAME = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")
_FILENAME_GLOB = "[0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]/" + "[0-9a-f]" * 28 + ".val"
_DBNAME = "cache.db"


def checked_path(directory: str, filename: str | None) -> str:
    """The full path of a value file named in the database; UntrustedRowError for a name
    diskcache would not write or a path through a symlink."""
    if filename is None or not _FILENAME.fullmatch(filename):
        raise UntrustedRowError(f"a stored file name {filename!r} diskcache does not write")
    path = os.path.join(directory, filename)
    for part in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        if os.path.islink(part):
            raise UntrustedRowError(f"stored file {filename} is reached through a symbolic link")
    return path


def read_value(directory: str, mode: int, filename: str | None, value: Any, read: bool) -> Any:
    """A row's value as diskcache stores it, refusing pickle and text modes.

    Raises:
        UntrustedRowError: a pickled or text value, or a foreign file name.
        FileNotFoundError: the value file is gone (diskcache reports the key as absent).
        TransientReadError: the file exists but cannot be read (EIO, EMFILE, EACCES, EISDIR …).
    """
    if mode == MODE_RAW:
        return bytes(value) if isinstance(value, memoryview | bytearray) else value
    if mode != MODE_BINARY:
        raise UntrustedRowError(f"a stored value of mode {mode} (pickle or text)")
    path = checked_path(directory, filename)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        handle: BinaryIO = os.fdopen(fd, "rb")
        if read:
            return handle
        with handle:
            return handle.read()
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise  # really gone: absent
        raise TransientReadError(f"reading a stored value failed: {exc}") from exc


@dataclass(frozen=True)
class StoredRow:
    """Where a stored value lies, from its database row: read it with :meth:`read_into`, on any
    thread (no SQLite involved), so many pages can be read at once."""

    directory: str
    mode: int
    filename: str | None
    value: Any

    def size(self) -> int | None:
        """The value's length without reading it; None when its file is gone.

        Raises:
            UntrustedRowError, TransientReadError: as :func:`read_value`.
        """
        if self.mode == MODE_RAW:
            return len(self.value)
        if self.mode != MODE_BINARY:
            raise UntrustedRowError(f"a stored value of mode {self.mode} (pickle or text)")
        path = checked_path(self.directory, self.filename)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TransientReadError(f"reading a stored value failed: {exc}") from exc
        if not stat.S_ISREG(info.st_mode):  # as open() failing on it would: kept, not trusted
            raise TransientReadError(f"stored value {self.filename} is not a regular file")
        return info.st_size

    def read_into(self, out: memoryview) -> int | None:
        """Read the value into ``out`` when it is exactly ``len(out)`` bytes long; returns the
        value's length (the caller compares it), or None when its file is gone.

        A page read into a reused buffer skips the page faults of a fresh ``bytes`` object:
        reading 720 MB of pages from the page cache that way is several times faster (a probe
        on this machine: 2-3 GB/s into fresh objects, 9-13 GB/s into one reused buffer). A
        file that changes size while it is read reports the bytes it gave.

        Raises:
            UntrustedRowError, TransientReadError: as :func:`read_value`.
        """
        if self.mode == MODE_RAW:
            value = self.value
            if len(value) == len(out):
                out[:] = value
            return len(value)
        try:
            handle = read_value(self.directory, self.mode, self.filename, self.value, True)
        except FileNotFoundError:
            return None
        try:
            with handle:
                size = os.fstat(handle.fileno()).st_size
                if size != len(out):
                    return size
                done = 0
                while done < size:
                    n = handle.readinto(out[done:])
                    if not n:
                        break
                    done += n
                return done
        except OSError as exc:
            raise TransientReadError(f"reading a stored value failed: {exc}") from exc


class UntrustedKey:
    """The raw bytes of a pickled key, kept unread: L3 keys are never pickled."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw


class SafeDisk(diskcache.Disk):  # type: ignore[misc]
    """A ``diskcache.Disk`` that never unpickles and never follows a foreign file name."""

    def get(self, key: Any, raw: bool) -> Any:
        if not raw:
            return UntrustedKey(bytes(key))  # handed back unread: no listing accepts it
        return super().get(key, raw)

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        return read_value(self._directory, mode, filename, value, read)

    def remove(self, file_path: str) -> None:
        # deletes pass file names from the database: a foreign one is left alone, never followed
        try:
            checked_path(self._directory, file_path)
        except UntrustedRowError:
            return
        super().remove(file_path)

    def _write(self, full_path: str, iterator: Any, mode: str, encoding: str | None = None) -> Any:
        # diskcache leaves a partly written file behind when a write fails (a full disk): no row
        # will ever name it, so remove it here instead of waiting for reconciliation
        try:
            return super()._write(full_path, iterator, mode, encoding)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(full_path)
            raise


def is_lock_error(exc: BaseException) -> bool:
    """Lock contention with another process: a busy store, not a broken one."""
    if isinstance(exc, diskcache.Timeout):
        return True
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def is_no_space(exc: BaseException) -> bool:
    """The filesystem (or the database on it) is full, or a file may not grow (EFBIG: a file
    size limit, RLIMIT_FSIZE or the filesystem's): either way no write will succeed now."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    return isinstance(exc, sqlite3.OperationalError) and "full" in str(exc).lower()


def is_storage_fault(exc: BaseException) -> bool:
    """A fault of the storage (I/O, SQLite, lock, untrusted or damaged data), as opposed to a
    bug in L3's own code, which must be logged as an error, not counted as a storage fault."""
    return isinstance(exc, OSError | sqlite3.Error | TierError) or is_lock_error(exc)


class StoreReader(Protocol):
    """What every L3 module may ask of a store (read-write or read-only)."""

    directory: Path
    untrusted_rows: int
    writable: bool

    def get(self, key: bytes) -> bytes | None: ...

    def row(self, key: bytes) -> StoredRow | None: ...

    def refuse(self, key: bytes) -> None: ...

    def size_of(self, key: bytes) -> int | None: ...

    def contains(self, key: bytes) -> bool: ...

    def keys(self, kind: bytes, *, after: bytes | None = None, limit: int = -1) -> list[bytes]: ...

    def count(self, kind: bytes) -> int: ...

    def items(self, kind: bytes) -> Iterator[tuple[bytes, bytes]]: ...

    def volume(self) -> int: ...

    def close(self) -> None: ...


class _Rows:
    """Queries both stores share, over an ``execute`` of their own connection."""

    directory: Path
    untrusted_rows: int

    def _execute(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        raise NotImplementedError

    def keys(self, kind: bytes, *, after: bytes | None = None, limit: int = -1) -> list[bytes]:
        """Keys of one kind in key order, after ``after``, at most ``limit`` (-1: all)."""
        lo, hi = kind_range(kind)
        if after is not None:
            lo = after + b"\x00"  # the smallest key above ``after``
        rows = self._execute(
            "SELECT key FROM Cache WHERE raw = 1 AND key >= ? AND key < ? ORDER BY key LIMIT ?",
            (sqlite3.Binary(lo), sqlite3.Binary(hi), limit),
        )
        return [bytes(key) for (key,) in rows.fetchall()]

    def items(self, kind: bytes) -> Iterator[tuple[bytes, bytes]]:
        """``(key, value)`` of every row of one kind, in one query (for walks over small
        records: metadata, manifests). Rows L3 would not read are skipped and counted."""
        lo, hi = kind_range(kind)
        rows = self._execute(
            "SELECT key, mode, filename, value FROM Cache WHERE raw = 1 AND key >= ? AND key < ?"
            " ORDER BY key",
            (sqlite3.Binary(lo), sqlite3.Binary(hi)),
        ).fetchall()
        for key, mode, filename, value in rows:
            try:
                data = read_value(str(self.directory), int(mode), filename, value, False)
            except FileNotFoundError:
                continue
            except UntrustedRowError:
                self.untrusted_rows += 1
                continue
            if isinstance(data, bytes):
                yield bytes(key), data

    def _row(self, key: bytes) -> tuple[int, str | None, Any] | None:
        row = self._execute(
            "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1",
            (sqlite3.Binary(key),),
        ).fetchone()
        return None if row is None else (int(row[0]), row[1], row[2])

    def row(self, key: bytes) -> StoredRow | None:
        """Where ``key``'s value lies (one query on this thread's connection), None when
        absent. L3 never sets an expiry, so the row alone decides presence, as in ``get``."""
        found = self._row(key)
        return None if found is None else StoredRow(str(self.directory), *found)

    def refuse(self, key: bytes) -> None:
        """Count a row whose value turned out not to be L3's (see :meth:`StoredRow.read_into`)."""
        self.untrusted_rows += 1

    def count(self, kind: bytes) -> int:
        lo, hi = kind_range(kind)
        rows = self._execute(
            "SELECT COUNT(*) FROM Cache WHERE raw = 1 AND key >= ? AND key < ?",
            (sqlite3.Binary(lo), sqlite3.Binary(hi)),
        )
        return int(rows.fetchone()[0])

    def unknown_keys(self) -> int:
        """Rows of no kind L3 writes (another program's data, or planted): reported, not read."""
        lo, hi = kind_range(b"\x01")[0], b"\x0b"
        rows = self._execute(
            "SELECT COUNT(*) FROM Cache WHERE NOT (raw = 1 AND typeof(key) = 'blob' "
            "AND key >= ? AND key < ?)",
            (sqlite3.Binary(lo), sqlite3.Binary(hi)),
        )
        return int(rows.fetchone()[0])

    def volume(self) -> int:
        """Bytes the store occupies: the SQLite file plus the value files."""
        ((pages,),) = self._execute("PRAGMA page_count").fetchall()
        ((size,),) = self._execute("PRAGMA page_size").fetchall()
        row = self._execute("SELECT value FROM Settings WHERE key = 'size'").fetchone()
        files = row[0] if row and isinstance(row[0], int) else 0
        return int(pages) * int(size) + max(int(files), 0)

    def _untrusted(self, key: bytes, exc: UntrustedRowError) -> NoReturn:
        self.untrusted_rows += 1
        raise exc


class DiskStore(_Rows):
    """The read-write store: one ``diskcache.Cache`` on :class:`SafeDisk`.

    Args:
        directory: the store directory (already checked by :func:`check_directory`).
        timeout: SQLite busy timeout in seconds.
    """

    writable = True

    def __init__(self, directory: Path, *, timeout: float) -> None:
        self.directory = directory
        self.untrusted_rows = 0
        self._cache = diskcache.Cache(
            str(directory),
            timeout=timeout,
            disk=SafeDisk,
            eviction_policy="none",  # L3 evicts (by its policy, with pins)
            size_limit=2**62,
            cull_limit=0,
            statistics=0,
            tag_index=0,
        )

    def _execute(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        cursor: sqlite3.Cursor = self._cache._sql(sql, args)
        return cursor

    def get(self, key: bytes) -> bytes | None:
        """The stored bytes, None when absent (or the value file is gone).

        Raises:
            UntrustedRowError: the row is not L3's (it is dropped from the database, its file
                name never followed).
            TransientReadError: it exists but cannot be read now.
        """
        try:
            value = self._cache.get(key)
        except UntrustedRowError as exc:
            self.drop_row(key)
            self._untrusted(key, exc)
        return value if isinstance(value, bytes) or value is None else None

    def size_of(self, key: bytes) -> int | None:
        """Length of the stored value without reading it (a file's size), None when absent."""
        try:
            handle = self._cache.get(key, read=True)
        except UntrustedRowError as exc:
            self.drop_row(key)
            self._untrusted(key, exc)
        if handle is None or isinstance(handle, bytes):
            return None if handle is None else len(handle)
        with handle:
            return os.fstat(handle.fileno()).st_size

    def contains(self, key: bytes) -> bool:
        return bool(key in self._cache)

    def set(self, key: bytes, value: bytes) -> None:
        self._cache.set(key, value)

    def add(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` unless ``key`` exists (atomic across processes); True when stored."""
        return bool(self._cache.add(key, value))

    def delete(self, key: bytes) -> bool:
        return bool(self._cache.delete(key))

    def refuse(self, key: bytes) -> None:
        """Count a row that is not L3's and drop it from the database (its file is left alone)."""
        self.drop_row(key)
        self.untrusted_rows += 1

    def drop_row(self, key: bytes) -> None:
        """Delete a row from the database only: its file name is not trusted, so not followed."""
        self._execute("DELETE FROM Cache WHERE key = ?", (sqlite3.Binary(key),))

    @contextlib.contextmanager
    def transact(self) -> Iterator[None]:
        """One SQLite write transaction (nestable in one thread)."""
        with self._cache.transact():
            yield

    def sweep_untrusted(self) -> int:
        """Drop every row L3 would refuse to read (pickled or text keys or values, foreign file
        names) from the database; their files are left alone. Returns the rows dropped."""
        cursor = self._execute(
            "DELETE FROM Cache WHERE raw != 1 OR mode NOT IN (?, ?) OR (mode = ? AND "
            "(filename IS NULL OR NOT filename GLOB ?))",
            (MODE_RAW, MODE_BINARY, MODE_BINARY, _FILENAME_GLOB),
        )
        dropped = max(cursor.rowcount, 0)
        self.untrusted_rows += dropped
        return dropped

    def referenced_files(self) -> frozenset[str]:
        rows = self._execute("SELECT filename FROM Cache WHERE filename IS NOT NULL")
        return frozenset(os.path.normpath(str(name)) for (name,) in rows.fetchall())

    def close(self) -> None:
        self._cache.close()


class ReadOnlyStore(_Rows):
    """The same store through a read-only SQLite connection: it cannot write, not even the
    settings table a ``diskcache.Cache`` rewrites when it opens.

    Raises (on open):
        FileNotFoundError: there is no store in ``directory`` yet.
        sqlite3.Error: the database cannot be opened.
    """

    writable = False

    def __init__(self, directory: Path, *, timeout: float) -> None:
        self.directory = directory
        self.untrusted_rows = 0
        path = directory / _DBNAME
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, "no L3 store here yet", str(path))
        self._con = sqlite3.connect(
            f"file:{path}?mode=ro", uri=True, timeout=timeout, check_same_thread=False
        )
        self._con.execute("SELECT COUNT(*) FROM Settings").fetchone()

    def _execute(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        return self._con.execute(sql, args)

    def _fetch(self, key: bytes, read: bool) -> Any:
        row = self._row(key)
        if row is None:
            return None
        try:
            return read_value(str(self.directory), *row, read)
        except FileNotFoundError:
            return None
        except UntrustedRowError as exc:
            self._untrusted(key, exc)

    def get(self, key: bytes) -> bytes | None:
        value = self._fetch(key, False)
        return value if isinstance(value, bytes) else None

    def size_of(self, key: bytes) -> int | None:
        handle = self._fetch(key, True)
        if handle is None or isinstance(handle, bytes):
            return None if handle is None else len(handle)
        with handle:
            return os.fstat(handle.fileno()).st_size

    def contains(self, key: bytes) -> bool:
        return self._row(key) is not None

    def close(self) -> None:
        self._con.close()
