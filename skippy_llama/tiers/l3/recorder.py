"""Writing one record (in the background writer): space, admission, payloads, commit, eviction.

Admission is asked twice, as the two layers of the design: the record as a whole by benefit per
exclusive byte (:class:`~skippy_llama.admission.AdmissionPolicy`, when the runtime measures
costs; shared pages charged fractionally from the store's reference counts), then each new page
in chain order by the store's eviction :class:`~.policy_api.Policy` (a refused page ends the
record: the pages after it could never be reached). New payloads are written once by content
(``add`` is atomic: of several processes writing the same page, one wins) while the record's
pages are pinned, then metadata, child index and manifest land in one transaction.

Pages are encoded here, on the writer thread, never on the request path: with the codec the
record's identity was registered with (``codecs.select``: CacheGen where the roster qualifies
the model and layout) where ``l3.codec`` is cachegen, else losslessly. ``l3.codec = "cachegen"`` for an identity without a
qualified codec, or a page CacheGen does not code, stores native and counts
``codec_unqualified``; ``encode_us`` and ``encoded_bytes`` total the encoding work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from ...admission import AdmissionPolicy
from ...codecs import cachegen, encode, select
from ..records import PrefixRecord
from .context import Parts
from .costs import TIER
from .eviction import Evictor
from .pins import Pins
from .policy_api import LOW_WATERMARK, PageStats, Policy
from .schema import DATA, MAN, META
from .tree import Tree

log = logging.getLogger("skippy_llama")


class Recorder:
    """Writes records (see the module docstring); raises on faults, the writer counts them."""

    def __init__(
        self,
        parts: Parts,
        tree: Tree,
        pins: Pins,
        evictor: Evictor,
        policy: Policy,
        admission: AdmissionPolicy | None,
    ) -> None:
        self.parts = parts
        self.tree = tree
        self.pins = pins
        self.evictor = evictor
        self.policy = policy
        self.admission = admission
        #: called with each record stored and its new pages' stored bytes (``add_listener``)
        self.listeners: list[Callable[[PrefixRecord, Mapping[bytes, bytes]], None]] = []

    def _drop(self, *reasons: str) -> None:
        self.parts.counters.add("dropped_writes")
        for reason in reasons:
            self.parts.counters.add(reason)

    def _encode(self, rec: PrefixRecord, data: bytes) -> bytes:
        """The stored bytes of one new page (see the module docstring)."""
        counters = self.parts.counters
        settings = self.parts.settings
        started = time.perf_counter()
        # a lossy identity (remote.codec) may still store its L3 pages losslessly
        params = (
            select.cachegen_params(rec.cache_identity) if settings.codec == "cachegen" else None
        )
        out: bytes | None = None
        if params is not None:
            try:
                out = cachegen.encode(data, params)
                counters.add("cachegen_pages")
            except cachegen.CodecUnsupportedError as exc:
                select.warn_once(
                    f"unsupported:{rec.cache_identity}",
                    "skippy-llama: CacheGen cannot code these pages (%s); storing them native",
                    exc,
                )
                counters.add("codec_unqualified")
        elif settings.codec == "cachegen":
            counters.add("codec_unqualified")
        if out is None:
            out = encode(data, settings.compression)
        counters.add("encode_us", int((time.perf_counter() - started) * 1e6))
        counters.add("encoded_bytes", len(data))
        return out

    def _admit_record(self, rec: PrefixRecord, size: int) -> bool:
        admission = self.admission
        store = self.parts.rw
        if admission is None or store.contains(MAN + rec.manifest_id):
            return True
        shares: list[tuple[int, int]] = []
        for page in rec.pages:
            meta = self.tree.meta(page.key)
            page_size = meta.size if meta is not None else len(page.payload or b"")
            shares.append((page_size, 1 if meta is None else len(meta.owners) + 1))
        decision = admission.decide(rec.n_tokens, size, sum(s / r for s, r in shares))
        if decision.reason == "fallback_unmeasured":
            self.parts.counters.add("admission_fallback")
        self.parts.counters.add("admitted" if decision.admit else "rejected")
        return decision.admit

    def _admit_pages(self, rec: PrefixRecord, stored: dict[bytes, bytes]) -> PrefixRecord | None:
        """``rec`` up to the first new page the policy refuses; None when nothing new is left."""
        store = self.parts.rw
        costs = self.admission.costs if self.admission is not None else None
        now = time.time()
        for i, page in enumerate(rec.pages):
            if page.payload is None or store.contains(META + page.key):
                continue
            size = len(stored[page.key])
            stats = PageStats(
                key=page.key,
                size=size,
                n_tokens=page.n_tokens,
                created=now,
                last_used=now,
                chain_pages=len(rec.pages),
                prefill_s=(costs.cold_cost(page.n_tokens) or 0.0) if costs else 0.0,
                restore_s=(costs.restore_cost(size, tier=TIER) or 0.0) if costs else 0.0,
            )
            if self.policy.admit(stats, now):
                continue
            self.parts.counters.add("pages_refused")
            head = rec.pages[:i]
            if not head or head[-1].payload is None or head[-1].used != head[-1].n_tokens:
                return None
            return PrefixRecord(
                rec.cache_identity,
                rec.model_identity,
                rec.model_name,
                sum(p.used for p in head),
                head,
            )
        return rec

    def write(self, rec: PrefixRecord) -> None:
        """Write one record (see the module docstring)."""
        parts = self.parts
        health = parts.health
        counters = parts.counters
        size = rec.payload_bytes
        free = health.free_bytes(fresh=True)
        if free is not None and free - size < parts.settings.minimum_free:
            health.set("read_only_low_space", None)
            self._drop("dropped_low_space")
            return
        if not health.writable:
            self._drop()
            return
        budget = health.budget_bytes()
        if size > budget:
            self._drop()  # can never fit; don't evict everything trying
            return
        if not self._admit_record(rec, size):
            return
        try:
            # a page pending in the runtime's capture is cut here, just before it is compressed,
            # so its uncompressed bytes are freed (and their memory reused) page by page
            stored = {
                page.key: self._encode(rec, page.data)
                for page in rec.pages
                if page.payload is not None
            }
        finally:
            rec.drop()  # the capture is no longer read
        admitted = self._admit_pages(rec, stored)
        if admitted is None:
            counters.add("rejected")
            return
        rec = admitted
        store = parts.rw
        token = self.pins.pin([page.key for page in rec.pages])
        try:
            for page in rec.pages:
                if page.payload is None:
                    continue
                data = stored[page.key]
                if store.contains(DATA + page.key) or not store.add(DATA + page.key, data):
                    counters.add("pages_deduplicated")
                else:
                    counters.add("writes")
                    counters.add("bytes_written", len(data))
            new_manifest = self.tree.commit(rec, stored)
        finally:
            self.pins.unpin(token)
        health.ok()
        if new_manifest is None:
            self._drop("dropped_stale")
            return
        if new_manifest:
            counters.add("manifests_written")
            if self.admission is not None:
                self.admission.observe_recorded()
        for listener in self.listeners:
            try:
                listener(rec, stored)
            except Exception:  # a listener (the remote tier) fails open; the page is stored
                counters.add("internal_errors")
                log.exception("skippy-llama: an L3 write listener failed")
        if parts.rw.volume() > budget:
            result = self.evictor.evict_to(int(budget * LOW_WATERMARK))
            counters.add("evictions", result.manifests_removed)
            counters.add("pages_evicted", result.pages_removed)
