"""Where the remote tier keeps things on the server: one key per page and per manifest, every key
under ``namespace:cache_identity_hex:`` so only an instance of the same cache identity (model,
KV layout, backend, settings) ever asks for them, and ``clear`` of one identity is one SCAN::

    {namespace}:{identity}:{secret id}:p:{page key hex}      a page (codec.py frame)
    {namespace}:{identity}:{secret id}:m:{manifest id hex}   a prefix's manifest (codec.py frame
                                                              around L3's manifest JSON)
    {namespace}:{identity}:{secret id}:c:{parent key hex}     a hash of the pages that follow a
                                                              node and end off a page boundary
                                                              (a record's tail): page key ->
                                                              tag + tokens
    {namespace}:{identity}:{secret id}:r:{point key hex}     a restore point's record (codec.py
                                                              frame around ``pack_composed`` or
                                                              ``pack_point``; issue 46)
    {namespace}:{identity}:{secret id}:q:{page key hex}      an attention page of composed
                                                              restore points (kept apart from
                                                              the paged cache's pages)
    {namespace}:{identity}:{secret id}:n:{identity root hex}  a hash of the token counts the
                                                              identity has restore points at:
                                                              count -> tag
    {namespace}:{identity}:{secret id}:o:{identity root hex}  the model the identity's restore
                                                              points belong to (codec.py frame
                                                              around JSON), so ``--model-identity``
                                                              finds an identity that has points
                                                              but no manifests

The secret id (:func:`secret_id`) names the shared secret without revealing it: instances with
another secret look under other keys, so they match nothing instead of matching pages they must
then refuse. It is no protection: anyone who can write the server can write under it, which is
why every value is authenticated (``codec.py``).

The namespace is checked by ``config.py`` to letters, digits and ``._-``, and identities are hex,
so no key holds a glob character and a SCAN pattern matches exactly the keys it names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..l3.auth import Signer

PAGE = b"p"
MANIFEST = b"m"
CHILDREN = b"c"
POINT = b"r"
POINT_PAGE = b"q"
POINT_LENGTHS = b"n"
POINT_OWNER = b"o"
_KINDS = (PAGE, MANIFEST, CHILDREN, POINT, POINT_PAGE, POINT_LENGTHS, POINT_OWNER)
#: What a length-index entry's tag is over (``points.py`` writes them, ``admin.py`` prunes them).
LENGTH_LABEL = b"remote-point-length"
_HEX = re.compile(r"[0-9a-f]{1,64}")


def length_tag(signer: Signer, name: bytes, field: bytes) -> bytes:
    """The tag of length-index entry ``field`` (a decimal token count) of hash ``name``."""
    return signer.value(LENGTH_LABEL, name, field)


def authentic_length(signer: Signer, name: bytes, field: object, tag: object) -> bool:
    """Whether ``field -> tag`` read from length index ``name`` is an entry this secret wrote:
    a decimal token count tagged under this key (a lookup lists only those; prune drops the
    rest)."""
    return (
        isinstance(field, bytes)
        and isinstance(tag, bytes)
        and field.isdigit()
        and signer.verify(tag, length_tag(signer, name, field))
    )


def secret_id(signer: Signer) -> str:
    """12 hex digits derived from the secret (an HMAC of a fixed label, not the secret)."""
    return signer.value(b"secret-id", b"").hex()[:12]


def check_identity(identity_hex: str) -> str:
    """``identity_hex`` when it is lowercase hex (a cache identity), else ValueError."""
    if not _HEX.fullmatch(identity_hex):
        raise ValueError(f"cache identity {identity_hex!r} is not lowercase hex")
    return identity_hex


@dataclass(frozen=True)
class Keys:
    """Key names of one namespace."""

    namespace: str
    secret: str  # :func:`secret_id`

    def prefix(self, identity_hex: str | None = None) -> bytes:
        """The prefix of every key of ``identity_hex`` (every identity: None)."""
        if identity_hex is None:
            return f"{self.namespace}:".encode()
        return f"{self.namespace}:{check_identity(identity_hex)}:".encode()

    def pattern(
        self, identity_hex: str | None = None, kind: bytes | None = None, *, mine: bool = False
    ) -> bytes:
        """A SCAN MATCH pattern for one identity's keys (or all), of one kind (or all), under
        this secret (``mine``) or any."""
        if kind is None and not mine:
            return self.prefix(identity_hex) + b"*"
        ident = b"*" if identity_hex is None else check_identity(identity_hex).encode()
        secret = self.secret.encode() if mine else b"*"
        tail = b"*" if kind is None else kind + b":*"
        return f"{self.namespace}:".encode() + ident + b":" + secret + b":" + tail

    def _name(self, identity_hex: str, kind: bytes, key: bytes) -> bytes:
        head = self.prefix(identity_hex) + self.secret.encode()
        return head + b":" + kind + b":" + key.hex().encode()

    def page(self, identity_hex: str, key: bytes) -> bytes:
        return self._name(identity_hex, PAGE, key)

    def manifest(self, identity_hex: str, mid: bytes) -> bytes:
        return self._name(identity_hex, MANIFEST, mid)

    def children(self, identity_hex: str, parent: bytes) -> bytes:
        return self._name(identity_hex, CHILDREN, parent)

    def point(self, identity_hex: str, key: bytes) -> bytes:
        """A restore point's record, by its point key (``restore_points.point_key``)."""
        return self._name(identity_hex, POINT, key)

    def point_page(self, identity_hex: str, key: bytes) -> bytes:
        """An attention page of composed restore points, by its chain key."""
        return self._name(identity_hex, POINT_PAGE, key)

    def point_lengths(self, identity_hex: str) -> bytes:
        """The hash of the token counts the identity has restore points at."""
        return self._name(identity_hex, POINT_LENGTHS, bytes.fromhex(check_identity(identity_hex)))

    def point_owner(self, identity_hex: str) -> bytes:
        """The model the identity's restore points belong to."""
        return self._name(identity_hex, POINT_OWNER, bytes.fromhex(check_identity(identity_hex)))

    def parse(self, name: bytes) -> tuple[str, str, bytes, bytes] | None:
        """``(identity hex, secret id, kind, key)`` of a key of this namespace, None for any
        other."""
        head = self.prefix()
        if not name.startswith(head):
            return None
        parts = name[len(head) :].split(b":")
        if len(parts) != 4 or parts[2] not in _KINDS:
            return None
        try:
            identity = check_identity(parts[0].decode("ascii"))
            secret = parts[1].decode("ascii")
            key = bytes.fromhex(parts[3].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        if len(key) != 16:
            return None
        return identity, secret, parts[2], key
