"""Build synthetic llama.cpp sequence-state blobs for the state-codec tests.

Written independently of :mod:`skippy_llama.state`: nothing here calls the parser or the page
code. Blobs follow the format in the docstring of ``skippy_llama/state/format.py``, all
little-endian::

    u32 magic 0xaf143cd8, i32 seq_id, u32 n_stream
    per stream: u32 cell_count (0 -> next stream)
      per cell: i32 pos, u32 n_seq_id (=1), [ext bytes], i32 seq_id
      u32 v_trans, u32 n_layer
      per layer K: i32 type, u64 row_bytes, row_bytes * cells
      per layer V (v_trans 0): i32 type, u64 row_bytes, row_bytes * cells
      per layer V (v_trans 1): i32 type, u32 elem_bytes, u32 n_embd,
                               n_embd rows of elem_bytes * cells

The content of a token is fixed by its *position*: :class:`Content` holds, per position, the cell
ext bytes, each layer's K row and each layer's V row (for transposed V: the token's ``n_embd``
elements, which the blob scatters into a column). So a blob of any length and any cell order can
be built from one :class:`Content`, and blobs of different lengths agree on shared positions.

:func:`build_state` also returns labelled byte spans (:class:`Span`) so tests can tell which
field a corrupted byte belongs to.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MAGIC = 0xAF143CD8

F32 = 0
F16 = 1
Q8_0 = 8

#: ggml type id -> (elements per block, bytes per block)
BLOCKS = {F32: (1, 4), F16: (1, 2), Q8_0: (32, 34)}
TYPE_NAMES = {F32: "F32", F16: "F16", Q8_0: "Q8_0"}


def row_bytes(ggml_type: int, n_elem: int) -> int:
    """Bytes of a row of ``n_elem`` elements of a ggml type (whole blocks only)."""
    per_block, block_bytes = BLOCKS[ggml_type]
    if n_elem % per_block:
        raise ValueError(f"{n_elem} elements is not a whole number of {per_block}-element blocks")
    return n_elem // per_block * block_bytes


def elem_bytes(ggml_type: int) -> int:
    """Element size of a float type (transposed V is only ever F32/F16 in llama.cpp)."""
    if ggml_type not in (F32, F16):
        raise ValueError(f"transposed V needs F32 or F16, not type {ggml_type}")
    return BLOCKS[ggml_type][1]


@dataclass(frozen=True)
class Spec:
    """The shape of a synthetic state: everything but the token count and the bytes."""

    n_layer: int = 2
    k_type: int = F16
    v_type: int = F16
    #: K / V elements per token per layer (an int for all layers, or one per layer).
    n_embd_k: int | tuple[int, ...] = 32
    n_embd_v: int | tuple[int, ...] = 32
    v_trans: bool = False
    ext_bytes: int = 0
    n_stream: int = 1
    stream: int = 0

    def __post_init__(self) -> None:
        if self.v_trans:
            elem_bytes(self.v_type)
        if not 0 <= self.stream < self.n_stream:
            raise ValueError(f"stream {self.stream} outside {self.n_stream} streams")

    def embd_k(self, layer: int) -> int:
        return self.n_embd_k if isinstance(self.n_embd_k, int) else self.n_embd_k[layer]

    def embd_v(self, layer: int) -> int:
        return self.n_embd_v if isinstance(self.n_embd_v, int) else self.n_embd_v[layer]

    def k_row(self, layer: int) -> int:
        return row_bytes(self.k_type, self.embd_k(layer))

    def v_row(self, layer: int) -> int:
        """V bytes per token (a row, or ``n_embd`` elements when transposed)."""
        return row_bytes(self.v_type, self.embd_v(layer))

    def bytes_per_token(self) -> int:
        return (
            12 + self.ext_bytes + sum(self.k_row(il) + self.v_row(il) for il in range(self.n_layer))
        )


@dataclass(frozen=True)
class Content:
    """Per-position token content: ``ext[p]``, ``k[layer][p]``, ``v[layer][p]``."""

    spec: Spec
    ext: np.ndarray
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]

    @property
    def n_tokens(self) -> int:
        return int(self.ext.shape[0])


def make_content(spec: Spec, n_tokens: int, seed: int = 0) -> Content:
    """Random token content for positions ``0..n_tokens-1`` from a seeded RNG."""
    rng = np.random.default_rng(seed)

    def rand(cols: int) -> np.ndarray:
        return rng.integers(0, 256, size=(n_tokens, cols), dtype=np.uint8)

    ext = rand(spec.ext_bytes)
    k = tuple(rand(spec.k_row(il)) for il in range(spec.n_layer))
    v = tuple(rand(spec.v_row(il)) for il in range(spec.n_layer))
    return Content(spec, ext, k, v)


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, stop)`` of a blob hold field ``kind`` (``layer``/``cell`` where relevant)."""

    kind: str
    start: int
    stop: int
    layer: int = -1
    cell: int = -1


