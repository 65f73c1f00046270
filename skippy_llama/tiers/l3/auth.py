"""Who may write an L3 store: the directory check, and optional authentication of its records
with a secret the store does not hold.

A store directory others could write is refused (:func:`check_directory`): they could plant rows.

Page digests live in the same database as the pages: they catch damage, not an attacker who can
write the store. With ``l3.secret_file`` every page, child-index entry, manifest and the cost book carries a tag,
HMAC-SHA256 (truncated to 128 bits) under that secret over the record's key and content, so only
holders of the secret can write records other processes will serve. Each tag has its own label,
so a tag of one kind never verifies as another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
from pathlib import Path

from ...errors import ConfigError, UntrustedDirectoryError
from .schema import NO_TAG, TAG_BYTES

#: Fewer bytes than this is not a secret worth the name (128 bits).
MIN_SECRET_BYTES = 16
#: A secret file larger than this is a mistake (a model file, a log), not a key.
MAX_SECRET_BYTES = 4096


class Signer:
    """Computes and checks tags; without a secret it signs nothing and accepts everything."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def _tag(self, *parts: bytes | memoryview) -> bytes:
        if self._secret is None:
            return NO_TAG
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(
                struct.pack("<Q", part.nbytes if isinstance(part, memoryview) else len(part))
            )
            mac.update(part)
        return mac.digest()[:TAG_BYTES]

    def page(self, key: bytes, n_tokens: int, payload: bytes | memoryview) -> bytes:
        """Tag of a page: its key, token count and stored bytes."""
        return self._tag(b"page", key, struct.pack("<I", n_tokens), payload)

    def child(self, parent: bytes, key: bytes, tokens: bytes) -> bytes:
        """Tag of a child-index entry: the node, the page after it and that page's tokens."""
        return self._tag(b"child", parent, key, tokens)

    def manifest(self, body: bytes) -> bytes:
        """Tag of a manifest over its canonical JSON body (without the tag)."""
        return self._tag(b"manifest", body)

    def costs(self, body: bytes) -> bytes:
        """Tag of the cost book (``costs.py``) over its stored JSON body."""
        return self._tag(b"costs", body)

    def value(self, label: bytes, key: bytes, *parts: bytes | memoryview) -> bytes:
        """Tag of a value stored under ``key`` outside L3 (the remote tier), over its ``parts``:
        ``label`` names the kind of value, so a tag of one kind never verifies as another."""
        return self._tag(b"value", label, key, *parts)

    def verify(self, tag: bytes, expected: bytes) -> bool:
        """True when ``tag`` is the ``expected`` one, or when the store has no secret."""
        return self._secret is None or hmac.compare_digest(tag, expected)


def load_secret(
    path: Path, *, shared_group: bool = False, setting: str = "l3.secret_file"
) -> bytes:
    """The secret in ``path`` (``l3.secret_file``, or the ``setting`` named).

    Raises:
        ConfigError: the file is missing, unreadable, too short or long, or readable by others
            (or by its group, unless ``l3.shared_group``), naming the setting.
    """
    where = f"invalid setting {setting} = {str(path)!r}"
    try:
        info = os.stat(path)
        # checked before opening: a FIFO would block the open, a directory fails it
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{where}: not a regular file")
        with open(path, "rb") as f:
            secret = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"{where}: cannot read it ({exc.strerror or exc}); create one with "
            "`head -c 32 /dev/urandom > FILE && chmod 600 FILE`"
        ) from None
    readable = stat.S_IROTH | stat.S_IWOTH | (0 if shared_group else stat.S_IRGRP | stat.S_IWGRP)
    if info.st_mode & readable:
        raise ConfigError(
            f"{where}: others can read or write it; chmod 600 it"
            + ("" if shared_group else " (or 640 with l3.shared_group)")
        )
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ConfigError(
            f"{where}: holds {len(secret)} bytes; a secret needs {MIN_SECRET_BYTES} to "
            f"{MAX_SECRET_BYTES}, e.g. `head -c 32 /dev/urandom > FILE`"
        )
    return secret


def check_directory(directory: Path, *, shared_group: bool = False, create: bool = True) -> bool:
    """Refuse a store directory others could tamper with; create it 0700 when ``create``.

    Returns False when it does not exist (and ``create`` is off).

    Raises:
        UntrustedDirectoryError: it is a symlink, not a directory, owned by another user, or
            writable by others (or by its group, unless ``shared_group``).
        OSError: it cannot be created.
    """
    if not directory.exists() and not directory.is_symlink():
        if not create:
            return False
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
            f"L3 directory {directory} belongs to uid {info.st_uid}, not to this user "
            f"(uid {os.geteuid()}); use a directory of your own"
        )
    writable = stat.S_IWOTH | (0 if shared_group else stat.S_IWGRP)
    if info.st_mode & writable:
        who = "others" if info.st_mode & stat.S_IWOTH else "its group"
        hint = "" if shared_group else " (or set l3.shared_group to share it with the group)"
        raise UntrustedDirectoryError(
            f"L3 directory {directory} is writable by {who}: chmod go-w it{hint}"
        )
    return True
