"""Restore points in L3: whole-state records of recurrent and hybrid models (issue 46).

A restore point is stored as two rows under one suffix ``root[:16] + n_tokens (u32, big-endian) +
point key``, so listing one kind's keys with the model's root gives the token counts it has
points at, without reading a record::

    \\x08 + suffix   the record (:func:`skippy_llama.restore_points.pack_point`) after a
                     16-byte tag (HMAC when the store has a secret, zeros when not)
    \\x09 + suffix   JSON {v, n_tokens, bytes, created, last_used, model_identity, model_name}:
                     what status lists and what eviction orders by

A record is verified on every read (tag, header, lengths, digest, tokens against the key); one
that fails is deleted with its metadata row, quarantined and counted (``corrupt_points``), and
read as a miss. Points may take up to :data:`POINT_SHARE` of the L3 budget; past it the least
recently used ones are evicted (``points_evicted``). Page eviction does not see them: a model with
restore points has no pages (its prefixes are not pageable).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ...errors import StoreDataError
from ...restore_points import PointOwner, RestorePoint, pack_point, point_key, unpack_point
from .context import Parts
from .schema import NO_TAG, POINT, POINT_META, QUAR, TAG_BYTES, dump_json, load_json

log = logging.getLogger("skippy_llama.tiers.l3")

_META_VERSION = 1
_ROOT_BYTES = 16
#: The share of the L3 budget restore points may hold.
POINT_SHARE = 0.5


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

    def to_json(self) -> dict[str, Any]:
        return {
            "v": _META_VERSION,
            "n_tokens": self.n_tokens,
            "bytes": self.size,
            "created": self.created,
            "last_used": self.last_used,
            "model_identity": self.model_identity,
            "model_name": self.model_name,
        }

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
        parts = self.parts
        if parts.store is None or not parts.health.serving:
            return None
        key = point_key(root, tokens)
        suffix = _suffix(root, len(tokens), key)
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
            point = unpack_point(record, root=root, key=key)
        except StoreDataError as exc:
            self._quarantine(suffix, str(exc), len(raw))
            parts.counters.add("point_misses")
            return None
        parts.counters.add("point_hits")
        parts.counters.add("point_bytes_read", len(raw))
        self._touch(suffix)
        return point

    def put(self, root: bytes, point: RestorePoint, owner: PointOwner) -> bool:
        """Store ``point`` (replacing one for the same tokens), evicting the least recently used
        points beyond :data:`POINT_SHARE` of the budget; False when refused or on an error."""
        parts = self.parts
        if parts.store is None or not parts.health.writable or not parts.rw_ok:
            parts.counters.add("points_dropped")
            return False
        suffix = _suffix(root, point.n_tokens, point_key(root, point.tokens))
        record = pack_point(point, root)
        tag = parts.signer.value(b"restore-point", suffix, record)
        value = (tag if parts.signer.enabled else NO_TAG) + record
        now = time.time()
        meta = PointMeta(
            suffix, point.n_tokens, len(value), now, now, owner.model_identity, owner.model_name
        )
        cap = int(parts.health.budget_bytes() * POINT_SHARE)
        if len(value) > cap:
            parts.counters.add("points_dropped")
            return False
        store = parts.rw
        try:
            with parts.lock, store.transact():
                self._evict(cap - len(value), keep=suffix)
                store.set(POINT + suffix, value)
                store.set(POINT_META + suffix, dump_json(meta.to_json()))
        except Exception as exc:
            parts.health.fault(exc, "restore-point write")
            parts.counters.add("points_dropped")
            return False
        parts.counters.add("point_writes")
        parts.counters.add("point_bytes_written", len(value))
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
            for key in store.keys(POINT_META):
                store.delete(key)
        return len(keys)

    def _evict(self, room: int, keep: bytes) -> None:
        """Drop least recently used points until the others take at most ``room`` bytes."""
        metas = sorted((m for m in self.metas() if m.suffix != keep), key=lambda m: m.last_used)
        used = sum(m.size for m in metas)
        store = self.parts.rw
        for meta in metas:
            if used <= room:
                break
            store.delete(POINT + meta.suffix)
            store.delete(POINT_META + meta.suffix)
            used -= meta.size
            self.parts.counters.add("points_evicted")

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
        try:
            with parts.lock, parts.rw.transact():
                parts.rw.delete(POINT + suffix)
                parts.rw.delete(POINT_META + suffix)
                record = {"reason": reason, "at": time.time(), "pid": os.getpid(), "size": size}
                parts.rw.set(QUAR + POINT + suffix, dump_json(record))
        except Exception as exc:
            parts.health.fault(exc, "restore-point quarantine")
