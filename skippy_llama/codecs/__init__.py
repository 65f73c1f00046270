"""Page codecs: how page bytes are stored in L3. Pure bytes in, bytes out; no llama.cpp.

``lossless`` (byte-shuffle + zstd, or the page as it is) is exact and the default; ``cachegen``
is an experimental lossy codec, used only where the roster qualifies it (``select``). Every
stored payload names its codec in its first bytes; :func:`stored_codec` reads the name.
"""

from .cachegen import CODEC_VERSION as CACHEGEN_VERSION
from .cachegen import MAGIC as _CACHEGEN_MAGIC
from .lossless import decode, encode


def stored_codec(stored: bytes | bytearray | memoryview) -> str:
    """``cachegen/<version>`` for a CacheGen payload, ``native`` for anything else (the lossless
    codecs: exact pages); nothing is validated."""
    head = bytes(memoryview(stored)[:6])
    if head[:4] == _CACHEGEN_MAGIC and len(head) == 6:
        return f"cachegen/{int.from_bytes(head[4:6], 'little')}"
    return "native"


__all__ = ["CACHEGEN_VERSION", "decode", "encode", "stored_codec"]
