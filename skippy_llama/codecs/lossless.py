"""Lossless page compression for L3: byte-shuffle + zstd, through c-blosc.

F16 K/V bytes are close to random in their low (mantissa) byte, but the high byte (sign,
exponent) repeats a lot across a layer. Blosc's shuffle filter puts the high bytes of a block
together before zstd sees them; on SmolLM2's F16 pages that stores 0.86 of the raw size, where
plain zstd or zlib store 0.93, and it decompresses at GB/s, so a restore barely notices.
Lossless, so a restored page is bit-identical to the one captured.

A stored payload is self-describing: ``b"SKZ1"`` + a blosc frame, or the raw page (its own
``SKPG`` magic) when stored with the ``none`` codec. Anything else is a codec this build does not
know, which the tier treats as a miss.
"""

from __future__ import annotations

import struct

import blosc

from ..config import Compression
from ..errors import StateFormatError, UnknownCodecError

_ZSTD_MAGIC = b"SKZ1"
_RAW_MAGIC = b"SKPG"  # skippy's page magic (state/pages.py): a page stored as it is
#: zstd through blosc at level 5: the ratio of higher levels at about 1 GB/s (measured).
_CLEVEL = 5
#: F16 K/V: shuffle bytes of 2-byte elements.
_TYPESIZE = 2

# The background writer compresses while llama.cpp decodes on the request thread: release the GIL
# and use one blosc thread, so compression never competes with the decode for more than a core.
#: KV bytes one token may take (all layers, K and V): a bound, generous for any model
MAX_TOKEN_BYTES = 2 << 20

blosc.set_releasegil(True)
blosc.set_nthreads(1)


def encode(payload: bytes, codec: Compression) -> bytes:
    """The bytes to store for page ``payload`` with ``codec``."""
    if codec == "none":
        return payload
    frame: bytes = blosc.compress(
        payload, typesize=_TYPESIZE, clevel=_CLEVEL, shuffle=blosc.SHUFFLE, cname="zstd"
    )
    return _ZSTD_MAGIC + frame


def decode(stored: bytes | memoryview, n_tokens: int | None = None) -> bytes | memoryview:
    """The page bytes held in ``stored`` (whatever codec wrote it): ``stored`` itself for an
    uncompressed page, else new bytes.

    ``n_tokens``, the page's token count from its metadata, bounds what a compressed frame may
    claim to decompress to, so a forged header cannot make a read allocate gigabytes.

    Raises:
        UnknownCodecError: the payload names no codec this build reads.
        StateFormatError: a known codec's frame is damaged.
    """
    magic = bytes(stored[:4])
    if magic == _RAW_MAGIC:
        return stored  # the page itself: a view stays a view (no copy)
    if magic != _ZSTD_MAGIC:
        raise UnknownCodecError(f"stored page has unknown codec magic {magic!r}")
    frame = memoryview(stored)[4:]
    if len(frame) < 16:
        raise StateFormatError("compressed page is shorter than its frame header")
    # blosc1 header: version, versionlz, flags, typesize (1 byte each), then nbytes (u32 LE)
    (declared,) = struct.unpack_from("<I", frame, 4)
    limit = (n_tokens if n_tokens is not None else 8192) * MAX_TOKEN_BYTES + (1 << 20)
    if declared > limit:
        raise StateFormatError(f"compressed page claims {declared} bytes, over {limit}")
    try:
        out: bytes = blosc.decompress(frame)
    except Exception as exc:  # blosc raises RuntimeError/ValueError/TypeError on a bad frame
        raise StateFormatError(f"compressed page does not decode: {exc}") from exc
    return out
