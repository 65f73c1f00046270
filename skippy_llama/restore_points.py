"""Restore points: whole-sequence states of recurrent and hybrid models at prompt ends.

A recurrent layer (Mamba, Gated DeltaNet, a short convolution) keeps one state per sequence, for
the position the sequence is at, so a prefix of such a model can be restored only where its state
was captured (DESIGN.md section 13, issue 46). This first step keeps the whole sequence state
(``llama_state_seq_get_data``: attention cells and recurrent state together) at the end of each
prompt, where a chat's next turn or the next question on a shared document continues. A later
prompt that extends a stored point's tokens restores the deepest one and decodes only the rest.

The store is pure bookkeeping (no llama.cpp): points are keyed by the chain key of their tokens
(:func:`skippy_llama.identity.chain_key` from the cache identity's root), and evicted least
recently used first to stay within a byte budget.

Beyond this process a point travels as a *record* (:func:`pack_point`): a versioned header, the
tokens and the state, with a digest over both. Stored records are input: :func:`unpack_point`
checks the header, the lengths, the digest and that the tokens hash to the key the record was
asked for under (the cache identity), and raises
:class:`~skippy_llama.errors.StoreDataError` for anything else; nothing is unpickled. The tiers
that keep records (L2 host RAM, L3 disk) implement :class:`PointTier`.
"""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt
import xxhash

from .errors import StateFormatError, StoreDataError
from .identity import chain_key
from .state.format import parse_state
from .state.pages import assemble, cut_pages, page_from_bytes

#: Bytes all restore points of one model may hold by default (host RAM).
DEFAULT_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class RestorePoint:
    """The whole state of a sequence holding exactly ``tokens``.

    ``recurrent``: how many of ``blob``'s last bytes are the state that is not per token (what
    ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` writes after its 8-byte header); 0 when unknown.
    Before them lie the attention cells, which :func:`compose_point` cuts into pages.
    """

    tokens: npt.NDArray[np.int32]
    blob: bytes
    recurrent: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


#: A record: magic, format version, token count, state bytes, xxh3_128 of the identity root,
#: xxh3_128(tokens || state).
_MAGIC = b"SKRP"
POINT_FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sBxxxIQ16s16s")


def point_key(root: bytes, tokens: Sequence[int] | npt.NDArray[np.integer[Any]]) -> bytes:
    """The key of the restore point after ``tokens`` under the cache identity ``root``."""
    return chain_key(root, np.asarray(tokens, dtype=np.int32))


def _digest(tokens: bytes, blob: bytes | memoryview) -> bytes:
    h = xxhash.xxh3_128(tokens)
    h.update(blob)
    return h.digest()


def pack_point(point: RestorePoint, root: bytes) -> bytes:
    """The record of ``point`` under the cache identity ``root``: header, tokens (int32
    little-endian), state."""
    tokens = np.asarray(point.tokens, dtype="<i4").tobytes()
    head = _HEAD.pack(
        _MAGIC,
        POINT_FORMAT_VERSION,
        point.n_tokens,
        len(point.blob),
        xxhash.xxh3_128_digest(root),
        _digest(tokens, point.blob),
    )
    return b"".join((head, tokens, point.blob))


def unpack_point(raw: bytes | memoryview, *, root: bytes, key: bytes) -> RestorePoint:
    """The point a record holds, checked: format, lengths, digest, and that its tokens give
    ``key`` under ``root`` (a record stored for another model, identity or prefix is refused).

    Raises:
        StoreDataError: the record is damaged, foreign or not the one asked for.
    """
    view = memoryview(raw)
    if len(view) < _HEAD.size:
        raise StoreDataError(f"restore-point record of {len(view)} bytes is shorter than a header")
    magic, version, n_tokens, n_blob, identity, digest = _HEAD.unpack_from(view)
    if magic != _MAGIC:
        raise StoreDataError("not a restore-point record (magic)")
    if version != POINT_FORMAT_VERSION:
        raise StoreDataError(
            f"restore-point record version {version} is not {POINT_FORMAT_VERSION}"
        )
    if identity != xxhash.xxh3_128_digest(root):
        raise StoreDataError("restore-point record of another cache identity")
    if n_tokens == 0 or len(view) != _HEAD.size + 4 * n_tokens + n_blob:
        raise StoreDataError("restore-point record length does not match its header")
    tokens = bytes(view[_HEAD.size : _HEAD.size + 4 * n_tokens])
    blob = bytes(view[_HEAD.size + 4 * n_tokens :])
    if _digest(tokens, blob) != digest:
        raise StoreDataError("restore-point record digest mismatch")
    arr = np.frombuffer(tokens, dtype="<i4").astype(np.int32)
    if point_key(root, arr) != key:
        raise StoreDataError("restore-point record holds other tokens than its key's")
    return RestorePoint(arr, blob)


