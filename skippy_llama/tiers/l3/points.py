"""Restore points in L3: recurrent and hybrid models' prefixes (issue 46, DESIGN.md section 13).

A restore point at p is stored *composed* where its state can be cut
(:func:`skippy_llama.restore_points.compose_point`): the attention cells of [0, p) as pages of
:data:`PAGE_TOKENS` tokens, content-addressed by their chain key and shared by every point whose
tokens run through them, plus the recurrent state at p in the point's own record. A point costs
its snapshot plus the pages it adds. A state that cannot be cut is stored whole. Rows, under one
suffix ``root[:16] + n_tokens (u32, big-endian) + point key`` (listing one kind's keys with the
model's root gives the token counts it has points at, without reading a record)::

    \\x08 + suffix        the record (``pack_composed`` or ``pack_point``) after a 16-byte tag
                          (HMAC when the store has a secret, zeros when not)
    \\x09 + suffix        JSON {v, n_tokens, bytes, created, last_used, model_identity,
                          model_name, pages: [[key, size, charged] ...]}: what status lists, what
                          eviction orders by; ``bytes`` = the record + the pages it added
    \\x0a + root16 + key  an attention page (tag + ``Page.to_bytes()``)

A record is verified on every read (tag, header, lengths, digest, tokens against the key), and
each page against the digest its record keeps; a point that fails is deleted with its metadata
row, quarantined and counted (``corrupt_points``), and read as a miss. Points may take up to
:data:`POINT_SHARE` of the L3 budget; past it the least recently used ones are evicted
(``points_evicted``), with the pages no other point uses. Page eviction does not see them: a
model with restore points has no pages of the paged cache (its prefixes are not pageable).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ...errors import StateFormatError, StoreDataError
from ...restore_points import (
    ComposedRecord,
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
from .context import Parts
from .schema import (
    NO_TAG,
    POINT,
    POINT_META,
    POINT_PAGE,
    QUAR,
    TAG_BYTES,
    dump_json,
    load_json,
)

log = logging.getLogger("skippy_llama.tiers.l3")

_META_VERSION = 1
_ROOT_BYTES = 16
#: The share of the L3 budget restore points may hold.
POINT_SHARE = 0.5
#: Tokens of an attention page of a composed point.
PAGE_TOKENS = 128


@dataclass(frozen=True)
class PointMeta:
    """What the store lists about one restore point (status, eviction)."""

    suffix: bytes
    n_tokens: int
    size: int
    created: float
    last_used: float
    model_identity: str
    model_name: str
    #: the attention pages the point runs through: (key, stored bytes, whether ``size``
    #: includes them: the point wrote them, or took them over from an evicted one)
    pages: tuple[tuple[bytes, int, bool], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "v": _META_VERSION,
            "n_tokens": self.n_tokens,
            "bytes": self.size,
            "created": self.created,
            "last_used": self.last_used,
            "model_identity": self.model_identity,
            "model_name": self.model_name,
            "pages": [[key.hex(), size, int(owned)] for key, size, owned in self.pages],
        }

    @property
    def root(self) -> bytes:
        """The cache identity root the point is stored under."""
        return self.suffix[:_ROOT_BYTES]

    @property
    def key(self) -> bytes:
        """The point's key (``restore_points.point_key`` of its tokens)."""
        return self.suffix[_ROOT_BYTES + 4 :]

    @classmethod
    def unpack(cls, suffix: bytes, raw: bytes) -> PointMeta:
        data = load_json(raw, "restore-point metadata")
        try:
            meta = cls(
                suffix=suffix,
                n_tokens=int(data["n_tokens"]),
                size=int(data["bytes"]),
                created=float(data["created"]),
                last_used=float(data["last_used"]),
                model_identity=str(data["model_identity"]),
                model_name=str(data["model_name"]),
                pages=tuple(
                    (bytes.fromhex(k), int(n), bool(o)) for k, n, o in data.get("pages", [])
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreDataError(f"restore-point metadata is damaged: {exc}") from None
        if data.get("v") != _META_VERSION or meta.n_tokens != _suffix_tokens(suffix):
            raise StoreDataError("restore-point metadata of another version or length")
        return meta


def _suffix(root: bytes, n_tokens: int, key: bytes) -> bytes:
    return root[:_ROOT_BYTES] + n_tokens.to_bytes(4, "big") + key


def _suffix_tokens(suffix: bytes) -> int:
    return int.from_bytes(suffix[_ROOT_BYTES : _ROOT_BYTES + 4], "big")


class Points:
    """The restore points of one open L3 store (see the module docstring).

    Args:
        parts: the open tier's shared state.
    """

    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    def lengths(self, root: bytes) -> list[int]:
        """Token counts of the points stored under ``root``; [] when the store does not serve."""
        parts = self.parts
        if parts.store is None or not parts.health.serving:
            return []
        prefix = POINT_META + root[:_ROOT_BYTES]
        size = len(prefix) + 4 + len(point_key(root, []))
        try:
            keys = parts.store.keys(POINT_META)
        except Exception as exc:
            parts.health.fault(exc, "restore-point listing")
            return []
        return [_suffix_tokens(k[1:]) for k in keys if k.startswith(prefix) and len(k) == size]

    def get(self, root: bytes, tokens: npt.NDArray[np.int32]) -> RestorePoint | None:
        """The verified point after exactly ``tokens``; None when absent or damaged (counted:
        ``point_hits``, ``point_misses`` for a damaged or unreadable one, ``corrupt_points``).
        An absent point is not counted: the runtime asks at every stored length."""
        return self.get_key(root, len(tokens), point_key(root, tokens))

    def get_key(self, root: bytes, n_tokens: int, key: bytes) -> RestorePoint | None:
        """:meth:`get` by the point's key and token count (a listed point, for export)."""
        parts = self.parts
        if parts.store is None or not parts.health.serving:
            return None
        suffix = _suffix(root, n_tokens, key)
        try:
            raw = parts.store.get(POINT + suffix)
        except StoreDataError:  # an untrusted row: dropped by the store, counted there
            parts.sync_untrusted()
            parts.counters.add("point_misses")
            return None
        except Exception as exc:
            parts.health.fault(exc, "restore-point read")
            parts.counters.add("point_misses")
            return None
        if raw is None:
            return None
        try:
            tag, record = raw[:TAG_BYTES], memoryview(raw)[TAG_BYTES:]
            if len(raw) < TAG_BYTES or not parts.signer.verify(
                tag, parts.signer.value(b"restore-point", suffix, record)
            ):
                raise StoreDataError("restore-point record without a valid tag")
            if is_composed(record):
                point, n_read = self._recompose(root, unpack_composed(record, root=root, key=key))
            else:
                point, n_read = unpack_point(record, root=root, key=key), 0
        except StoreDataError as exc:
            self._quarantine(suffix, str(exc), len(raw))
            parts.counters.add("point_misses")
            return None
        except Exception as exc:
            parts.health.fault(exc, "restore-point read")
            parts.counters.add("point_misses")
            return None
        parts.counters.add("point_hits")
        parts.counters.add("point_bytes_read", len(raw) + n_read)
        self._touch(suffix)
        return point

    def _recompose(self, root: bytes, record: ComposedRecord) -> tuple[RestorePoint, int]:
        """The whole state of a composed record, its pages read and checked; and the page
        bytes read. Raises StoreDataError for a missing, unauthentic or damaged page."""
        parts = self.parts
        assert parts.store is not None
        pages: list[bytes] = []
        for key, digest in record.refs:
            row = POINT_PAGE + root[:_ROOT_BYTES] + key
            raw = parts.store.get(row)
            if raw is None:
                raise StoreDataError(f"restore-point page {key.hex()} is missing")
            tag, page = raw[:TAG_BYTES], raw[TAG_BYTES:]
            why = None
            if not parts.signer.verify(tag, parts.signer.value(b"restore-page", row, page)):
                why = "without a valid tag"
            elif page_digest(page) != digest:
                why = "digest mismatch"
            if why is not None:
                if parts.rw_ok:  # every point through it would fail: take it out now
                    with parts.lock, parts.rw.transact():
                        parts.rw.delete(row)
                raise StoreDataError(f"restore-point page {key.hex()} {why}")
            pages.append(page)
        try:
            blob = recompose_point(pages, record.head, record.tail)
        except StateFormatError as exc:
            raise StoreDataError(f"restore-point pages do not fit together: {exc}") from None
        n_read = sum(len(page) + TAG_BYTES for page in pages)
        return RestorePoint(record.tokens, blob, len(record.tail)), n_read

    def put(self, root: bytes, point: RestorePoint, owner: PointOwner) -> bool:
        """Store ``point`` (replacing one for the same tokens), evicting the least recently used
        points beyond :data:`POINT_SHARE` of the budget; False when refused or on an error."""
        parts = self.parts
        if parts.store is None or not parts.health.writable or not parts.rw_ok:
            parts.counters.add("points_dropped")
            return False
        suffix = _suffix(root, point.n_tokens, point_key(root, point.tokens))
        made = point_values(point, root, PAGE_TOKENS)
        rows: list[tuple[bytes, bytes]] = []  # (row key, stored value) of each page
        for key, page in made.pages:
            row = POINT_PAGE + root[:_ROOT_BYTES] + key
            tag = parts.signer.value(b"restore-page", row, page)
            rows.append((row, (tag if parts.signer.enabled else NO_TAG) + page))
        record = made.record
        tag = parts.signer.value(b"restore-point", suffix, record)
        value = (tag if parts.signer.enabled else NO_TAG) + record
        cap = int(parts.health.budget_bytes() * POINT_SHARE)
        if len(value) + sum(len(v) for _, v in rows) > cap:
            parts.counters.add("points_dropped")
            return False
        store = parts.rw
        try:
            with parts.lock, store.transact():
                added = [(row, v) for row, v in rows if not store.contains(row)]
                size = len(value) + sum(len(v) for _, v in added)
                new = {row for row, _ in added}
                pages = tuple((row[1 + _ROOT_BYTES :], len(v), row in new) for row, v in rows)
                self._evict(cap - size, keep=suffix)
                for row, v in added:
                    store.set(row, v)
                store.set(POINT + suffix, value)
                now = time.time()
                meta = PointMeta(
                    suffix,
                    point.n_tokens,
                    size,
                    now,
                    now,
                    owner.model_identity,
                    owner.model_name,
                    pages,
                )
                store.set(POINT_META + suffix, dump_json(meta.to_json()))
        except Exception as exc:
            parts.health.fault(exc, "restore-point write")
            parts.counters.add("points_dropped")
            return False
        parts.counters.add("point_writes")
        parts.counters.add("point_bytes_written", size)
        if is_composed(record):
            parts.counters.add("point_pages_shared", len(rows) - len(added))
        return True

    def metas(self) -> list[PointMeta]:
        """Every point's metadata (damaged rows skipped); reads only."""
        store = self.parts.store
        if store is None:
            return []
        out = []
        for key, raw in store.items(POINT_META):
            try:
                out.append(PointMeta.unpack(key[1:], raw))
            except StoreDataError:
                continue
        return out

    def clear(self) -> int:
        """Remove every point; returns how many."""
        parts = self.parts
        if not parts.rw_ok:
            return 0
        store = parts.rw
        with parts.lock, store.transact():
            keys = store.keys(POINT)
            for key in keys:
                store.delete(key)
            for kind in (POINT_META, POINT_PAGE):
                for key in store.keys(kind):
                    store.delete(key)
        return len(keys)

    def _evict(self, room: int, keep: bytes) -> None:
        """Drop least recently used points until the others take at most ``room`` bytes."""
        metas = {m.suffix: m for m in self.metas() if m.suffix != keep}
        used = sum(m.size for m in metas.values())
        for meta in sorted(metas.values(), key=lambda m: m.last_used):
            if used <= room:
                break
            del metas[meta.suffix]
            used -= self._remove(meta, metas)
            self.parts.counters.add("points_evicted")

    def _remove(self, meta: PointMeta, others: dict[bytes, PointMeta]) -> int:
        """Delete a point's rows and the pages no point in ``others`` uses; a page it was
        charged for that another point still uses moves to that point's charge. Returns the
        bytes the total charge drops by."""
        store = self.parts.rw
        store.delete(POINT + meta.suffix)
        store.delete(POINT_META + meta.suffix)
        freed = meta.size
        root = meta.suffix[:_ROOT_BYTES]
        for key, size, owned in meta.pages:
            user = next(
                (
                    m
                    for m in others.values()
                    if m.suffix[:_ROOT_BYTES] == root and any(k == key for k, _, _ in m.pages)
                ),
                None,
            )
            if user is None:
                store.delete(POINT_PAGE + root + key)
            elif owned:
                pages = tuple((k, n, o or k == key) for k, n, o in user.pages)
                moved = dataclasses.replace(user, size=user.size + size, pages=pages)
                others[user.suffix] = moved
                store.set(POINT_META + user.suffix, dump_json(moved.to_json()))
                freed -= size
        return freed

    def _touch(self, suffix: bytes) -> None:
        parts = self.parts
        if not parts.rw_ok:
            return
        try:
            with parts.lock, parts.rw.transact():
                raw = parts.rw.get(POINT_META + suffix)
                if raw is None:
                    return
                data = json.loads(raw)
                data["last_used"] = time.time()
                parts.rw.set(POINT_META + suffix, dump_json(data))
        except Exception as exc:  # recency is advisory: a failed touch loses nothing
            log.debug("restore-point touch failed: %s", exc)

    def _quarantine(self, suffix: bytes, reason: str, size: int) -> None:
        parts = self.parts
        parts.counters.add("corrupt_points")
        log.warning("L3 restore point quarantined: %s", reason)
        if not parts.rw_ok:
            return
        store = parts.rw
        try:
            with parts.lock, store.transact():
                metas = {m.suffix: m for m in self.metas()}
                meta = metas.pop(suffix, None)
                if meta is not None:
                    self._remove(meta, metas)  # and the pages only it used
                else:
                    store.delete(POINT + suffix)
                    store.delete(POINT_META + suffix)
                record = {"reason": reason, "at": time.time(), "pid": os.getpid(), "size": size}
                store.set(QUAR + POINT + suffix, dump_json(record))
        except Exception as exc:
            parts.health.fault(exc, "restore-point quarantine")
