"""The page tree in the store: committing a record, and every removal (manifests, cut-backs,
quarantine, eviction of a page with the pages after it).

Pages are stored once by content key and shared by every manifest that lists them (the owner
list in their metadata is the reference count). Each page is listed with its tokens in the child
index of its parent, so a lookup can take any prefix of a stored page. Every multi-key change runs
inside the caller's ``parts.lock`` and one store transaction, on fresh reads, so processes sharing
the store never see half of one; the methods marked *own transaction* take both themselves.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import replace

import xxhash

from ...codecs import stored_codec
from ...errors import ManifestError, StoreDataError
from ..records import PrefixRecord
from .context import Parts
from .pins import Pins
from .schema import DATA as DATA_KIND
from .schema import (
    KIDS,
    MAN,
    META,
    QUAR,
    Child,
    Manifest,
    PageMeta,
    dump_json,
    pack_children,
    unpack_children,
)

log = logging.getLogger("skippy_llama.tiers.l3")

#: Child-index entries kept per node, newest first out of the index: a lookup step reads and a
#: new page rewrites one node's index, so it stays bounded however many prompts branch at one
#: point (thousands of questions over one document). A page dropped from the index stays
#: stored: a whole aligned page is still found by its key, only a match inside it is lost.
MAX_CHILDREN = 256


def payload_digest(payload: bytes | memoryview) -> bytes:
    """The 16-byte xxh3_128 digest stored with every page and checked on every read."""
    return xxhash.xxh3_128_digest(payload)


class Tree:
    """Reads and changes of manifests, page metadata and child indexes."""

    def __init__(self, parts: Parts, pins: Pins) -> None:
        self.parts = parts
        self.pins = pins

    # ------------------------------------------------------------------ reads

    def meta(self, key: bytes) -> PageMeta | None:
        """Page metadata, None when absent. Raises StoreDataError when damaged."""
        assert self.parts.store is not None
        raw = self.parts.store.get(META + key)
        return None if raw is None else PageMeta.unpack(raw)

    def manifest(self, mid: bytes) -> Manifest | None:
        """Manifest ``mid``, None when absent. Raises StoreDataError when damaged or foreign."""
        assert self.parts.store is not None
        raw = self.parts.store.get(MAN + mid)
        return None if raw is None else Manifest.unpack(raw, mid)

    def authentic(self, man: Manifest) -> bool:
        """True when the manifest's tag verifies (always, for a store without a secret)."""
        signer = self.parts.signer
        return signer.verify(man.tag, signer.manifest(dump_json(man.body())))

    def manifests(self, *, repair: bool = False) -> tuple[list[Manifest], int]:
        """Every readable, authentic manifest, and how many others were skipped.

        With ``repair`` (operator calls and eviction on a writable store) a damaged or
        foreign-version manifest is quarantined at once; without it (``status``, which must not
        write) it is only skipped, and reconciliation quarantines it later.
        """
        store = self.parts.store
        assert store is not None
        out: list[Manifest] = []
        skipped = 0
        for key in store.keys(MAN):
            try:
                man = self.manifest(key[1:])
            except ManifestError as exc:
                skipped += 1
                if repair and self.parts.rw_ok:
                    self.quarantine_manifest(key[1:], str(exc))
                continue
            except StoreDataError:
                skipped += 1  # an untrusted row: the store dropped and counted it
                continue
            if man is None:
                continue
            if not self.authentic(man):
                skipped += 1
                self.parts.counters.add("unauthenticated")
                continue
            out.append(man)
        return out, skipped

    def children(self, parent: bytes) -> list[Child]:
        """The child index of ``parent``; damaged: nothing; unauthentic entries left out."""
        assert self.parts.store is not None
        raw = self.parts.store.get(KIDS + parent)
        if not raw:
            return []
        try:
            entries = unpack_children(raw)
        except StoreDataError:
            return []  # reconciliation rewrites it
        signer = self.parts.signer
        if not signer.enabled:
            return entries
        good = [c for c in entries if signer.verify(c.tag, signer.child(parent, c.key, c.tokens))]
        self.parts.counters.add("unauthenticated", len(entries) - len(good))
        return good

    # ------------------------------------------------------------------ commit

    def sign(self, man: Manifest) -> Manifest:
        signer = self.parts.signer
        return replace(man, tag=signer.manifest(dump_json(man.body())))

    def commit(self, rec: PrefixRecord, stored: dict[bytes, bytes]) -> bool | None:
        """Metadata, child index and manifest of ``rec`` in one transaction (*own transaction*).

        ``stored`` holds the stored bytes of the record's new pages. Returns True for a new
        manifest, False for a refreshed one, None when a reused page is gone (nothing changed).
        """
        parts = self.parts
        store = parts.rw
        mid = rec.manifest_id
        counters = parts.counters
        with parts.lock, store.transact():
            metas = []
            for page in rec.pages:
                meta = self.meta(page.key)
                if meta is None and page.payload is None:
                    return None
                metas.append(meta)
            now = time.time()
            sizes = []
            for depth, (page, meta) in enumerate(zip(rec.pages, metas, strict=True)):
                if meta is None:
                    data = stored[page.key]
                    if not store.contains(DATA_KIND + page.key):
                        # removed between our add and this transaction (another process's
                        # eviction before our pin landed): write it again, under the lock
                        store.set(DATA_KIND + page.key, data)
                        counters.add("writes")
                        counters.add("bytes_written", len(data))
                    tag = parts.signer.page(page.key, page.n_tokens, data)
                    meta = PageMeta(
                        payload_digest(data), len(data), page.n_tokens, True, depth,
                        page.parent, now, now, 0, tag, [mid],
                    )  # fmt: skip
                    self._kid_add(page.parent, page.key, page.tokens)
                else:
                    meta.last_used = max(meta.last_used, now)  # a re-record is not a hit
                    if mid not in meta.owners:
                        meta.owners.append(mid)
                sizes.append(meta.size)
                store.set(META + page.key, meta.pack())
            try:
                old = self.manifest(mid)
            except StoreDataError:
                old = None  # damaged: the fresh one replaces it
            # every page under one identity has the identity's codec: the last page (always
            # new) names it
            codec = stored_codec(stored[rec.pages[-1].key])
            man = Manifest.of_record(rec, sizes, now, codec=codec)
            if old is not None:
                man = replace(man, created=old.created)
            store.set(MAN + mid, self.sign(man).pack())
            return old is None

    def _kid_add(self, parent: bytes, key: bytes, tokens: bytes) -> None:
        store = self.parts.rw
        raw = store.get(KIDS + parent)
        try:
            entries = unpack_children(raw) if raw else []
        except StoreDataError:
            entries = []  # a damaged index is rebuilt from what is added
        signer = self.parts.signer
        tag = signer.child(parent, key, tokens)
        if all(c.key != key or c.tag != tag for c in entries):
            # an entry for the same page without this tag (unsigned, or planted) is replaced
            entries = [c for c in entries if c.key != key] + [Child(key, tokens, tag)]
            store.set(KIDS + parent, pack_children(entries[-MAX_CHILDREN:]))

    def _kid_remove(self, parent: bytes, key: bytes) -> None:
        store = self.parts.rw
        raw = store.get(KIDS + parent)
        if not raw:
            return
        try:
            kept = [c for c in unpack_children(raw) if c.key != key]
        except StoreDataError:
            kept = []
        if kept:
            store.set(KIDS + parent, pack_children(kept))
        else:
            store.delete(KIDS + parent)

    # ------------------------------------------------------------------ removal primitives
    # Inside ``parts.lock`` and a store transaction held by the caller.

    def delete_page(self, key: bytes, meta: PageMeta | None) -> None:
        store = self.parts.rw
        store.delete(META + key)
        store.delete(DATA_KIND + key)
        if meta is not None and meta.indexed:
            self._kid_remove(meta.parent, key)

    def _meta_or_none(self, key: bytes) -> PageMeta | None:
        try:
            return self.meta(key)
        except StoreDataError:
            return None  # reconciliation quarantines it

    def remove_manifest(
        self, mid: bytes, pins: set[bytes], *, respect_pins: bool
    ) -> tuple[bool, list[bytes], int]:
        """Remove manifest ``mid``; delete pages no manifest references any more unless pinned.

        Returns (removed, deleted page keys, pinned orphan pages kept). With ``respect_pins`` a
        manifest with a pinned page is kept whole (it is in use).
        """
        store = self.parts.rw
        if not store.contains(MAN + mid):
            return False, [], 0
        try:
            man = self.manifest(mid)
            keys = man.keys if man is not None else []
        except StoreDataError:
            keys = []  # damaged: its pages' owner lists are repaired by reconciliation
        if respect_pins and any(key in pins for key in keys):
            return False, [], 0
        store.delete(MAN + mid)
        deleted: list[bytes] = []
        kept = 0
        for key in keys:
            meta = self._meta_or_none(key)
            if meta is None:
                continue
            meta.owners = [o for o in meta.owners if o != mid]
            if meta.owners or key in pins:
                store.set(META + key, meta.pack())  # still used, or an orphan in use: later
                kept += int(not meta.owners)
            else:
                self.delete_page(key, meta)
                deleted.append(key)
        return True, deleted, kept

    def cut_manifest(self, man: Manifest, bad: int, pins: set[bytes]) -> list[bytes]:
        """Replace ``man`` by its valid prefix ``pages[:bad]`` (page ``bad`` is gone)."""
        store = self.parts.rw
        if bad > 0:
            short = man.cut(bad)
            if not store.contains(MAN + short.id):
                store.set(MAN + short.id, self.sign(short).pack())
                for key in short.keys:
                    meta = self._meta_or_none(key)
                    if meta is not None and short.id not in meta.owners:
                        meta.owners.append(short.id)
                        store.set(META + key, meta.pack())
        _, deleted, _ = self.remove_manifest(man.id, pins, respect_pins=False)
        return deleted

    def cut_owners(self, key: bytes, owners: list[bytes], pins: set[bytes]) -> list[bytes]:
        """Cut every manifest in ``owners`` back to the pages before ``key``."""
        deleted: list[bytes] = []
        for mid in owners:
            try:
                man = self.manifest(mid)
            except StoreDataError:
                self.parts.rw.delete(MAN + mid)
                continue
            if man is None:
                continue
            keys = man.keys
            deleted += self.cut_manifest(man, keys.index(key) if key in keys else 0, pins)
        return deleted

    def record_quarantine(self, key: bytes, reason: str, size: int | None = None) -> None:
        """Write the quarantine record of store key ``key`` (its kind byte included)."""
        record = {"reason": reason, "at": time.time(), "pid": os.getpid(), "size": size}
        self.parts.rw.set(QUAR + key, dump_json(record))

    # ------------------------------------------------------------------ repairs
    # Own transaction; faults are counted and the caller fails open.

    def quarantine(self, key: bytes, reason: str, *, corrupt: bool = True) -> None:
        """Take a page that failed validation out of service, record why, cut its manifests
        (``corrupt``: count it in ``corrupt_entries``; an unauthentic page is counted apart)."""
        parts = self.parts
        if corrupt:
            parts.counters.add("corrupt_entries")
        log.warning("L3 page %s quarantined: %s", key.hex(), reason)
        removed = [key]
        try:
            with parts.lock, parts.rw.transact():
                # store pins only: this read's own pins would keep the pages after the bad one,
                # which no chain walk can reach any more
                pins = self.pins.live(local=False)
                meta = self._meta_or_none(key)
                self.record_quarantine(META + key, reason, meta.size if meta else None)
                self.delete_page(key, meta)
                if meta is not None:
                    removed += self.cut_owners(key, meta.owners, pins)
        except Exception as exc:
            parts.health.fault(exc, "quarantine")
        parts.removed(removed)

    def quarantine_manifest(self, mid: bytes, reason: str) -> None:
        """Move a damaged or foreign manifest out of the way (its pages become orphans)."""
        parts = self.parts
        parts.counters.add("damaged_manifests")
        log.warning("L3 manifest %s quarantined: %s", mid.hex(), reason)
        try:
            with parts.lock, parts.rw.transact():
                self.record_quarantine(MAN + mid, reason)
                parts.rw.delete(MAN + mid)
        except Exception as exc:
            parts.health.fault(exc, "quarantine")

    def cut_back(self, key: bytes, why: str) -> None:
        """A page's payload is missing: drop its metadata and cut its manifests back."""
        parts = self.parts
        removed = [key]
        try:
            with parts.lock, parts.rw.transact():
                # absence is checked again, explicitly: a transient read error raises here
                # (counted as a fault) instead of deleting a page that is still there
                if parts.rw.size_of(DATA_KIND + key) is not None:
                    return  # it came back (another process rewrote it): nothing to repair
                pins = self.pins.live(local=False)
                meta = self._meta_or_none(key)
                self.delete_page(key, meta)
                if meta is not None:
                    removed += self.cut_owners(key, meta.owners, pins)
        except Exception as exc:
            parts.health.fault(exc, f"repair ({why})")
            return
        parts.removed(removed)

    def evict_page(self, key: bytes, pins: set[bytes]) -> list[bytes]:
        """Remove page ``key`` and the pages after it (*own transaction*); [] when pinned."""
        parts = self.parts
        with parts.lock, parts.rw.transact():
            if key in pins or not parts.rw.contains(META + key):
                return []
            meta = self._meta_or_none(key)
            deleted = self.cut_owners(key, meta.owners, pins) if meta is not None else []
            if key not in deleted and parts.rw.contains(META + key):
                self.delete_page(key, meta)
                deleted.append(key)
        return deleted

    def sweep_orphans(self) -> int:
        """Delete pages no manifest references and nobody pins (left by clear or a crash)."""
        parts = self.parts
        store = parts.rw
        removed: list[bytes] = []
        for batch in batches(store.keys(META)):
            with parts.lock, store.transact():
                pins = self.pins.live()
                for key in batch:
                    page = key[1:]
                    meta = self._meta_or_none(page)
                    if page in pins or (
                        meta is not None and any(store.contains(MAN + o) for o in meta.owners)
                    ):
                        continue
                    self.delete_page(page, meta)
                    removed.append(page)
        parts.removed(removed)
        return len(removed)


#: Keys per transaction in walks over the store: short enough that a writer or reader in another
#: process never waits long for the lock.
BATCH = 256


def batches(keys: list[bytes], size: int = BATCH) -> Iterator[list[bytes]]:
    for i in range(0, len(keys), size):
        yield keys[i : i + size]