@dataclass(frozen=True)
class PointOwner:
    """Whose points a tier keeps (listed by ``kv-cache status``)."""

    model_identity: str = ""
    model_name: str = ""


def prefill_points(start: int, end: int, every: int) -> list[int]:
    """Where to keep restore points while prefilling tokens ``[start, end)`` (``end`` itself,
    the prompt's end, gets its point anyway): multiples of ``every`` that are ``every`` times a
    power of two, and the deepest multiple of ``every`` before ``end``.

    Points are whole states today, so a hybrid model's point at p holds p tokens of attention
    cells: one every ``every`` tokens would store a prompt's cells about ``end / (2 every)``
    times over. Doubling spacing keeps that under twice the deepest point's bytes while a later
    prompt sharing k >= ``every`` tokens still re-decodes at most half of them, and the
    deepest point serves the next question on the same document (at most ``every - 1`` tokens
    re-decoded).

    Example:
        >>> prefill_points(0, 2020, 256)
        [256, 512, 1024, 1792]
        >>> prefill_points(1792, 2040, 256)
        []
    """
    if every <= 0:
        return []
    deepest = (end - 1) // every * every
    out = []
    k = every
    while k < deepest:
        if k > start:
            out.append(k)
        k *= 2
    if deepest > start:
        out.append(deepest)
    return out


def lone_ubatch(n: int, n_batch: int, n_ubatch: int) -> bool:
    """Whether ``Llama.eval`` of ``n`` tokens hands llama.cpp a micro-batch of a single token:
    it decodes batches of ``n_batch`` tokens, which llama.cpp cuts into micro-batches of
    ``n_ubatch`` (at most ``n_batch``), the last of each batch shorter.

    Example:
        >>> lone_ubatch(1, 512, 512), lone_ubatch(513, 512, 512), lone_ubatch(514, 512, 512)
        (True, True, False)
    """
    unit = max(1, min(n_ubatch, n_batch))
    if n <= 0:
        return False
    if unit == 1:
        return True
    return any(min(n_batch, n - start) % unit == 1 for start in range(0, n, n_batch))


def lone_free_points(
    start: int, end: int, points: Sequence[int], n_batch: int, n_ubatch: int
) -> list[int] | None:
    """Of ``points`` (ascending, inside ``(start, end)``), those a prefill of ``[start, end)``
    may stop at so that no decode hands llama.cpp a one-token micro-batch (each piece between
    consecutive stops, and the last one up to ``end``, decoded by one ``Llama.eval``); None
    when even the whole ``[start, end)`` in one piece would decode one (see
    :func:`lone_ubatch`). Builds whose lone decodes differ from batched ones (stock
    ggml-cpu, without patch 0004) restore and prefill only along such pieces.

    Example:
        >>> lone_free_points(0, 514, [256, 513], 512, 512)
        [256]
        >>> lone_free_points(512, 513, [], 512, 512) is None
        True
    """
    kept: list[int] = []
    prev = start
    for p in points:
        if not lone_ubatch(p - prev, n_batch, n_ubatch):
            kept.append(p)
            prev = p
    while lone_ubatch(end - prev, n_batch, n_ubatch):
        if not kept:
            return None
        kept.pop()
        prev = kept[-1] if kept else start
    return kept


#: Cell-ext bytes a hybrid model's attention cells may carry (0, or 12 for M-RoPE models such as
#: Qwen3.5); the state does not say which, so :func:`compose_point` tries each and keeps the one
#: whose pages rebuild the cells byte for byte.
_EXT_BYTES = (0, 12)


