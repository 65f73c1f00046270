"""The operator side of restore points on the server (``kv-cache status|prune --remote``, issue
46): which model an identity's points belong to, and pruning what can never be served again.

Nothing read from the server is trusted: a key that does not parse as one of ours is skipped and
counted (``foreign_keys``); a value under one of our keys is checked as a lookup checks it (the
frame's tag and digest under the key, then the record as L3 checks it: identity, tokens against
the key, page references against the tokens), and one that fails is removed (it can never be
served; ``bad_values`` counts the reason). Nothing is followed that did not verify: only a
verified record's page references are looked at.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import redis

from ...errors import StoreDataError
from ...restore_points import is_composed, page_keys, unpack_composed, unpack_point
from ..l3.auth import Signer
from ..l3.points import PAGE_TOKENS
from . import codec
from .keys import POINT, POINT_LENGTHS, POINT_OWNER, Keys, authentic_length


class Admin(Protocol):
    """What this module uses of ``admin.py``'s ``Admin`` (which holds a :class:`PointAdmin`)."""

    keys: Keys
    batch: int
    _client: redis.Redis
    _signer: Signer

    def _bad_value(self, reason: str) -> None: ...

    def _each(
        self, command: str, names: Sequence[bytes], *, raise_on_error: bool = True
    ) -> list[Any]: ...

    def _scan(self, pattern: bytes) -> Iterator[bytes]: ...


