"""The operator API behind ``kv-cache status|prune|clear``: status (reads only), prune, clear.

Operator calls raise :class:`~skippy_llama.errors.ConfigError` for a bad model identity or a
store they cannot act on; damaged records never raise here (they are skipped and counted), so no
``kv-cache`` command ends in a traceback.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ...errors import ConfigError
from ..records import (
    ClearResult,
    DiskStatus,
    DiskUsage,
    InventoryEntry,
    PruneResult,
    Reconciliation,
    RestorePointEntry,
)
from .context import Parts
from .eviction import Evictor
from .pins import Pins
from .points import PointMeta, Points
from .policy_api import LOW_WATERMARK
from .reconcile import stored_reconciliation
from .schema import DATA, MAN, QUAR, RECONCILIATION, Manifest
from .stats import stored_activity
from .tree import Tree

#: Counters of the page codec (``recorder.py``, ``reader.py``): CacheGen pages written, pages
#: stored native although ``l3.codec`` asked for CacheGen, pages of a codec this build does not
#: read (missed), and the writer's encoding time and input bytes.
CODEC_COUNTERS = (
    "cachegen_pages",
    "codec_unqualified",
    "unknown_codec",
    "encode_us",
    "encoded_bytes",
)


def _point_entries(points: list[PointMeta]) -> tuple[RestorePointEntry, ...]:
    """Restore points per model identity, each point's length and bytes."""
    by_model: dict[str, list[PointMeta]] = {}
    for point in points:
        by_model.setdefault(point.model_identity, []).append(point)
    return tuple(
        RestorePointEntry(
            model_identity=model,
            model_name=group[0].model_name,
            points=len(group),
            bytes=sum(p.size for p in group),
            sizes=tuple(sorted((p.n_tokens, p.size) for p in group)),
        )
        for model, group in sorted(by_model.items())
    )


