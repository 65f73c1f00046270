"""CacheGen: an experimental *lossy* page codec (after CacheGen, SIGCOMM '24, arXiv 2310.07240).

Opt-in (``l3.codec = "cachegen"``), used only where the roster holds a passing qualification row
for the model, K/V layout and backend (``scripts/certify.py --cachegen``); everywhere else pages
stay native. A restored page is *not* bit-identical to the captured one.

Per page (all layers, K and V, of ``n_tokens`` tokens) and per K or V matrix of a layer, seen as
``tokens x channels`` values (transposed V is read transposed, so both are token-major):

1. **anchors**: every ``group_tokens``-th token is an anchor; its values are quantized to 8 bits
   with one scale per channel (``max |anchor|`` over the page's anchors / 127);
2. **deltas**: every token (anchors too) is stored as its difference from its group's
   *dequantized* anchor, quantized uniformly to ``2 * L + 1`` levels, ``L = 2**(bits-1) - 1``,
   with one step per channel (``max |delta|`` over the page / L): no clipping, so every value
   comes back within half a step (plus the F16 rounding of the result). ``bits`` is set per
   *layer group* (the layers cut into ``len(k_bits)`` equal runs, shallow first), separately
   for K and V, so the layers that need precision get it;
3. **entropy coding**: the symbols (uint8) go through a maintained coder, chosen by measurement
   (``benchmarks/bench_cachegen.py``, ``benchmarks/results/cachegen-codec.json``):

   - ``zstd`` (default): zstandard with matches of 7 or more only (``strategy=fast``,
     ``min_match=7``), which leaves the near-random symbols to zstd's Huffman literal stage:
     within 2 % of the symbols' order-0 entropy, decoding at GB/s. Per-channel steps make every
     channel's symbols alike, so one Huffman table per 128 KiB block is near optimal;
   - ``ans``: constriction's ANS (Rust) with one categorical distribution per matrix (layer, K
     or V), stored with the page. At each model's entropy, yet it stored more than zstd on
     SmolLM2 (0.382 of native against 0.367 at 6 bits: zstd's Huffman tables adapt per block)
     and decoded about 7x slower (60 M symbols/s on one core); kept for measurement.

   Both come with the ``cachegen`` extra (``pip install 'skippy-llama[cachegen]'``).

Decoding writes native page bytes (the page header, F16 or F32 K/V) straight into a caller's
buffer (:func:`decode_into`), so everything after the codec (L2, assembly, ``set_data``) is
unchanged. Only float layouts are coded (F16 or F32 K and V in every layer); anything else raises
:class:`CodecUnsupportedError` and the writer stores the page native.

Stored payload, all little-endian::

    head   '<4sHBBBBHIII': magic b'SKCG', CODEC_VERSION, coder, group_tokens, n_layer_groups,
                           anchor_bits, reserved, native_size, page_head_size, coded_size
    bits   n_layer_groups k_bits (u8), then n_layer_groups v_bits (u8)
    page   the native page's header and layer table (state/pages.py), verbatim
    ext    n_tokens * ext_bytes cell-ext bytes, verbatim
    scales per matrix (K of every layer, then V): anchor scale[C], delta step[C], in the page's
           element type (F16 or F32)
    coded  the entropy-coded symbols: every matrix's deltas (tokens x C, uint8), then every
           matrix's anchors (n_groups x C, uint8, offset 127)

The header is checked before anything is allocated; a payload of another codec version raises
:class:`~skippy_llama.errors.UnknownCodecError` (the tier counts it and misses), a damaged one
:class:`~skippy_llama.errors.StateFormatError`.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ..errors import StateFormatError, UnknownCodecError
from ..state.layout import KVLayout, LayerLayout
from ..state.pages import PAGE_FORMAT_VERSION, PAGE_MAGIC

MAGIC = b"SKCG"
NAME = "cachegen"
#: Version of the payload format and of its quantizer: part of the cache identity.
CODEC_VERSION = 1
_HEAD = struct.Struct("<4sHBBBBHIII")
_PAGE_HEAD = struct.Struct("<4sHHIIIII")  # state/pages.py's page header
_PAGE_LAYER = struct.Struct("<iQiII")
ANCHOR_LEVELS = 127  # 8-bit anchors: symbols 0..254
Coder = Literal["zstd", "ans"]
#: How the encoder sets a matrix's steps (the decoder reads them either way): ``channel``, one
#: step per channel from its own range (``max |delta| / L``), or ``layer``, one step for the
#: whole matrix (``rms(delta) / 2**(bits-3)``; a channel widens it only where 8-bit symbols
#: would clip): equal absolute error in every channel, so entropy coding spends the bits where
#: the values are large.
Step = Literal["channel", "layer"]
_FLAG_WIDE = 1  # symbols span -127..127 whatever the bits (``step = "layer"``)
_CODERS: dict[str, int] = {"zstd": 1, "ans": 2}
_CODER_NAMES = {v: k for k, v in _CODERS.items()}
_F32, _F16 = 0, 1
#: KV bytes one token may take (all layers, K and V): the bound a header may claim
MAX_TOKEN_BYTES = 2 << 20

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


class CodecUnsupportedError(StateFormatError):
    """A page CacheGen does not code (a quantized or mixed K/V layout): store it native."""


@dataclass(frozen=True)
class CacheGenParams:
    """The codec's knobs; all of them are part of the cache identity (:meth:`identity`).

    Attributes:
        k_bits / v_bits: delta bits per layer group, shallow layers first (2..8 each; the
            layers are cut into ``len(k_bits)`` equal runs).
        group_tokens: tokens per anchor group (1..255).
        coder: the entropy coder, ``zstd`` or ``ans``.
    """

    k_bits: tuple[int, ...] = (6, 6, 6)
    v_bits: tuple[int, ...] = (6, 6, 6)
    #: one anchor per 128-token page: anchors every 16 or 32 tokens stored more on SmolLM2
    #: (0.375 and 0.371 of native against 0.367 at 6 bits), its tokens' K/V being barely
    #: correlated (``benchmarks/results/cachegen-codec.json``)
    group_tokens: int = 128
    coder: Coder = "zstd"
    step: Step = "channel"

    def __post_init__(self) -> None:
        if not self.k_bits or len(self.k_bits) != len(self.v_bits) or len(self.k_bits) > 64:
            raise ValueError("k_bits and v_bits need the same number (1..64) of layer groups")
        if not all(2 <= b <= 8 for b in (*self.k_bits, *self.v_bits)):
            raise ValueError(f"bits must be 2..8, got K {self.k_bits} V {self.v_bits}")
        if not 1 <= self.group_tokens <= 255:
            raise ValueError(f"group_tokens must be 1..255, got {self.group_tokens}")
        if self.coder not in _CODERS:
            raise ValueError(f"coder must be one of {sorted(_CODERS)}, got {self.coder!r}")
        if self.step not in ("channel", "layer"):
            raise ValueError(f"step must be 'channel' or 'layer', got {self.step!r}")

    def identity(self) -> dict[str, Any]:
        """The codec as the cache identity and the roster record it (JSON values)."""
        return {
            "name": NAME,
            "version": CODEC_VERSION,
            "k_bits": list(self.k_bits),
            "v_bits": list(self.v_bits),
            "group_tokens": self.group_tokens,
            "coder": self.coder,
            "step": self.step,
        }

    @classmethod
    def from_identity(cls, doc: Any) -> CacheGenParams:
        """Parameters from :meth:`identity`'s form (a roster row); ValueError when malformed."""
        if not isinstance(doc, dict) or doc.get("name") != NAME:
            raise ValueError(f"not a {NAME} parameter record: {doc!r}")
        if doc.get("version") != CODEC_VERSION:
            raise ValueError(
                f"{NAME} version {doc.get('version')!r}, this build codes {CODEC_VERSION}"
            )
        k, v = doc.get("k_bits"), doc.get("v_bits")
        if not isinstance(k, list) or not isinstance(v, list):
            raise ValueError("k_bits and v_bits must be lists")
        if not all(type(b) is int for b in (*k, *v)) or type(doc.get("group_tokens")) is not int:
            raise ValueError("bits and group_tokens must be integers")
        coder = doc.get("coder", "zstd")
        if coder not in _CODERS:
            raise ValueError(f"unknown coder {coder!r}")
        step = doc.get("step", "channel")
        if step not in ("channel", "layer"):
            raise ValueError(f"unknown step mode {step!r}")
        return cls(tuple(k), tuple(v), int(doc["group_tokens"]), coder, step)

    def describe(self) -> str:
        return (
            f"{NAME}/{CODEC_VERSION} K bits {'/'.join(map(str, self.k_bits))} "
            f"V bits {'/'.join(map(str, self.v_bits))} group {self.group_tokens} {self.coder}"
            f" step {self.step}"
        )


