"""Page codecs: how page bytes are stored in L3. Pure bytes in, bytes out; no llama.cpp."""

from .lossless import CODECS, Codec, decode, encode

__all__ = ["CODECS", "Codec", "decode", "encode"]
