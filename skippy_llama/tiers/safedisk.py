"""The trust boundary between L3 and what lies on disk.

diskcache's default ``Disk`` unpickles keys and values when a row's mode column says so, and joins
file names from its database onto the store directory. A store several processes (or users)
share is input like any other: one planted row would run code in every process that opens it,
or make eviction delete, and reads open, any file the process can reach. :class:`SafeDisk` reads
only what L3 writes (raw bytes keys, raw or file-backed bytes values) and file names of the exact
shape diskcache generates; anything else raises :class:`UntrustedRowError`, which L3 turns into
a quarantine and a counter. A read that fails for any reason but a missing file raises
:class:`TransientReadError` instead of looking like absence, so a transient EIO/EMFILE/EACCES
never makes L3 delete pages or cut manifests.

:func:`check_directory` is the other half: the store directory must be a real directory owned by
this user and writable by no one else (group-writable only where the operator allows it).
"""

from __future__ import annotations

import errno
import os
import re
import sqlite3
import stat
from pathlib import Path
from typing import Any

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW

from ..errors import TierError

#: diskcache's own file names: two 2-hex-digit folders and 28 hex digits + ".val"
_FILENAME = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")


class UntrustedRowError(TierError):
    """A store row L3 did not write: a pickled or text key or value, or a foreign file name."""


class TransientReadError(TierError):
    """A stored value could not be read for a reason other than its absence (EIO, EMFILE …)."""


class UntrustedDirectoryError(TierError):
    """The store directory is a symlink, belongs to another user or others may write it."""


class SafeDisk(diskcache.Disk):  # type: ignore[misc]
    """A ``diskcache.Disk`` that never unpickles and never follows a foreign file name."""

    def get(self, key: Any, raw: bool) -> Any:
        if not raw:
            # a pickled key: handed back unread, as an object no L3 listing accepts
            return UntrustedKey(bytes(key))
        return super().get(key, raw)

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        if mode == MODE_RAW:
            return super().fetch(mode, filename, value, read)
        if mode != MODE_BINARY:
            raise UntrustedRowError(f"a stored value of mode {mode} (pickle or text)")
        path = self._checked(filename)
        try:
            if read:
                return open(path, "rb")
            with open(path, "rb") as reader:
                return reader.read()
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise  # really gone: diskcache reports it as absent
            raise TransientReadError(f"reading a stored value failed: {exc}") from exc

    def remove(self, file_path: str) -> None:
        # deletes pass file names from the database: a foreign one is left alone, never followed
        try:
            self._checked(file_path)
        except UntrustedRowError:
            return
        super().remove(file_path)

    def _checked(self, filename: str | None) -> str:
        if filename is None or not _FILENAME.fullmatch(filename):
            raise UntrustedRowError(f"a stored file name {filename!r} diskcache does not write")
        path = os.path.join(self._directory, filename)
        if os.path.islink(path):
            raise UntrustedRowError(f"stored file {filename} is a symbolic link")
        return path


class UntrustedKey:
    """The raw bytes of a pickled key, kept unread: L3 keys are never pickled."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw


class SafeCache(diskcache.Cache):  # type: ignore[misc]
    """``diskcache.Cache`` on :class:`SafeDisk` whose ``get`` treats an untrusted row as absent,
    after deleting it (from the database only: its file name is not followed) and counting it."""

    def __init__(self, directory: str, **settings: Any) -> None:
        super().__init__(directory, disk=SafeDisk, **settings)
        self.untrusted_rows = 0
        # rows with pickled keys are never read; drop them at open (an indexed-free but small
        # scan of one column, no unpickling)
        cursor = self._sql("DELETE FROM Cache WHERE raw = 0")
        self.untrusted_rows += max(cursor.rowcount, 0)

    def get(self, key: Any, default: Any = None, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().get(key, default, *args, **kwargs)
        except UntrustedRowError:
            self.untrusted_rows += 1
            self._sql("DELETE FROM Cache WHERE key = ? AND raw = 1", (sqlite3.Binary(key),))
            return default


def check_directory(directory: Path, *, shared_group: bool = False) -> None:
    """Create ``directory`` 0700 if missing; refuse one others could tamper with.

    Raises:
        UntrustedDirectoryError: it (or its last component) is a symlink, is owned by another
            user, or is writable by others (or by its group, unless ``shared_group``).
    """
    if not directory.exists() and not directory.is_symlink():
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700)
    info = directory.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedDirectoryError(
            f"L3 directory {directory} is a symbolic link; give the real path"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedDirectoryError(f"L3 directory {directory} is not a directory")
    if info.st_uid != os.geteuid():
        raise UntrustedDirectoryError(
            f"L3 directory {directory} belongs to uid {info.st_uid}, not to this user; "
            "use a directory of your own"
        )
    writable = stat.S_IWOTH | (0 if shared_group else stat.S_IWGRP)
    if info.st_mode & writable:
        who = "others" if info.st_mode & stat.S_IWOTH else "its group"
        hint = "" if shared_group else " (or set l3.shared_group to share it with the group)"
        raise UntrustedDirectoryError(
            f"L3 directory {directory} is writable by {who}: chmod go-w it{hint}"
        )
