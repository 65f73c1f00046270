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
pages), then enter the token count in the identity's length index and the identity's owner (the
model, ``o:``, which ``kv-cache prune|clear --remote --model-identity`` selects by).

Pushes leave the request path the way the paged cache's pushes do: on L3's background writer
(``DiskTier.defer``, after the records queued before it), or, without L3, on a writer of the
same kind of its own (``l3/writer.py``'s :func:`~..l3.writer.job_writer`). A queued point waits
in a bounded buffer (:data:`MAX_PENDING_BYTES`); a full buffer or queue drops the push and
counts it (``point_queue_full``, ``points_dropped``), never waits. A lookup of a point still
waiting is served from that buffer (the process's own capture: ``point_pending_hits``), so a
lookup racing a push answers the point or, once it left, what the server holds; ``close``
drains the queue first. Built without a lane (tools, tests) a push runs on the caller's thread.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ...errors import StateFormatError, StoreDataError
from ...restore_points import (
    PointOwner,
    PointRole,
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
from ..l3.writer import Writer, job_writer
from . import codec
from .keys import authentic_length, length_tag
from .store import RemoteStore

#: Token counts a length index keeps (a push that finds more starts it over): every lookup reads
#: the whole index, so it must stay small.
MAX_LENGTHS = 1024
#: Pages per pipelined GET of a composed point's pages.
FETCH_BATCH_PAGES = 8
#: Bytes of points waiting to be pushed (a push that would pass it is dropped and counted): a
#: hybrid model's point is its attention cells plus the recurrent state, megabytes to tens.
MAX_PENDING_BYTES = 256 << 20
#: How long ``close`` waits for queued pushes to land.
DRAIN_S = 10.0


class Lane(Protocol):
    """Where pushes run off the request path: L3's ``DiskTier`` or :class:`JobLane`."""

    def defer(self, run: Callable[[], object], nbytes: int) -> bool:
        """Queue ``run`` for a background thread; False (nothing queued) when full."""
        ...

    def flush(self, timeout: float = ...) -> bool:
        """Wait until what was queued ran; False on timeout."""
        ...


class JobLane:
    """A lane of its own (a :func:`~..l3.writer.job_writer`) for a process without L3."""

    def __init__(self, writer: Writer | None = None) -> None:
        self.writer = writer or job_writer("skippy-remote-writer")

    def defer(self, run: Callable[[], object], nbytes: int) -> bool:
        return self.writer.job(run, nbytes)

    def flush(self, timeout: float = DRAIN_S) -> bool:
        return self.writer.flush(timeout)

    def stop(self) -> None:
        self.writer.stop()


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
        lane: where pushes run (see the module docstring); None: on the caller's thread.
        max_pending_bytes: the bytes of points that may wait for the lane.
    """

    name = "remote"
    role: PointRole = "shared"

    def __init__(
        self,
        store: RemoteStore,
        lane: Lane | None = None,
        *,
        max_pending_bytes: int = MAX_PENDING_BYTES,
    ) -> None:
        self.store = store
        self.lane = lane
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()
        #: points queued and not yet pushed, by (identity root, point key)
        self._pending: dict[tuple[bytes, bytes], RestorePoint] = {}
        self._pending_bytes = 0

    # ------------------------------------------------------------------ reads

    def point_lengths(self, root: bytes) -> list[int]:
        """Token counts the server lists points at under ``root`` (authentic entries only);
        [] on a failure or while the breaker is open."""
        store = self.store
        with self._lock:
            out = [p.n_tokens for (r, _), p in self._pending.items() if r == root]
        name = store.keys.point_lengths(root.hex())
        entries = store._run("point lengths", functools.partial(store._client.hgetall, name))
        for field, tag in list((entries or {}).items())[:MAX_LENGTHS]:
            if not authentic_length(store._signer, name, field, tag):
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
        with self._lock:
            waiting = self._pending.get((root, key))
        if waiting is not None and np.array_equal(waiting.tokens, tokens):
            # queued by this process and not pushed yet (or being pushed): its own capture
            store._add("point_hits")
            store._add("point_pending_hits")
            return waiting
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
        under this key. Raises _Miss (the frame's reason)."""
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
        """Push ``point`` (see :meth:`push_point`) on the lane; without one, now. With a lane:
        True once queued (or already waiting), False when the buffer or the queue is full (the
        push is dropped and counted: ``point_queue_full``, ``points_dropped``); never waits."""
        lane = self.lane
        if lane is None:
            return self.push_point(root, point, owner)
        store = self.store
        slot = (root, point_key(root, point.tokens))
        size = len(point.blob) + 4 * point.n_tokens
        with self._lock:
            if slot in self._pending:
                return True  # the same tokens' point, pushed once
            full = self._pending_bytes + size > self.max_pending_bytes
            if not full:
                self._pending[slot] = point
                self._pending_bytes += size
        if not full:
            run = functools.partial(self._push_pending, slot, point, owner, size)
            if lane.defer(run, size):
                store._add("point_pushes_queued")
                return True
            self._unpend(slot, size)
        store._add("point_queue_full")
        store._add("points_dropped")
        return False

    def _push_pending(
        self, slot: tuple[bytes, bytes], point: RestorePoint, owner: PointOwner, size: int
    ) -> None:
        """The lane's job: push, then let the point leave the buffer (lookups meanwhile are
        served from it)."""
        try:
            self.push_point(slot[0], point, owner)
        except Exception as exc:  # a bug of this module: counted, the lane goes on
            self.store._failed(exc, "point push")
            self.store._add("points_dropped")
        finally:
            self._unpend(slot, size)

    def _unpend(self, slot: tuple[bytes, bytes], size: int) -> None:
        with self._lock:
            if self._pending.pop(slot, None) is not None:
                self._pending_bytes -= size

    def flush(self, timeout: float = DRAIN_S) -> bool:
        """Wait until the queued pushes are done; False on timeout."""
        if self.lane is None:
            return True
        with self._lock:
            if not self._pending:
                return True
        return self.lane.flush(timeout)

    def push_point(self, root: bytes, point: RestorePoint, owner: PointOwner) -> bool:
        """Send ``point``'s record and the pages the server lacks, list its length and name
        its identity's ``owner``; False when refused or on a failure (counted:
        ``points_dropped``). Blocks on the server: call it off the request path."""
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
        if not ok or not self._list_length(ident, point.n_tokens, owner):
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

    def _list_length(self, ident: str, n_tokens: int, owner: PointOwner) -> bool:
        """Enter ``n_tokens`` in the identity's length index (starting it over past
        :data:`MAX_LENGTHS`), and ``owner`` as the identity's model; False on a failure."""
        store = self.store
        name = store.keys.point_lengths(ident)
        field = str(n_tokens).encode()
        tag = length_tag(store._signer, name, field)
        ttl = store.settings.ttl
        owned: tuple[bytes, bytes] | None = None
        if owner.model_identity:
            oname = store.keys.point_owner(ident)
            body = json.dumps(
                {"model_identity": owner.model_identity, "model_name": owner.model_name}
            ).encode()
            owned = (oname, codec.pack(store._signer, oname, codec.KIND_POINT_OWNER, 0, body))

        def add(pipe: Any) -> None:
            pipe.hset(name, field, tag)
            pipe.hlen(name)
            if ttl is not None:
                pipe.expire(name, ttl)
            if owned is not None:
                pipe.set(*owned, ex=ttl)

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
        """The store's state and counters (restore points' among them) and the points waiting
        to be pushed; no server call."""
        out = self.store.status()
        with self._lock:
            out["point_queue"] = {
                "points": len(self._pending),
                "bytes": self._pending_bytes,
                "max_bytes": self.max_pending_bytes,
            }
        return out

    def close(self) -> None:
        """Push what is queued (within :data:`DRAIN_S`), stop a lane of its own, close."""
        with contextlib.suppress(Exception):  # a lane already closed (L3 drained it first)
            self.flush(DRAIN_S)
        if isinstance(self.lane, JobLane):
            self.lane.stop()
        self.store.close()
