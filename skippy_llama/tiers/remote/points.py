"""Restore points on the shared server (issue 46, DESIGN.md section 13): recurrent, hybrid and
sliding-window models' prefixes, pushed by one host and served to every host of the same cache
identity.

The same composed form as L3 (``tiers/l3/points.py``): a point's attention cells as pages of
:data:`~..l3.points.PAGE_TOKENS` tokens under their chain keys, shared by every point whose
tokens run through them, and the point's record (the snapshot: recurrent state or the window's
cells, and the references to its pages) under its point key; a state that cannot be cut travels
whole. Keys (``keys.py``): ``r:`` records, ``q:`` pages (apart from the paged cache's ``p:``
pages, whose layout is all layers), and one ``n:`` hash per identity listing the token counts
points exist at, so a lookup learns the candidate depths in one round trip.

Every value is a ``codec.py`` frame (HMAC under the shared secret over the key it is stored
under, digest of the body), and the record inside is checked again as L3 checks it (header,
lengths, digest, identity, tokens against the key), each page against the digest its record
keeps. Any failure is a miss and a counter (``point_misses``, ``bad_values`` by reason), never
an exception: a value that can never be served is deleted so the next push stores it again; a
page the server evicted is only counted (the next push of a point through it sends it again).
Server faults go through the store's breaker like page reads and writes.

Pushes send only what the server lacks (one pipelined STRLEN round trip over the record and its
pages), then enter the token count in the identity's length index.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ...errors import StateFormatError, StoreDataError
from ...restore_points import (
    PointOwner,
    RestorePoint,
    is_composed,
    page_digest,
    point_key,
    point_values,
    recompose_point,
    unpack_composed,
    unpack_point,
)
from ..l3.points import PAGE_TOKENS
from . import codec
from .store import RemoteStore

#: Token counts a length index keeps (a push that finds more starts it over): every lookup reads
#: the whole index, so it must stay small.
MAX_LENGTHS = 1024
#: Pages per pipelined GET of a composed point's pages.
FETCH_BATCH_PAGES = 8
#: What a length-index entry's tag is over.
LENGTH_LABEL = b"remote-point-length"


class _Miss(Exception):
    """A point that cannot be served: ``reason`` is counted; ``drop`` names a value to delete."""

    def __init__(self, reason: str, drop: bytes | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.drop = drop


class RemotePoints:
    """The remote store as a tier of restore points (the ``PointTier`` protocol of
    :mod:`skippy_llama.restore_points`); see the module docstring. Shares the store's
    connection, secret, breaker and counters.

    Args:
        store: the connected store client (its ``status`` carries these counters too).
    """

    name = "remote"

    def __init__(self, store: RemoteStore) -> None:
        self.store = store

    # ------------------------------------------------------------------ reads

    def point_lengths(self, root: bytes) -> list[int]:
        """Token counts the server lists points at under ``root`` (authentic entries only);
        [] on a failure or while the breaker is open."""
        store = self.store
        name = store.keys.point_lengths(root.hex())
        entries = store._run("point lengths", functools.partial(store._client.hgetall, name))
        out: list[int] = []
        for field, tag in list((entries or {}).items())[:MAX_LENGTHS]:
            if not (isinstance(field, bytes) and isinstance(tag, bytes) and field.isdigit()):
                store._bad_value("unauthenticated_length")
                continue
            if not store._signer.verify(tag, store._signer.value(LENGTH_LABEL, name, field)):
                store._bad_value("unauthenticated_length")
                continue
            out.append(int(field))
        return out

    def get_point(self, root: bytes, tokens: npt.NDArray[np.int32]) -> RestorePoint | None:
        """The verified point after exactly ``tokens``; None when absent (not counted: the
        runtime asks at every listed length), damaged or unreachable (counted)."""
        store = self.store
        ident = root.hex()
        key = point_key(root, tokens)
        name = store.keys.point(ident, key)
        # a value of another type answers WRONGTYPE: foreign data, not a server failure
        get = functools.partial(store._pipeline, lambda pipe: pipe.get(name), raise_on_error=False)
        results = store._run("point fetch", get)
        value = results[0] if results else None
        if value is None:
            return None
        try:
            point, n_read = self._read(root, ident, key, name, value)
        except _Miss as exc:
            store._bad_value(exc.reason)
            if exc.drop is not None:
                store._drop(exc.drop)
            store._add("point_misses")
            return None
        except Exception as exc:  # a bug of this module: logged and counted, fails open
            store._failed(exc, "point fetch")
            store._add("point_misses")
            return None
        store._add("point_hits")
        store._add("point_bytes_in", n_read)
        return point

    def _read(
        self, root: bytes, ident: str, key: bytes, name: bytes, value: Any
    ) -> tuple[RestorePoint, int]:
        """The point in record ``value`` read from ``name``, its pages read and checked; and
        the bytes read. Raises _Miss."""
        record = self._body(name, codec.KIND_POINT, value)
        try:
            if not is_composed(record):
                return unpack_point(record, root=root, key=key), len(value)
            composed = unpack_composed(record, root=root, key=key)
        except StoreDataError:
            raise _Miss("damaged_point", name) from None
        pages, n_read = self._pages(ident, composed.refs)
        try:
            blob = recompose_point(pages, composed.head, composed.tail)
        except StateFormatError:
            raise _Miss("damaged_point", name) from None
        point = RestorePoint(composed.tokens, blob, len(composed.tail))
        return point, len(value) + n_read

    def _body(self, name: bytes, kind: int, value: Any) -> Any:
        """The body of ``value`` read from ``name``, checked to be a ``kind`` frame signed
        under this key. Raises _Miss (``foreign``, or the frame's reason)."""
        if not isinstance(value, bytes):
            raise _Miss("foreign", name)
        try:
            return codec.unpack(self.store._signer, name, kind, value).body
        except codec.FrameError as exc:
            raise _Miss(exc.reason, name) from None

    def _pages(self, ident: str, refs: Sequence[tuple[bytes, bytes]]) -> tuple[list[bytes], int]:
        """The pages ``refs`` names, each verified (frame, and the digest its record keeps),
        in pipelined batches; and their stored bytes. Raises _Miss at the first that fails."""
        store = self.store
        pages: list[bytes] = []
        n_read = 0
        for start in range(0, len(refs), FETCH_BATCH_PAGES):
            batch = refs[start : start + FETCH_BATCH_PAGES]
            names = [store.keys.point_page(ident, key) for key, _ in batch]
            values = store._run("point fetch", functools.partial(store._each, "get", names))
            if values is None:
                raise _Miss("point_fetch_failed")
            for (_, digest), name, value in zip(batch, names, values, strict=True):
                if value is None:
                    raise _Miss("point_page_missing")  # evicted: the next push sends it again
                page = bytes(self._body(name, codec.KIND_POINT_PAGE, value))
                if page_digest(page) != digest:
                    # authentic under this key but not what the record names (another point's
                    # page of the same key would be identical): never servable here
                    raise _Miss("point_page_digest", name)
                pages.append(page)
                n_read += len(value)
        return pages, n_read

    # ------------------------------------------------------------------ writes

    def put_point(self, root: bytes, point: RestorePoint, owner: PointOwner) -> bool:
        """Send ``point``'s record and the pages the server lacks, and list its length; False
        when refused or on a failure (counted: ``points_dropped``). ``owner`` is not kept: the
        server's inventory is per cache identity."""
        store = self.store
        ident = root.hex()
        key = point_key(root, point.tokens)
        name = store.keys.point(ident, key)
        values = self._values(root, ident, point, name)
        ttl = store.settings.ttl

        def probe(pipe: Any) -> None:
            for item, _ in values:
                pipe.strlen(item)
                if ttl is not None:
                    pipe.expire(item, ttl)

        store._add("point_pushes")
        lengths = store._run("point push", functools.partial(store._pipeline, probe), write=True)
        if lengths is None:
            store._add("points_dropped")
            return False
        if ttl is not None:
            lengths = lengths[::2]
        sends = [item for item, n in zip(values, lengths, strict=True) if int(n) == 0]
        sent, sent_bytes, ok = store._send(sends)
        store._add("point_values_sent", sent)
        store._add("point_values_present", len(values) - len(sends))
        store._add("point_bytes_out", sent_bytes)
        if not ok or not self._list_length(ident, point.n_tokens):
            store._add("points_dropped")
            return False
        store._add("point_writes")
        return True

    def _values(
        self, root: bytes, ident: str, point: RestorePoint, name: bytes
    ) -> list[tuple[bytes, bytes]]:
        """(server key, frame) of every value of ``point``: its pages first, then its record
        (a reader that finds the record finds its pages, unless the server evicted them)."""
        signer = self.store._signer
        made = point_values(point, root, PAGE_TOKENS)
        values: list[tuple[bytes, bytes]] = []
        for i, (key, page) in enumerate(made.pages):
            pname = self.store.keys.point_page(ident, key)
            n = min(PAGE_TOKENS, point.n_tokens - i * PAGE_TOKENS)
            values.append((pname, codec.pack(signer, pname, codec.KIND_POINT_PAGE, n, page)))
        record = made.record
        values.append((name, codec.pack(signer, name, codec.KIND_POINT, point.n_tokens, record)))
        return values

    def _list_length(self, ident: str, n_tokens: int) -> bool:
        """Enter ``n_tokens`` in the identity's length index (starting it over past
        :data:`MAX_LENGTHS`); False on a failure."""
        store = self.store
        name = store.keys.point_lengths(ident)
        field = str(n_tokens).encode()
        tag = store._signer.value(LENGTH_LABEL, name, field)
        ttl = store.settings.ttl

        def add(pipe: Any) -> None:
            pipe.hset(name, field, tag)
            pipe.hlen(name)
            if ttl is not None:
                pipe.expire(name, ttl)

        results = store._run("point push", functools.partial(store._pipeline, add), write=True)
        if results is None:
            return False
        if int(results[1]) > MAX_LENGTHS:  # a bound, not an LRU: the index starts over

            def restart(pipe: Any) -> None:
                pipe.delete(name)
                pipe.hset(name, field, tag)

            store._run("point push", functools.partial(store._pipeline, restart), write=True)
        return True

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """The store's state and counters (restore points' among them); no server call."""
        return self.store.status()

    def close(self) -> None:
        self.store.close()
