"""Page codecs: how page bytes are stored in L3. Pure bytes in, bytes out; no llama.cpp."""

from .lossless import decode, encode

__all__ = ["decode", "encode"]