@dataclass(frozen=True)
class ComposedPoint:
    """A restore point as parts: attention pages (serialized, ``page_tokens`` each from
    position 0, the last one possibly shorter), the bytes before the recurrent state when there
    are no attention cells (``head``, else empty), and the recurrent state (``tail``)."""

    pages: tuple[bytes, ...]
    head: bytes
    tail: bytes


def compose_point(point: RestorePoint, page_tokens: int) -> ComposedPoint | None:
    """``point`` as attention pages + the recurrent state after them, or None where it cannot
    be cut (unknown split, cells out of order, an unexpected layout): the caller keeps the
    whole state then. Checked: the pages rebuild the attention cells byte for byte."""
    blob, recurrent = point.blob, point.recurrent
    if recurrent <= 0 or recurrent > len(blob) - 8 or page_tokens <= 0:
        return None
    cut = len(blob) - recurrent
    attention, tail = blob[:cut], blob[cut:]
    if cut == 8:  # magic and sequence id only: a purely recurrent model
        return ComposedPoint((), attention, tail)
    for ext in _EXT_BYTES:
        try:
            state = parse_state(attention, ext)
            if state.n_tokens != point.n_tokens:
                continue
            pages = tuple(page.to_bytes() for page in cut_pages(state, page_tokens))
            if recompose_point(pages, b"", b"") == attention:
                return ComposedPoint(pages, b"", tail)
        except (StateFormatError, ValueError):
            continue
    return None


def recompose_point(pages: Sequence[bytes], head: bytes, tail: bytes) -> bytes:
    """The whole state :func:`compose_point` took apart.

    Raises:
        StateFormatError: a page does not parse or the pages do not fit together.
    """
    if not pages:
        return head + tail
    parsed = [page_from_bytes(page) for page in pages]
    return bytes(assemble(parsed, parsed[0].layout)) + tail


@dataclass(frozen=True)
class PointValues:
    """A restore point as the values a store keeps: its record (``pack_composed``, or
    ``pack_point`` for a state that cannot be cut) and its attention pages as (chain key,
    page bytes) from position 0, the keys chained from the cache identity's root over the
    point's tokens (so a page is shared by every point whose tokens run through it)."""

    record: bytes
    pages: tuple[tuple[bytes, bytes], ...]


def point_values(point: RestorePoint, root: bytes, page_tokens: int) -> PointValues:
    """``point`` as the values L3, the remote tier and bundles keep (see :class:`PointValues`)."""
    composed = compose_point(point, page_tokens)
    if composed is None:
        return PointValues(pack_point(point, root), ())
    pages = []
    parent = root
    for i, page in enumerate(composed.pages):
        end = min((i + 1) * page_tokens, point.n_tokens)
        parent = chain_key(parent, point.tokens[i * page_tokens : end])
        pages.append((parent, page))
    refs = tuple((key, page_digest(page)) for key, page in pages)
    record = ComposedRecord(point.tokens, refs, composed.head, composed.tail)
    return PointValues(pack_composed(record, root), tuple(pages))


def page_keys(tokens: npt.NDArray[np.int32], root: bytes, page_tokens: int) -> list[bytes]:
    """The chain keys of the attention pages of a composed point after ``tokens`` (what
    :func:`point_values` names them), to check a record's references against its tokens."""
    keys = []
    parent = root
    for start in range(0, len(tokens), page_tokens):
        parent = chain_key(parent, tokens[start : start + page_tokens])
        keys.append(parent)
    return keys


#: A composed record: magic, version, token count, page count, head bytes, tail bytes, xxh3_128
#: of the identity root, xxh3_128 of the body (tokens, page references, head, tail).
_COMPOSED_MAGIC = b"SKRC"
_COMPOSED_HEAD = struct.Struct("<4sBxxxIIIQ16s16s")
_REF = struct.Struct("<16s16s")  # page key, xxh3_128 of the stored page


@dataclass(frozen=True)
class ComposedRecord:
    """What a composed record holds: the point's tokens, its pages as (key, digest) in order,
    and the head and tail of :class:`ComposedPoint`."""

    tokens: npt.NDArray[np.int32]
    refs: tuple[tuple[bytes, bytes], ...]
    head: bytes
    tail: bytes