# ------------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class _Shape:
    """Where a page's parts lie in its native bytes, and the matrices CacheGen codes."""

    layout: KVLayout
    n_tokens: int
    head_size: int  # page header + layer table
    native_size: int
    float_type: int  # _F16 or _F32
    channels: tuple[int, ...]  # per matrix (K of every layer, then V): channels (C)
    offsets: tuple[int, ...]  # per matrix: byte offset of its values in the native page

    @property
    def dtype(self) -> type[np.floating[Any]]:
        return np.float16 if self.float_type == _F16 else np.float32

    @property
    def elem(self) -> int:
        return 2 if self.float_type == _F16 else 4

    @property
    def n_layer(self) -> int:
        return self.layout.n_layer

    @property
    def ext_size(self) -> int:
        return self.n_tokens * self.layout.ext_bytes


def _parse_page_head(buf: memoryview) -> tuple[KVLayout, int, int]:
    """(layout, n_tokens, header bytes) from a native page's header and layer table."""
    if len(buf) < _PAGE_HEAD.size:
        raise StateFormatError("page header truncated")
    magic, version, flags, n_layer, _start, n_tokens, ext_bytes, _ = _PAGE_HEAD.unpack_from(buf)
    if magic != PAGE_MAGIC or version != PAGE_FORMAT_VERSION:
        raise StateFormatError(f"not a skippy page of format {PAGE_FORMAT_VERSION}")
    if not 1 <= n_layer <= 4096 or not 1 <= n_tokens <= 1 << 20 or flags > 1:
        raise StateFormatError(f"implausible page header: {n_layer} layers, {n_tokens} tokens")
    if ext_bytes > 64:
        raise StateFormatError(f"implausible cell ext of {ext_bytes} bytes")
    head = _PAGE_HEAD.size + _PAGE_LAYER.size * n_layer
    if len(buf) < head:
        raise StateFormatError("page layer table truncated")
    layers = tuple(
        LayerLayout(*_PAGE_LAYER.unpack_from(buf, _PAGE_HEAD.size + i * _PAGE_LAYER.size))
        for i in range(n_layer)
    )
    return KVLayout(v_trans=bool(flags & 1), layers=layers, ext_bytes=ext_bytes), n_tokens, head