@dataclass
class PointPrune:
    """What a prune did to restore points (``kv-cache prune --remote --json``)."""

    points_checked: int = 0
    points_removed_bad: int = 0  # records that do not verify (damaged, forged, foreign)
    points_removed_unservable: int = 0  # verified, but a page of theirs is gone
    point_pages_removed: int = 0  # pages only such records named
    point_lengths_removed: int = 0  # index entries that are forged or name no record left
    point_owners_removed_bad: int = 0
    foreign_keys: int = 0  # keys matching our pattern that are not ours: skipped

    def to_json(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class _Record:
    ident: str
    n_tokens: int
    pages: tuple[bytes, ...]  # server names of its attention pages


class PointAdmin:
    """Restore points' operator calls over an :class:`~.admin.Admin`'s client and keys."""

    def __init__(self, admin: Admin) -> None:
        self.admin = admin

    # ------------------------------------------------------------------ owners

    def owners(self, names: list[bytes]) -> Iterator[tuple[str, str, str]]:
        """``(identity hex, model identity, model name)`` of each owner value under ``names``
        that verifies (others are counted and skipped)."""
        admin = self.admin
        for name, value in zip(names, admin._each("get", names, raise_on_error=False), strict=True):
            owner = self._owner(name, value)
            if owner is not None:
                yield owner

    def _owner(self, name: bytes, value: Any) -> tuple[str, str, str] | None:
        admin = self.admin
        parsed = admin.keys.parse(name)
        if value is None or parsed is None or parsed[2] != POINT_OWNER:
            return None
        try:
            frame = codec.unpack(admin._signer, name, codec.KIND_POINT_OWNER, value)
            data = json.loads(bytes(frame.body))
        except codec.FrameError as exc:
            admin._bad_value(exc.reason)
            return None
        except ValueError:
            admin._bad_value("damaged_owner")
            return None
        mid = data.get("model_identity") if isinstance(data, dict) else None
        label = data.get("model_name", "") if isinstance(data, dict) else None
        if not isinstance(mid, str) or not mid or not isinstance(label, str):
            admin._bad_value("damaged_owner")
            return None
        return parsed[0], mid, label

    # ------------------------------------------------------------------ prune

    def prune(self, identity_hex: str | None) -> PointPrune:
        """Remove the restore points of ``identity_hex`` (every identity: None) that can never
        be served again: records that do not verify; verified records a page of which the
        server lost (a point cannot be cut back as a prefix can: its snapshot holds only its
        own position), with the pages no record kept names; length-index entries that are
        forged or name a length no record is left at; owners that do not verify. Only keys
        under this secret are looked at (as for manifests). Racing a push it can only cause
        misses, never a wrong answer: a length entry removed before its record landed (listed
        again by the next push of that point), or a page removed that a new record then names
        (that point misses until pushed again). Raises what the client raises."""
        admin, keys = self.admin, self.admin.keys
        out = PointPrune()
        names = list(admin._scan(keys.pattern(identity_hex, POINT, mine=True)))
        records: dict[bytes, _Record] = {}
        bad: list[bytes] = []
        for start in range(0, len(names), admin.batch):
            batch = names[start : start + admin.batch]
            values = admin._each("get", batch, raise_on_error=False)
            for name, value in zip(batch, values, strict=True):
                if value is None:
                    continue  # gone since the scan
                if keys.parse(name) is None:
                    out.foreign_keys += 1
                    continue
                out.points_checked += 1
                record = self._record(name, value)
                if record is None:
                    bad.append(name)
                else:
                    records[name] = record
        # a record whose page is gone is a miss for every lookup: never servable
        wanted = sorted({page for record in records.values() for page in record.pages})
        present: set[bytes] = set()
        for start in range(0, len(wanted), admin.batch):
            batch = wanted[start : start + admin.batch]
            found = admin._each("exists", batch)
            present.update(name for name, hit in zip(batch, found, strict=True) if hit)
        lost = [name for name, record in records.items() if not set(record.pages) <= present]
        gone = set(lost)
        kept = {name: record for name, record in records.items() if name not in gone}
        doomed = {page for name in lost for page in records[name].pages}
        doomed -= {page for record in kept.values() for page in record.pages}
        out.points_removed_bad = _unlink(admin, bad)
        out.points_removed_unservable = _unlink(admin, lost)
        out.point_pages_removed = _unlink(admin, sorted(doomed & present))
        lengths: dict[str, set[int]] = {}
        for record in kept.values():
            lengths.setdefault(record.ident, set()).add(record.n_tokens)
        out.point_lengths_removed, foreign = self._prune_lengths(identity_hex, lengths)
        out.foreign_keys += foreign
        out.point_owners_removed_bad, foreign = self._prune_owners(identity_hex)
        out.foreign_keys += foreign
        return out

    def _record(self, name: bytes, value: Any) -> _Record | None:
        """The verified record ``value`` under ``name`` (its pages' server names), or None
        (the reason counted)."""
        admin = self.admin
        parsed = admin.keys.parse(name)
        assert parsed is not None
        ident, _, _, key = parsed
        try:
            body = codec.unpack(admin._signer, name, codec.KIND_POINT, value).body
        except codec.FrameError as exc:
            admin._bad_value(exc.reason)
            return None
        root = bytes.fromhex(ident)
        try:
            if not is_composed(body):
                return _Record(ident, unpack_point(body, root=root, key=key).n_tokens, ())
            composed = unpack_composed(body, root=root, key=key)
        except StoreDataError:
            admin._bad_value("damaged_point")
            return None
        refs = [ref for ref, _ in composed.refs]
        if refs and refs != page_keys(composed.tokens, root, PAGE_TOKENS):
            admin._bad_value("damaged_point")  # names pages of other tokens: never servable
            return None
        pages = tuple(admin.keys.point_page(ident, ref) for ref in refs)
        return _Record(ident, len(composed.tokens), pages)

    def _prune_lengths(
        self, identity_hex: str | None, lengths: dict[str, set[int]]
    ) -> tuple[int, int]:
        """Delete the length-index entries that do not verify or name a length no kept record
        of the identity has (a lookup would ask the server for it in vain); (entries removed,
        foreign keys skipped)."""
        admin, keys = self.admin, self.admin.keys
        removed = foreign = 0
        for name in list(admin._scan(keys.pattern(identity_hex, POINT_LENGTHS, mine=True))):
            parsed = keys.parse(name)
            if parsed is None or parsed[3] != bytes.fromhex(parsed[0]):
                foreign += 1
                continue
            entries = admin._each("hgetall", [name], raise_on_error=False)[0]
            if not isinstance(entries, dict):  # a value of another type: never an index
                admin._bad_value("foreign")
                removed += int(admin._client.unlink(name))
                continue
            listed = lengths.get(parsed[0], set())
            drop: list[bytes] = []
            for field, tag in entries.items():
                authentic = authentic_length(admin._signer, name, field, tag)
                if not authentic:
                    admin._bad_value("unauthenticated_length")
                if not authentic or int(field) not in listed:
                    drop.append(field)
            if drop:
                removed += int(admin._client.hdel(name, *drop))
        return removed, foreign

    def _prune_owners(self, identity_hex: str | None) -> tuple[int, int]:
        """Delete owner values that do not verify; (removed, foreign keys skipped)."""
        admin, keys = self.admin, self.admin.keys
        names = list(admin._scan(keys.pattern(identity_hex, POINT_OWNER, mine=True)))
        ours = [name for name in names if keys.parse(name) is not None]
        good = {keys.point_owner(ident) for ident, _, _ in self.owners(ours)}
        return _unlink(admin, [name for name in ours if name not in good]), len(names) - len(ours)


def _unlink(admin: Admin, names: list[bytes]) -> int:
    """UNLINK ``names`` in batches; how many existed."""
    removed = 0
    for start in range(0, len(names), admin.batch):
        batch = names[start : start + admin.batch]
        if batch:
            removed += int(admin._client.unlink(*batch))
    return removed