def page_digest(page: bytes | memoryview) -> bytes:
    """The digest a composed record keeps of each of its pages."""
    return xxhash.xxh3_128_digest(page)


def is_composed(raw: bytes | memoryview) -> bool:
    """Whether a stored record is composed (else whole, or not a record at all)."""
    return bytes(memoryview(raw)[:4]) == _COMPOSED_MAGIC


def pack_composed(record: ComposedRecord, root: bytes) -> bytes:
    """The record of a composed point under the cache identity ``root``."""
    tokens = np.asarray(record.tokens, dtype="<i4").tobytes()
    refs = b"".join(_REF.pack(key, digest) for key, digest in record.refs)
    body = b"".join((tokens, refs, record.head, record.tail))
    head = _COMPOSED_HEAD.pack(
        _COMPOSED_MAGIC,
        POINT_FORMAT_VERSION,
        len(record.tokens),
        len(record.refs),
        len(record.head),
        len(record.tail),
        xxhash.xxh3_128_digest(root),
        xxhash.xxh3_128_digest(body),
    )
    return head + body


def unpack_composed(raw: bytes | memoryview, *, root: bytes, key: bytes) -> ComposedRecord:
    """A composed record, checked as :func:`unpack_point` checks a whole one.

    Raises:
        StoreDataError: the record is damaged, foreign or not the one asked for.
    """
    view = memoryview(raw)
    if len(view) < _COMPOSED_HEAD.size:
        raise StoreDataError(f"composed restore-point record of {len(view)} bytes is too short")
    magic, version, n_tokens, n_refs, n_head, n_tail, identity, digest = _COMPOSED_HEAD.unpack_from(
        view
    )
    if magic != _COMPOSED_MAGIC:
        raise StoreDataError("not a composed restore-point record (magic)")
    if version != POINT_FORMAT_VERSION:
        raise StoreDataError(
            f"restore-point record version {version} is not {POINT_FORMAT_VERSION}"
        )
    if identity != xxhash.xxh3_128_digest(root):
        raise StoreDataError("restore-point record of another cache identity")
    size = _COMPOSED_HEAD.size + 4 * n_tokens + _REF.size * n_refs + n_head + n_tail
    if n_tokens == 0 or len(view) != size:
        raise StoreDataError("restore-point record length does not match its header")
    body = view[_COMPOSED_HEAD.size :]
    if xxhash.xxh3_128_digest(body) != digest:
        raise StoreDataError("restore-point record digest mismatch")
    off = 4 * n_tokens
    tokens = np.frombuffer(bytes(body[:off]), dtype="<i4").astype(np.int32)
    if point_key(root, tokens) != key:
        raise StoreDataError("restore-point record holds other tokens than its key's")
    refs = tuple(_REF.unpack_from(body, off + i * _REF.size) for i in range(n_refs))
    off += _REF.size * n_refs
    head = bytes(body[off : off + n_head])
    tail = bytes(body[off + n_head :])
    return ComposedRecord(tokens, refs, head, tail)


#: What a point tier is for, which decides where the runtime stores points (not its name):
#: ``durable`` keeps them across restarts and is stored first (L3); ``mirror`` holds only what a
#: durable tier took or served, in this process (L2); ``shared`` is what other hosts read
#: (remote): it gets what the durable tier took, or every point where there is none.
PointRole = Literal["durable", "mirror", "shared"]


class PointTier(Protocol):
    """A tier that keeps restore-point records beyond the live process's own points (L2 host
    RAM, L3 disk, the remote tier). Lookups never raise: a damaged record is a miss and a
    counter."""

    name: str
    role: PointRole

    def point_lengths(self, root: bytes) -> list[int]:
        """Token counts of the points stored under ``root`` (deepest first or any order)."""
        ...

    def get_point(self, root: bytes, tokens: npt.NDArray[np.int32]) -> RestorePoint | None:
        """The verified point after exactly ``tokens``, None when absent or damaged."""
        ...

    def put_point(self, root: bytes, point: RestorePoint, owner: PointOwner) -> bool:
        """Keep ``point``; False when refused (budget, state, error)."""
        ...


