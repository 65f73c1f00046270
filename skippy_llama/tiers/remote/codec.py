"""Values on the server: an authenticated frame around a page's stored bytes or a manifest.

A server several instances share is input: anyone who can reach it can write any key, and a
server under memory pressure or a client cut off mid-write can leave a value short. Every value
is therefore one frame, never pickled::

    magic "SKRV" | version u8 | kind u8 | n_tokens u32 | body length u64 | digest 16 | tag 16 | body

``digest`` is xxh3_128 of the body (damage); ``tag`` is HMAC-SHA256 under the shared secret
(L3's :class:`~..l3.auth.Signer`, truncated to 128 bits) over the *server key* the value is
stored under, the header before the tag, and the body, so a value copied to another key (another
page, another identity, a page offered as a manifest) does not verify either. :func:`unpack`
answers a :class:`FrameError` whose ``reason`` the tier counts; it never raises anything else
for bad input.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from ..l3.auth import Signer

MAGIC = b"SKRV"
VERSION = 1
KIND_PAGE = 1
KIND_MANIFEST = 2
KIND_POINT = 3  # a restore point's record
KIND_POINT_PAGE = 4  # an attention page of composed restore points
KIND_POINT_OWNER = 5  # the model a cache identity's restore points belong to (JSON)
_LABELS = {
    KIND_PAGE: b"remote-page",
    KIND_MANIFEST: b"remote-manifest",
    KIND_POINT: b"remote-point",
    KIND_POINT_PAGE: b"remote-point-page",
    KIND_POINT_OWNER: b"remote-point-owner",
}
# magic, version, kind, n_tokens, body length, digest; the tag follows
_HEAD = struct.Struct("<4sBBIQ16s")
TAG_BYTES = 16
HEADER_BYTES = _HEAD.size + TAG_BYTES


class FrameError(Exception):
    """A value that cannot be served, and why (a counter name of the tier's status)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Frame:
    kind: int
    n_tokens: int
    body: memoryview


def pack(signer: Signer, name: bytes, kind: int, n_tokens: int, body: bytes) -> bytes:
    """The value to store under server key ``name``."""
    head = _HEAD.pack(MAGIC, VERSION, kind, n_tokens, len(body), xxhash.xxh3_128_digest(body))
    tag = signer.value(_LABELS[kind], name, head, body)
    return head + tag + body


def unpack(signer: Signer, name: bytes, kind: int, value: object) -> Frame:
    """The frame of ``value`` read from key ``name``, checked to be a ``kind`` value.

    Raises:
        FrameError: ``truncated`` (shorter than it says), ``foreign`` (not bytes: a value of
            another type under this key; or not a frame of this version and kind, or longer
            than it says), ``digest`` (damaged body), ``unauthenticated`` (no valid tag for
            this key: another secret, or tampered).
    """
    if not isinstance(value, bytes):
        raise FrameError("foreign")
    if len(value) < HEADER_BYTES:
        raise FrameError("truncated" if MAGIC.startswith(value[:4]) else "foreign")
    magic, version, got_kind, n_tokens, length, digest = _HEAD.unpack_from(value)
    if magic != MAGIC or version != VERSION or got_kind != kind:
        raise FrameError("foreign")
    view = memoryview(value)
    body = view[HEADER_BYTES:]
    if len(body) < length:
        raise FrameError("truncated")
    if len(body) > length:
        raise FrameError("foreign")
    if xxhash.xxh3_128_digest(body) != digest:
        raise FrameError("digest")
    tag = bytes(view[_HEAD.size : HEADER_BYTES])
    mac = signer.value(_LABELS[kind], name, view[: _HEAD.size], body)
    if not signer.verify(tag, mac):
        raise FrameError("unauthenticated")
    return Frame(got_kind, n_tokens, body)