def _shape(layout: KVLayout, n_tokens: int, head: int) -> _Shape:
    """The matrices of a page, or CodecUnsupportedError for a layout CacheGen does not code."""
    types = {t for layer in layout.layers for t in (layer.k_type, layer.v_type)}
    if len(types) != 1 or not types <= {_F16, _F32}:
        names = sorted(types)
        raise CodecUnsupportedError(
            f"{NAME} codes F16 or F32 K/V (one type in every layer), not ggml types {names}"
        )
    float_type = types.pop()
    elem = 2 if float_type == _F16 else 4
    off = head + n_tokens * layout.ext_bytes
    channels: list[int] = []
    offsets: list[int] = []
    for layer in layout.layers:
        if layer.k_row % elem:
            raise StateFormatError(f"K row of {layer.k_row} bytes is not whole elements")
        channels.append(layer.k_row // elem)
        offsets.append(off)
        off += n_tokens * layer.k_row
    for layer in layout.layers:
        if layout.v_trans:
            if layer.v_unit != elem:
                raise StateFormatError(f"V element of {layer.v_unit} bytes, type says {elem}")
            c = layer.v_embd
        else:
            if layer.v_unit % elem:
                raise StateFormatError(f"V row of {layer.v_unit} bytes is not whole elements")
            c = layer.v_unit // elem
        channels.append(c)
        offsets.append(off)
        off += n_tokens * c * elem
    if any(c <= 0 for c in channels):
        raise StateFormatError("a matrix without channels")
    return _Shape(layout, n_tokens, head, off, float_type, tuple(channels), tuple(offsets))


def _matrix(shape: _Shape, page: memoryview | U8, m: int) -> npt.NDArray[Any]:
    """Matrix ``m`` of a native page as a (tokens x channels) view (V transposed: a transposed
    view)."""
    arr = np.frombuffer(page, dtype=shape.dtype, count=shape.n_tokens * shape.channels[m],
                        offset=shape.offsets[m])  # fmt: skip
    c = shape.channels[m]
    if m >= shape.n_layer and shape.layout.v_trans:
        return arr.reshape(c, shape.n_tokens).T
    return arr.reshape(shape.n_tokens, c)


def _bits(params_bits: tuple[int, ...], n_layer: int) -> list[int]:
    """Bits of each layer: the layers cut into ``len(params_bits)`` runs, shallow first."""
    groups = len(params_bits)
    return [params_bits[min(groups - 1, il * groups // n_layer)] for il in range(n_layer)]


def _levels(bits: int, wide: bool = False) -> int:
    """Symbols of a matrix coded with ``bits`` span ``-L..L``."""
    return ANCHOR_LEVELS if wide else (1 << (bits - 1)) - 1


# ------------------------------------------------------------------------------------ encode


def encode(page: bytes | bytearray | memoryview, params: CacheGenParams) -> bytes:
    """The CacheGen payload of a native page (``Page.to_bytes()``).

    Raises:
        CodecUnsupportedError: the page's K/V types are not one float type (store it native).
        StateFormatError: the bytes are not a page.
    """
    buf = memoryview(page).cast("B")
    layout, n_tokens, head = _parse_page_head(buf)
    shape = _shape(layout, n_tokens, head)
    if shape.native_size != len(buf):
        raise StateFormatError(f"page is {len(buf)} bytes, its header says {shape.native_size}")
    n_layer = layout.n_layer
    G = params.group_tokens
    bits = _bits(params.k_bits, n_layer) + _bits(params.v_bits, n_layer)
    dtype = shape.dtype
    scales: list[npt.NDArray[Any]] = []
    deltas: list[U8] = []
    anchors: list[U8] = []
    groups = np.arange(n_tokens) // G
    for m in range(2 * n_layer):
        x = _matrix(shape, buf, m).astype(np.float32)
        a = x[::G]  # (n_groups, C)
        a_scale = _scale(np.abs(a).max(axis=0) / ANCHOR_LEVELS, dtype)
        a_s = a_scale.astype(np.float32)
        qa = np.clip(np.rint(_safe_div(a, a_s)), -ANCHOR_LEVELS, ANCHOR_LEVELS)
        a_hat = qa * a_s
        d = x - a_hat[groups]
        wide = params.step == "layer"
        level = _levels(bits[m], wide)
        top = np.abs(d).max(axis=0)
        if wide:
            # one step for the matrix, widened only where a channel would clip
            rms = float(np.sqrt(np.mean(np.square(d))))
            step = _scale(np.maximum(rms * 2.0 ** (3 - bits[m]), top / level), dtype)
        else:
            step = _scale(top / level, dtype)
        qd = np.clip(np.rint(_safe_div(d, step.astype(np.float32))), -level, level)
        scales += [a_scale, step]
        deltas.append((qd + level).astype(np.uint8))
        anchors.append((qa + ANCHOR_LEVELS).astype(np.uint8))
    wide = params.step == "layer"
    coded = _code(
        params.coder, deltas + anchors, [8 if wide else b for b in bits] + [8] * len(anchors)
    )
    ext = bytes(buf[head : head + shape.ext_size])
    scale_bytes = b"".join(np.ascontiguousarray(s).tobytes() for s in scales)
    top = _HEAD.pack(
        MAGIC, CODEC_VERSION, _CODERS[params.coder], G, len(params.k_bits), 8,
        _FLAG_WIDE if wide else 0,
        shape.native_size, head, len(coded),
    )  # fmt: skip
    return b"".join(
        [
            top,
            bytes(params.k_bits),
            bytes(params.v_bits),
            bytes(buf[:head]),
            ext,
            scale_bytes,
            coded,
        ]
    )


def _scale(raw: F32, dtype: type[np.floating[Any]]) -> npt.NDArray[Any]:
    """``raw`` scales in the page's type, rounded up (a step rounded down would clip)."""
    if not np.isfinite(raw).all():
        raise CodecUnsupportedError(f"{NAME} codes finite values only; the page has inf or NaN")
    scale = (raw * (1 + 1 / 512)).astype(dtype)
    if not np.isfinite(scale).all():
        raise CodecUnsupportedError(f"{NAME}: a scale overflows {np.dtype(dtype).name}")
    return scale


def _safe_div(x: F32, s: F32) -> F32:
    inv = np.divide(1.0, s, out=np.zeros_like(s), where=s > 0)
    return x * inv


def _code(coder: str, parts: list[U8], bits: list[int]) -> bytes:
    if coder == "zstd":
        data: bytes = _zstd_compressor().compress(
            b"".join(np.ascontiguousarray(p).data for p in parts)
        )
        return data
    return _ans_encode(parts, bits)


def _zstd_compressor() -> Any:
    import zstandard

    params = zstandard.ZstdCompressionParameters(
        strategy=zstandard.STRATEGY_FAST, min_match=7, window_log=17, hash_log=12, search_log=1
    )
    return zstandard.ZstdCompressor(compression_params=params)


#: ANS models: probabilities quantized to this many units (u16 counts per symbol, per matrix).
_ANS_TOTAL = 1 << 15


def _ans_encode(parts: list[U8], bits: list[int]) -> bytes:
    """Each matrix with its own categorical model (counts stored before the ANS words)."""
    import constriction

    tables: list[bytes] = []
    coder = constriction.stream.stack.AnsCoder()
    models = []
    for part, b in zip(parts, bits, strict=True):
        n_sym = 2 * _levels(b) + 1 if b < 8 else 2 * ANCHOR_LEVELS + 1
        counts = np.bincount(part.ravel(), minlength=n_sym)[:n_sym].astype(np.float64)
        quant = np.maximum(1, np.floor(counts / max(1.0, counts.sum()) * _ANS_TOTAL)).astype("<u2")
        tables.append(quant.tobytes())
        models.append(_ans_model(quant))
    # ANS is a stack: encode in reverse so the decoder reads the matrices in order
    for part, model in zip(reversed(parts), reversed(models), strict=True):
        coder.encode_reverse(part.ravel().astype(np.int32), model)
    words = coder.get_compressed()
    return b"".join(tables) + np.asarray(words, dtype="<u4").tobytes()


def _ans_model(counts: npt.NDArray[Any]) -> Any:
    import constriction

    p = counts.astype(np.float64) / float(counts.sum())
    return constriction.stream.model.Categorical(p, perfect=False)


# ------------------------------------------------------------------------------------ decode


@dataclass(frozen=True)
class _Header:
    coder: str
    group_tokens: int
    k_bits: tuple[int, ...]
    v_bits: tuple[int, ...]
    wide: bool
    shape: _Shape
    scales_at: int
    coded_at: int
    coded_size: int


def _header(stored: memoryview, n_tokens: int | None) -> _Header:
    if len(stored) < _HEAD.size:
        raise StateFormatError(f"{NAME} payload truncated in its header ({len(stored)} bytes)")
    magic, version, coder, G, n_groups, anchor_bits, flags, native, head, coded = _HEAD.unpack_from(
        stored
    )
    if magic != MAGIC:
        raise UnknownCodecError(f"not a {NAME} payload (magic {bytes(magic)!r})")
    if version != CODEC_VERSION:
        raise UnknownCodecError(
            f"{NAME} payload of version {version}; this build reads {CODEC_VERSION}"
        )
    if coder not in _CODER_NAMES:
        raise UnknownCodecError(f"{NAME} payload with unknown entropy coder {coder}")
    if not 1 <= G <= 255 or not 1 <= n_groups <= 64 or anchor_bits != 8 or flags & ~_FLAG_WIDE:
        raise StateFormatError(f"implausible {NAME} header (group {G}, {n_groups} layer groups)")
    off = _HEAD.size
    if len(stored) < off + 2 * n_groups:
        raise StateFormatError(f"{NAME} payload truncated in its bit table")
    k_bits = tuple(stored[off : off + n_groups])
    v_bits = tuple(stored[off + n_groups : off + 2 * n_groups])
    if not all(2 <= b <= 8 for b in (*k_bits, *v_bits)):
        raise StateFormatError(f"{NAME} header with bits out of 2..8")
    off += 2 * n_groups
    page_head = stored[off : off + head]
    if len(page_head) != head:
        raise StateFormatError(f"{NAME} payload truncated in the page header")
    layout, tokens, head_size = _parse_page_head(page_head)
    if head_size != head:
        raise StateFormatError(f"{NAME} header says {head} page-header bytes, the page {head_size}")
    if n_tokens is not None and tokens != n_tokens:
        raise StateFormatError(f"{NAME} page holds {tokens} tokens, its metadata says {n_tokens}")
    shape = _shape(layout, tokens, head)
    if shape.native_size != native or native > tokens * MAX_TOKEN_BYTES + (1 << 20):
        raise StateFormatError(
            f"{NAME} header claims {native} native bytes, the page {shape.native_size}"
        )
    off += head + shape.ext_size
    scales_at = off
    off += 2 * sum(shape.channels) * shape.elem
    if len(stored) != off + coded:
        raise StateFormatError(
            f"{NAME} payload is {len(stored)} bytes, its header says {off + coded}"
        )
    return _Header(
        _CODER_NAMES[coder],
        G,
        k_bits,
        v_bits,
        bool(flags & _FLAG_WIDE),
        shape,
        scales_at,
        off,
        coded,
    )


def codec_of(stored: bytes | bytearray | memoryview) -> tuple[str, int] | None:
    """(name, version) of a CacheGen payload, None for any other bytes (no validation)."""
    view = memoryview(stored).cast("B")
    if len(view) < 6 or bytes(view[:4]) != MAGIC:
        return None
    return NAME, int.from_bytes(view[4:6], "little")


def decoded_size(stored: bytes | bytearray | memoryview, n_tokens: int | None = None) -> int:
    """Native page bytes :func:`decode_into` writes (the header checked, nothing decoded)."""
    return _header(memoryview(stored).cast("B"), n_tokens).shape.native_size


def decode(stored: bytes | bytearray | memoryview, n_tokens: int | None = None) -> bytearray:
    """The native page held in ``stored``, in a new buffer (see :func:`decode_into`)."""
    out = bytearray(decoded_size(stored, n_tokens))
    decode_into(stored, memoryview(out), n_tokens)
    return out


def decode_into(
    stored: bytes | bytearray | memoryview, out: memoryview, n_tokens: int | None = None
) -> int:
    """Write the native page held in ``stored`` into the start of ``out``; returns its size.

    Raises:
        UnknownCodecError: not CacheGen, or another version or coder.
        StateFormatError: damaged or truncated (nothing is trusted before it is checked).
        ValueError: ``out`` is too small.
    """
    view = memoryview(stored).cast("B")
    h = _header(view, n_tokens)
    shape = h.shape
    size = shape.native_size
    target = memoryview(out).cast("B")
    if len(target) < size or target.readonly:
        raise ValueError(f"decode needs a writable buffer of {size} bytes, got {len(target)}")
    dst = np.frombuffer(target, dtype=np.uint8, count=size)
    n_groups = len(h.k_bits)
    head_at = _HEAD.size + 2 * n_groups
    dst[: shape.head_size + shape.ext_size] = np.frombuffer(
        view, np.uint8, shape.head_size + shape.ext_size, head_at
    )
    T, G = shape.n_tokens, h.group_tokens
    n_anchor = -(-T // G)
    n_mat = 2 * shape.n_layer
    bits = _bits(h.k_bits, shape.n_layer) + _bits(h.v_bits, shape.n_layer)
    if h.wide:
        bits = [8] * n_mat  # symbols span -127..127 (the bits set the encoder's steps only)
    sizes = [T * c for c in shape.channels] + [n_anchor * c for c in shape.channels]
    symbols = _decode_symbols(h, view, sizes, bits + [8] * n_mat)
    scales = np.frombuffer(view, shape.dtype, 2 * sum(shape.channels), h.scales_at)
    # a run of matrices of one kind with equal channel counts (every K, every V, in most
    # models) is checked and its constants computed at once; its values are then computed a
    # few matrices at a time, so that a chunk's scratch arrays stay in the CPU's cache
    pos_d, pos_a = 0, sum(sizes[:n_mat])
    scale_at = np.cumsum([0] + [2 * c for c in shape.channels])
    m = 0
    while m < n_mat:
        c = shape.channels[m]
        kind_end = shape.n_layer if m < shape.n_layer else n_mat
        end = m + 1
        while end < kind_end and shape.channels[end] == c:
            end += 1
        k = end - m
        sc = scales[scale_at[m] : scale_at[end]].reshape(k, 2, c).astype(np.float32)
        q = symbols[pos_d : pos_d + k * T * c].reshape(k, T, c)
        pos_d += k * T * c
        qa = symbols[pos_a : pos_a + k * n_anchor * c].reshape(k, n_anchor, c)
        pos_a += k * n_anchor * c
        _dequantize(shape, dst, m, q, qa, sc, bits[m:end], G)
        m = end
    return size


#: Matrices whose values are computed together (one layer's K of SmolLM2 is 24,576 values;
#: 4 to 8 measured fastest on SmolLM2 pages, 2 and 30 slower).
_CHUNK = 8


def _dequantize(
    shape: _Shape, dst: U8, m: int, q: U8, qa: U8, sc: F32, bits: list[int], G: int
) -> None:
    """Write matrices ``m .. m + len(q)`` (one kind, equal channel counts) into the native page.
    F16 pages (and F32 ones whose table would be as large as the values) compute each value in
    F32 and convert it with integer passes (:func:`_scaled_half_bits`); F32 pages of many tokens
    per table gather from a table of every value a (matrix, anchor group, channel) can take.

    The checks and the per-matrix constants are computed once for the run (per chunk they cost
    1.2 ms of a 5.5 ms SmolLM2 page in numpy calls on small arrays); the passes over the values
    go a chunk of ``_CHUNK`` matrices at a time."""
    k, T, c = q.shape
    n_anchor = qa.shape[1]
    levels = np.array([_levels(b) for b in bits], dtype=np.int32)
    # one reduction over the run (the matrices' ranges are mostly equal); per matrix only
    # when it could matter
    if (
        int(q.max()) > 2 * int(levels.min())
        and int((q.reshape(k, -1).max(axis=1).astype(np.int32) - 2 * levels).max()) > 0
    ):
        raise StateFormatError(f"{NAME} symbol out of its layer's range")
    if int(qa.max()) > 2 * ANCHOR_LEVELS:
        raise StateFormatError(f"{NAME} anchor symbol out of range")
    NL = int(2 * levels.max() + 1)
    anchor = (qa.astype(np.float32) - ANCHOR_LEVELS) * sc[:, 0, None, :]  # (k, n_anchor, c)
    start = shape.offsets[m]
    block = dst[start : start + k * T * c * shape.elem].view(shape.dtype)
    v_trans = m >= shape.n_layer and shape.layout.v_trans
    chunks = [(i, min(k, i + _CHUNK)) for i in range(0, k, _CHUNK)]
    if shape.float_type == _F16 or n_anchor * NL * 4 > T:  # compute the values
        # value = anchor + (q - L) * step = (anchor - L * step) + q * step; for F16 pages the
        # constants are pre-scaled by 2**-112, so the F32 sums come out as F16 bit patterns
        # shifted left by 13 (see _scaled_half_bits)
        step = sc[:, 1]
        anchor -= (levels[:, None] * step)[:, None, :]
        if shape.float_type == _F16:
            step = step * _F16_SCALE
            anchor *= _F16_SCALE
        # |value| <= |anchor - L step| + 2 L step (symbols are checked to lie in 0..2L)
        top_a = np.abs(anchor).max(axis=(1, 2)).tolist()
        top_s = (levels[:, None] * step).max(axis=1).tolist()
        for i, j in chunks:
            bound = max(top_a[i:j]) + 2 * max(top_s[i:j])
            part = block[i * T * c : j * T * c]
            _compute(shape, part, q[i:j], anchor[i:j], step[i:j], G, v_trans, bound)
        return
    for i, j in chunks:
        part = block[i * T * c : j * T * c]
        _gather(shape, part, q[i:j], anchor[i:j], sc[i:j], levels[i:j], NL, G, v_trans)


def _compute(
    shape: _Shape,
    block: npt.NDArray[Any],
    q: U8,
    anchor: F32,
    step: F32,
    G: int,
    v_trans: bool,
    bound: float,
) -> None:
    """Values ``anchor + q * step`` of ``len(q)`` matrices into ``block`` (see _dequantize)."""
    k, T, c = q.shape
    full = T // G
    # the symbols are converted to F32 by a plain copy into a reused scratch array, then scaled
    # in place: a mixed uint8 x F32 multiply runs through numpy's cast buffers, at about twice
    # the time of the two passes (49 against 34 us for 4 SmolLM2 matrices)
    if v_trans:
        # computed channel-major, as the page holds it: every pass after the first (which
        # reads the symbols transposed) runs over contiguous memory
        x = _scratch(k * c * T, np.float32).reshape(k, c, T)
        np.copyto(x, q.transpose(0, 2, 1))
        x *= step[:, :, None]
        a_t = anchor.transpose(0, 2, 1)  # (k, c, n_anchor)
        if full:
            x4 = x[:, :, : full * G].reshape(k, c, full, G)
            assert np.may_share_memory(x4, x)
            x4 += a_t[:, :, :full, None]
        if full * G < T:
            x[:, :, full * G :] += a_t[:, :, full, None]
        target = block.reshape(k, c, T)
    else:
        x = _scratch(k * T * c, np.float32).reshape(k, T, c)
        np.copyto(x, q)
        x *= step[:, None, :]
        if full:
            x4 = x[:, : full * G].reshape(k, full, G, c)
            assert np.may_share_memory(x4, x)
            x4 += anchor[:, :full, None, :]
        if full * G < T:
            x[:, full * G :] += anchor[:, full, None, :]
        target = block.reshape(k, T, c)
    if shape.float_type == _F16:
        _scaled_half_bits(x, target.view(np.uint16), bound)
    else:
        target[...] = x


def _gather(
    shape: _Shape,
    block: npt.NDArray[Any],
    q: U8,
    anchor: F32,
    sc: F32,
    levels: npt.NDArray[np.int32],
    NL: int,
    G: int,
    v_trans: bool,
) -> None:
    """Values of ``len(q)`` matrices into ``block`` from a table of every value a (matrix,
    anchor group, channel) can take (F32 pages of many tokens per table)."""
    k, T, c = q.shape
    n_anchor = anchor.shape[1]
    full = T // G
    out = block.reshape(k, c, T).transpose(0, 2, 1) if v_trans else block.reshape(k, T, c)
    ramp = (np.arange(NL)[None, :] - levels[:, None]).astype(np.float32)  # (k, NL)
    table = anchor[..., None] + ramp[:, None, None, :] * sc[:, 1, None, :, None]
    lut = (_half_bits(table) if shape.float_type == _F16 else table).reshape(-1)
    # index of (matrix, group, channel, 0) in the table
    base = (np.arange(k * n_anchor * c, dtype=np.uint32) * NL).reshape(k, n_anchor, c)
    if full:
        idx = np.add(
            q[:, : full * G].reshape(k, full, G, c), base[:, :full, None, :], dtype=np.uint32
        )
        split = out[:, : full * G].reshape(k, full, G, c)  # splits an axis: always a view
        assert np.may_share_memory(split, block)
        np.take(lut, idx, out=split.view(lut.dtype), mode="clip")
    if full * G < T:
        idx = np.add(q[:, full * G :], base[:, full, None, :], dtype=np.uint32)
        np.take(lut, idx, out=out[:, full * G :].view(lut.dtype), mode="clip")


_LOCAL = threading.local()


def _scratch(n: int, dtype: type[np.generic], slot: int = 0) -> npt.NDArray[Any]:
    """A reused array of ``n`` elements for this thread (contents undefined): a fresh array of a
    chunk's size is an mmap whose pages fault in on every decode."""
    key = (slot, np.dtype(dtype).str)
    pool: dict[tuple[int, str], npt.NDArray[Any]] | None = getattr(_LOCAL, "pool", None)
    if pool is None:
        pool = _LOCAL.pool = {}
    buf = pool.get(key)
    if buf is None or buf.size < n:
        buf = pool[key] = np.empty(n, dtype)
    return buf[:n]


#: 2**-112: an F32 times this has, for every value F16 can hold (normal or subnormal), the F16
#: exponent in its own exponent field, and F16's subnormals land in F32's subnormals
_F16_SCALE = np.float32(2.0**-112)
#: the largest scaled magnitude that still rounds to a finite F16 (65504 + half an ulp, less)
_F16_BOUND = 65519.0 * 2.0**-112


def _scaled_half_bits(x: F32, out: npt.NDArray[np.uint16], bound: float) -> None:
    """Write as F16 bit patterns the values ``x * 2**112`` (``x``: a scratch array holding the
    values times ``2**-112``, overwritten) into ``out`` (any strides), rounded to nearest;
    ``bound`` bounds ``|x|`` (from the scales, before the pass over the values).

    Integer arithmetic only, a few cheap passes instead of numpy's scalar F32 to F16 cast (3.3
    ns a value) or a gather from a 1 MiB table: the scaled value's bits, rounded at bit 13 and
    shifted, are the F16's exponent and mantissa (a mantissa that rounds up carries into the
    exponent, as F16 rounding does; bits 28-30 are clear for every value F16 can hold, so the
    shift leaves bit 15 clear); the sign, bit 31, reaches bit 15 through a 16-bit scratch array
    (half the bytes of moving it within the 32-bit values: 1.46 ms instead of 1.86 ms for a
    SmolLM2 page on one core). The result equals :func:`_half_bits` of the unscaled
    values for normal F16 values (ties away from zero); a subnormal may differ by one ulp
    (2**-24) where the scaling rounded first. Values that may lie beyond F16's range (only a
    damaged payload's scales allow them) go through :func:`_half_bits`.
    """
    if not bound < _F16_BOUND:
        np.multiply(x, np.float32(2.0**112), out=x)
        out[...] = _half_bits(x)
        return
    u = np.ascontiguousarray(x).view(np.uint32)
    u += np.uint32(0x1000)
    sign = _scratch(u.size, np.uint16, slot=1).reshape(u.shape)
    np.right_shift(u, np.uint32(16), out=sign, casting="unsafe")
    sign &= np.uint16(0x8000)
    np.right_shift(u, np.uint32(13), out=out, casting="unsafe")
    out |= sign


#: F16 bits of every F32 whose top 19 bits (sign, exponent, 10 mantissa bits) are the index:
#: numpy's F32 to F16 cast is a scalar loop on the CPUs measured (3.3 ns a value); rounding the
#: F32 bits and looking them up here takes about half that (1 MiB, built once, lazily)
_HALF_TABLE: npt.NDArray[np.uint16] | None = None


def _half_bits(x: F32) -> npt.NDArray[np.uint16]:
    """``x`` (a scratch array: overwritten) as F16 bit patterns, rounded to nearest (ties away
    from zero, where numpy rounds them to even: the two differ in 1 of 16k values by one ulp)."""
    assert x.dtype == np.float32
    global _HALF_TABLE
    if _HALF_TABLE is None:
        with np.errstate(over="ignore"):
            bits = np.arange(1 << 19, dtype=np.uint32) << np.uint32(13)
            _HALF_TABLE = bits.view(np.float32).astype(np.float16).view(np.uint16)
    u = np.ascontiguousarray(x).view(np.uint32)
    np.add(u, np.uint32(0x1000), out=u)
    np.right_shift(u, np.uint32(13), out=u)
    return np.take(_HALF_TABLE, u, mode="clip")


def _decode_symbols(h: _Header, view: memoryview, sizes: list[int], bits: list[int]) -> U8:
    coded = view[h.coded_at : h.coded_at + h.coded_size]
    total = sum(sizes)
    if h.coder == "zstd":
        import zstandard

        try:
            raw = zstandard.ZstdDecompressor().decompress(coded, max_output_size=total)
        except zstandard.ZstdError as exc:
            raise StateFormatError(f"{NAME} symbols do not decode: {exc}") from exc
        if len(raw) != total:
            raise StateFormatError(f"{NAME} symbols: {len(raw)} bytes, expected {total}")
        return np.frombuffer(raw, dtype=np.uint8)
    return _ans_decode(coded, sizes, bits)


def _ans_decode(coded: memoryview, sizes: list[int], bits: list[int]) -> U8:
    import constriction

    n_syms = [2 * _levels(b) + 1 if b < 8 else 2 * ANCHOR_LEVELS + 1 for b in bits]
    table_bytes = 2 * sum(n_syms)
    if len(coded) < table_bytes or (len(coded) - table_bytes) % 4:
        raise StateFormatError(f"{NAME} ANS payload truncated")
    counts = np.frombuffer(coded, dtype="<u2", count=sum(n_syms))
    words = np.frombuffer(coded, dtype="<u4", offset=table_bytes).astype(np.uint32)
    out = np.empty(sum(sizes), dtype=np.uint8)
    try:
        dec = constriction.stream.stack.AnsCoder(words)
        pos = at = 0
        for size, n in zip(sizes, n_syms, strict=True):
            table = counts[at : at + n]
            at += n
            if not table.all():
                raise StateFormatError(f"{NAME} ANS model with an empty symbol")
            out[pos : pos + size] = dec.decode(_ans_model(table), size)
            pos += size
    except StateFormatError:
        raise
    except Exception as exc:  # constriction raises plain exceptions on damaged words
        raise StateFormatError(f"{NAME} ANS symbols do not decode: {exc}") from exc
    return out


def error_bound(stored: bytes | bytearray | memoryview) -> float:
    """The largest absolute error any value of the page may have (half the largest delta step,
    before rounding the result to the page's float type); for tests and qualification."""
    view = memoryview(stored).cast("B")
    h = _header(view, None)
    scales = np.frombuffer(view, h.shape.dtype, 2 * sum(h.shape.channels), h.scales_at)
    steps: list[float] = []
    pos = 0
    for c in h.shape.channels:
        steps.append(float(np.abs(scales[pos + c : pos + 2 * c].astype(np.float32)).max()))
        pos += 2 * c
    return max(steps) / 2