class Admin:
    def __init__(self, parts: Parts, tree: Tree, pins: Pins, evictor: Evictor) -> None:
        self.parts = parts
        self.tree = tree
        self.pins = pins
        self.evictor = evictor

    def used_bytes(self) -> int:
        store = self.parts.store
        if store is None:
            return 0
        try:
            return store.volume()
        except Exception as exc:
            self.parts.health.fault(exc, "volume")
            return 0

    # ------------------------------------------------------------------ status

    def status(self, fallback: Reconciliation) -> DiskStatus:
        """Effective state, usage, activity, the latest reconciliation, and the inventory per
        model; reads only (a read-only store gives the same answer)."""
        parts = self.parts
        health = parts.health
        mine = parts.counters.process()
        pending = parts.counters.pending()
        if health.state == "off" or parts.store is None:
            free = health.free_bytes() if health.state != "off" else None
            return DiskStatus(
                state=health.state,
                reason=health.reason,
                directory=None if health.state == "off" else str(health.directory),
                usage=DiskUsage(
                    budget_bytes=health.budget_bytes() if health.state == "active" else 0,
                    filesystem_available_bytes=free,
                    minimum_free_bytes=parts.settings.minimum_free,
                ),
                activity=mine,
                process_activity=mine,
                reconciliation=fallback,
            )
        store = parts.store
        health.refresh()
        inventory: dict[str, dict[str, Any]] = {}
        pages_by_model: dict[str, dict[bytes, int]] = {}
        try:
            total = stored_activity(store)
            reconciliation = stored_reconciliation(store.get(RECONCILIATION))
            manifests, skipped = self.tree.manifests()  # damaged ones skipped, not repaired
            n_pages, n_quarantined = store.count(DATA), store.count(QUAR)
            points = Points(parts).metas()
        except Exception as exc:
            health.fault(exc, "status")
            total, reconciliation, manifests, points = Counter(), None, [], []
            n_pages = n_quarantined = skipped = 0
        # counted after the listing, which counts what it skips (unauthentic manifests)
        parts.sync_untrusted()
        mine, pending = parts.counters.process(), parts.counters.pending()
        activity = dict(total)
        for name, n in pending.items():
            activity[name] = activity.get(name, 0) + n
        for man in manifests:
            entry = inventory.setdefault(
                man.model_identity, {"model_name": man.model_name, "manifests": 0, "tokens": 0}
            )
            entry["manifests"] += 1
            entry["tokens"] += man.n_tokens
            pages = pages_by_model.setdefault(man.model_identity, {})
            for page in man.pages:
                pages[page.key] = page.size
        usage = DiskUsage(
            budget_bytes=health.budget_bytes(),
            used_bytes=self.used_bytes(),
            filesystem_available_bytes=health.free_bytes(),
            minimum_free_bytes=parts.settings.minimum_free,
            manifests=len(manifests),
            pages=n_pages,
            quarantined=n_quarantined,
            skipped_manifests=skipped,
            restore_points=len(points),
            restore_point_bytes=sum(p.size for p in points),
        )
        return DiskStatus(
            state=health.state,
            reason=health.reason,
            directory=str(health.directory),
            usage=usage,
            activity=type(mine).from_counts(activity),
            process_activity=mine,
            reconciliation=reconciliation or fallback,
            inventory=tuple(
                InventoryEntry(
                    model_identity=model,
                    model_name=str(entry["model_name"]),
                    manifests=entry["manifests"],
                    pages=len(pages_by_model[model]),
                    bytes=sum(pages_by_model[model].values()),
                    tokens=entry["tokens"],
                )
                for model, entry in sorted(inventory.items())
            ),
            restore_points=_point_entries(points),
        )

    def codec_summary(self) -> dict[str, Any]:
        """The configured page codec, stored manifests per codec, and the codec counters
        (every process's stored totals plus this process's unflushed counts); reads only."""
        parts = self.parts
        counts: Counter[str] = Counter()
        by_codec: Counter[str] = Counter()
        if parts.store is not None:
            try:
                counts = stored_activity(parts.store)
                manifests, _ = self.tree.manifests()
                by_codec = Counter(man.codec for man in manifests)
            except Exception as exc:
                parts.health.fault(exc, "status")
        counts.update(parts.counters.pending())
        encoded = counts["encoded_bytes"]
        return {
            "configured": parts.settings.codec,
            "manifests_by_codec": dict(sorted(by_codec.items())),
            "activity": {name: counts[name] for name in CODEC_COUNTERS},
            "encode_mb_per_s": round(encoded / counts["encode_us"], 1) if encoded else None,
        }

    # ------------------------------------------------------------------ model identities

    def _manifests(self) -> list[Manifest]:
        """Readable manifests; on a writable store damaged ones are quarantined on the way."""
        if self.parts.store is None:
            return []
        try:
            return self.tree.manifests(repair=True)[0]
        except Exception as exc:
            self.parts.health.fault(exc, "listing manifests")
            return []

    def model_identities(self) -> dict[str, str]:
        return {m.model_identity: m.model_name for m in self._manifests()}

    def check_model_identity(self, model_identity: str | None) -> None:
        if model_identity is None:
            return
        if not model_identity.strip():
            raise ConfigError(
                "--model-identity is blank; pass one of the ids `skippy-llama kv-cache status` "
                "lists, or leave it out to act on every model"
            )
        known = self.model_identities()
        if model_identity not in known:
            listing = ", ".join(f"{mid} ({name})" for mid, name in sorted(known.items()))
            raise ConfigError(
                f"unknown model identity {model_identity!r} in {self.parts.health.directory}; "
                f"known: {listing or 'none (the store has no entries)'}"
            )

    def require_store(self, what: str) -> None:
        parts = self.parts
        if parts.store is None or not parts.store.writable:
            health = parts.health
            why = f" ({health.reason})" if health.reason else ""
            detail = f": {health.error}" if health.error else ""
            if parts.store is not None:
                detail = ": it was opened read-only"
            raise ConfigError(f"cannot {what}: L3 is {health.state}{why}{detail}")

    # ------------------------------------------------------------------ prune and clear

    def _sweep(self) -> int:
        try:
            return self.tree.sweep_orphans()
        except Exception as exc:
            self.parts.health.fault(exc, "sweeping orphans")
            return 0

    def prune(self, target_bytes: int | None, model_identity: str | None) -> PruneResult:
        self._manifests()  # damaged or foreign manifests are quarantined on the way
        before = self.used_bytes()
        target = target_bytes
        everything = False
        if target is None and model_identity is None:
            budget = self.parts.health.budget_bytes()
            target = int(budget * LOW_WATERMARK) if before > budget else before
        elif target is None:
            everything = True
        result = self.evictor.evict_to(
            target if target is not None else 0,
            model_identity=model_identity,
            everything=everything,
        )
        self.parts.counters.add("pruned", result.manifests_removed)
        pages = result.pages_removed + self._sweep()
        after = self.used_bytes()
        return PruneResult(
            target_bytes=target_bytes,
            model_identity=model_identity,
            manifests_removed=result.manifests_removed,
            pages_removed=pages,
            bytes_before=before,
            bytes_after=after,
            kept_in_use=result.kept_in_use,
            reached_target=after <= target if target is not None else result.kept_in_use == 0,
        )

    def clear(self, model_identity: str | None) -> ClearResult:
        parts = self.parts
        store = parts.rw
        before = self.used_bytes()
        if model_identity is None:
            mids = [key[1:] for key in store.keys(MAN)]  # damaged ones too
        else:
            mids = [m.id for m in self._manifests() if m.model_identity == model_identity]
        removed = pages = kept = 0
        for mid in mids:
            try:
                with parts.lock, store.transact():
                    pins = self.pins.live()
                    done, deleted, kept_now = self.tree.remove_manifest(
                        mid, pins, respect_pins=False
                    )
            except Exception as exc:
                parts.health.fault(exc, "clear")
                continue
            removed += int(done)
            pages += len(deleted)
            kept += kept_now
            parts.removed(deleted)
        if model_identity is None:
            try:
                Points(parts).clear()
                with parts.lock, store.transact():
                    for key in store.keys(QUAR):
                        store.delete(key)
            except Exception as exc:
                parts.health.fault(exc, "clear")
        pages += self._sweep()
        parts.counters.add("pruned", removed)
        left = sum(
            1
            for m in self._manifests()
            if model_identity is None or m.model_identity == model_identity
        )
        return ClearResult(
            model_identity=model_identity,
            manifests_removed=removed,
            pages_removed=pages,
            pages_kept_in_use=kept,
            bytes_before=before,
            bytes_after=self.used_bytes(),
            manifests_left=left,
        )
