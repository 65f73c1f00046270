"""Optional authentication of L3 records with a secret the store does not hold (pure).

Page digests live in the same database as the pages: they catch damage, not an attacker who can
write the store. With ``l3.secret_file`` every page, child-index entry and manifest carries a tag,
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

from ...errors import ConfigError
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

    def _tag(self, *parts: bytes) -> bytes:
        if self._secret is None:
            return NO_TAG
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(struct.pack("<Q", len(part)))
            mac.update(part)
        return mac.digest()[:TAG_BYTES]

    def page(self, key: bytes, n_tokens: int, payload: bytes | memoryview) -> bytes:
        """Tag of a page: its key, token count and stored bytes."""
        return self._tag(b"page", key, struct.pack("<I", n_tokens), bytes(payload))

    def child(self, parent: bytes, key: bytes, tokens: bytes) -> bytes:
        """Tag of a child-index entry: the node, the page after it and that page's tokens."""
        return self._tag(b"child", parent, key, tokens)

    def manifest(self, body: bytes) -> bytes:
        """Tag of a manifest over its canonical JSON body (without the tag)."""
        return self._tag(b"manifest", body)

    def verify(self, tag: bytes, expected: bytes) -> bool:
        """True when ``tag`` is the ``expected`` one, or when the store has no secret."""
        return self._secret is None or hmac.compare_digest(tag, expected)


def load_secret(path: Path, *, shared_group: bool = False) -> bytes:
    """The secret in ``path`` (``l3.secret_file``).

    Raises:
        ConfigError: the file is missing, unreadable, too short or long, or readable by others
            (or by its group, unless ``l3.shared_group``), naming the setting.
    """
    where = f"invalid setting l3.secret_file = {str(path)!r}"
    try:
        info = os.stat(path)
        with open(path, "rb") as f:
            secret = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"{where}: cannot read it ({exc.strerror or exc}); create one with "
            "`head -c 32 /dev/urandom > FILE && chmod 600 FILE`"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{where}: not a regular file")
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