@dataclass
class Built:
    """A built blob with the spans of its fields, in blob order (they tile the blob)."""

    data: bytes
    spans: list[Span] = field(default_factory=list)
    #: position of each cell, in blob order
    positions: tuple[int, ...] = ()

    def span_at(self, offset: int) -> Span:
        for span in self.spans:
            if span.start <= offset < span.stop:
                return span
        raise IndexError(offset)

    def spans_of(self, *kinds: str) -> list[Span]:
        return [s for s in self.spans if s.kind in kinds]


class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.spans: list[Span] = []
        self.off = 0

    def put(self, kind: str, data: bytes, layer: int = -1, cell: int = -1) -> None:
        if data:
            self.spans.append(Span(kind, self.off, self.off + len(data), layer, cell))
        self.parts.append(data)
        self.off += len(data)


def build_state(
    content: Content,
    n_tokens: int | None = None,
    *,
    order: Sequence[int] | None = None,
    seq_id: int = 0,
    cell_seq_id: int | None = None,
) -> Built:
    """Serialize the first ``n_tokens`` positions of ``content`` as a sequence-state blob.

    Args:
        content: the per-position token content.
        n_tokens: how many positions (default all of ``content``).
        order: the position of each cell in blob order, a permutation of ``range(n_tokens)``
            (default sorted). Not checked, so tests can also write duplicated or gapped positions.
        seq_id: the sequence id in the header.
        cell_seq_id: the sequence id written in every cell (default ``seq_id``).
    """
    spec = content.spec
    n = content.n_tokens if n_tokens is None else n_tokens
    if n > content.n_tokens:
        raise ValueError(f"content has {content.n_tokens} tokens, asked for {n}")
    pos = list(range(n)) if order is None else [int(p) for p in order]
    if len(pos) != n:
        raise ValueError(f"order has {len(pos)} cells for {n} tokens")
    # rows are looked up by position; out-of-range positions (corruption tests) wrap
    rows = [p % content.n_tokens if content.n_tokens else 0 for p in pos]
    cell_seq = seq_id if cell_seq_id is None else cell_seq_id

    w = _Writer()
    w.put("magic", struct.pack("<I", MAGIC))
    w.put("seq_id", struct.pack("<i", seq_id))
    w.put("n_stream", struct.pack("<I", spec.n_stream))
    for s in range(spec.n_stream):
        count = n if s == spec.stream else 0
        w.put("cell_count", struct.pack("<I", count))
        if count == 0:
            continue
        for i, (p, r) in enumerate(zip(pos, rows, strict=True)):
            w.put("pos", struct.pack("<i", p), cell=i)
            w.put("n_seq_id", struct.pack("<I", 1), cell=i)
            w.put("ext", content.ext[r].tobytes(), cell=i)
            w.put("cell_seq_id", struct.pack("<i", cell_seq), cell=i)
        w.put("v_trans", struct.pack("<I", int(spec.v_trans)))
        w.put("n_layer", struct.pack("<I", spec.n_layer))
        for il in range(spec.n_layer):
            w.put("k_type", struct.pack("<i", spec.k_type), layer=il)
            w.put("k_row", struct.pack("<Q", spec.k_row(il)), layer=il)
            w.put("k_data", b"".join(content.k[il][r].tobytes() for r in rows), layer=il)
        for il in range(spec.n_layer):
            w.put("v_type", struct.pack("<i", spec.v_type), layer=il)
            if spec.v_trans:
                elem = elem_bytes(spec.v_type)
                embd = spec.embd_v(il)
                w.put("v_elem", struct.pack("<I", elem), layer=il)
                w.put("v_embd", struct.pack("<I", embd), layer=il)
                # row j of the transposed block: element j of every cell, in cell order
                per_cell = [content.v[il][r].reshape(embd, elem) for r in rows]
                data = b"".join(b"".join(c[j].tobytes() for c in per_cell) for j in range(embd))
                w.put("v_data", data, layer=il)
            else:
                w.put("v_row", struct.pack("<Q", spec.v_row(il)), layer=il)
                w.put("v_data", b"".join(content.v[il][r].tobytes() for r in rows), layer=il)
    return Built(b"".join(w.parts), w.spans, tuple(pos))


def shuffled(n: int, seed: int) -> list[int]:
    """A seeded random permutation of ``range(n)`` (cells in scrambled position order)."""
    return [int(p) for p in np.random.default_rng(seed).permutation(n)]