class RestorePointStore:
    """Restore points keyed by the chain key of their tokens, LRU within ``max_bytes``.

    Example:
        >>> store = RestorePointStore(root=b"model", max_bytes=1 << 20)
        >>> store.put([1, 2, 3], b"state")
        True
        >>> store.best([1, 2, 3, 4]).n_tokens
        3
    """

    def __init__(self, root: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._points: OrderedDict[bytes, RestorePoint] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # stored points per token count
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._points)

    def lengths(self) -> list[int]:
        """Token counts of the stored points."""
        return list(self._lengths)

    def get(self, tokens: npt.NDArray[np.int32]) -> RestorePoint | None:
        """The point after exactly ``tokens`` (marked recently used), None when absent."""
        key = self._key(tokens)
        point = self._points.get(key)
        if point is None or not np.array_equal(point.tokens, tokens):
            return None
        self._points.move_to_end(key)
        return point

    def _key(self, tokens: npt.NDArray[np.int32]) -> bytes:
        return chain_key(self.root, tokens)

    def put(self, tokens: Sequence[int] | npt.NDArray[np.integer[Any]], blob: bytes) -> bool:
        """Keep ``blob`` as the state after ``tokens``; False when it exceeds the whole budget.

        A point already stored for the same tokens is replaced; older points are evicted until
        the new one fits.
        """
        arr = np.array(tokens, dtype=np.int32)
        if len(arr) == 0 or len(blob) > self.max_bytes:
            return False
        key = self._key(arr)
        self._drop(key)
        while self._points and self.bytes + len(blob) > self.max_bytes:
            self._drop(next(iter(self._points)))
        self._points[key] = RestorePoint(arr, blob)
        self._lengths[len(arr)] += 1
        self.bytes += len(blob)
        return True

    def best(self, prompt: Sequence[int] | npt.NDArray[np.integer[Any]]) -> RestorePoint | None:
        """The deepest stored point whose tokens are a proper prefix of ``prompt`` (at least one
        prompt token is left to decode, whose logits sampling needs); marks it recently used."""
        arr = np.asarray(prompt, dtype=np.int32)
        for n in sorted((n for n in self._lengths if n < len(arr)), reverse=True):
            key = self._key(arr[:n])
            point = self._points.get(key)
            # the tokens are compared too: a key collision must be a miss, never a wrong state
            if point is not None and np.array_equal(point.tokens, arr[:n]):
                self._points.move_to_end(key)
                return point
        return None

    def clear(self) -> None:
        """Drop every point."""
        self._points.clear()
        self._lengths.clear()
        self.bytes = 0

    def _drop(self, key: bytes) -> None:
        point = self._points.pop(key, None)
        if point is None:
            return
        self.bytes -= len(point.blob)
        self._lengths[point.n_tokens] -= 1
        if self._lengths[point.n_tokens] == 0:
            del self._lengths[point.n_tokens]


class RamPoints:
    """L2 for restore points: verified points in host RAM within ``max_bytes``, a mirror of
    what L3 holds (filled when L3 stores or serves a point). Serves one identity root, the
    first it is given (one per ``SkippyLlama``); points of any other are refused."""

    name = "l2"
    role: PointRole = "mirror"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._store: RestorePointStore | None = None

    @property
    def stored_bytes(self) -> int:
        """Bytes of the points held."""
        return self._store.bytes if self._store is not None else 0

    def _of(self, root: bytes) -> RestorePointStore | None:
        store = self._store
        return store if store is not None and store.root == root else None

    def point_lengths(self, root: bytes) -> list[int]:
        store = self._of(root)
        return store.lengths() if store is not None else []

    def get_point(self, root: bytes, tokens: npt.NDArray[np.int32]) -> RestorePoint | None:
        store = self._of(root)
        return store.get(tokens) if store is not None else None

    def put_point(self, root: bytes, point: RestorePoint, owner: PointOwner) -> bool:
        if self._store is None:
            self._store = RestorePointStore(root, self.max_bytes)
        store = self._of(root)
        return store is not None and store.put(point.tokens, point.blob)

    def clear(self) -> None:
        if self._store is not None:
            self._store.clear()
