"""Eviction: pages leave in the order a :class:`~.policy_api.Policy` gives, each with the pages
after it, until the store is small enough.

The store describes every page to the policy with a :class:`~.policy_api.PageStats` built from
its metadata (size, tokens, created, last used, hits, sharers = the manifests through it, the
longest stored chain through it, and the measured prefill and restore costs), so any policy (``policies.py``) plugs in unchanged and the
replay simulator (``simulate.py``) evicts the same way: lowest priority first, ties deepest first;
evicting a page cuts every prefix through it back to the pages before it (the pages after it
could never be reached again).

A page in use is never evicted, nor is any page before a page in use on one of its prefixes
(evicting it would cut through the page in use). :func:`eviction_order` and
:func:`protected_keys` are pure; :class:`Evictor` applies them to the store.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ...costs import CostModel
from ...errors import StoreDataError
from .context import Parts
from .costs import TIER
from .pins import Pins
from .policy_api import PageStats, Policy, chain_lengths
from .schema import MAN, META, Manifest, PageMeta
from .tree import Tree


@dataclass(frozen=True)
class Candidate:
    """A page eviction may take, with its depth on its chain (ties go deepest first)."""

    stats: PageStats
    depth: int


def page_stats(
    key: bytes, meta: PageMeta, costs: CostModel | None = None, chain_pages: int = 1
) -> PageStats:
    """What a policy may know about a stored page (costs are 0.0 while unmeasured; the restore
    at L3's own rate; ``chain_pages`` from :func:`~.policy_api.chain_lengths` over the store's
    metadata)."""
    prefill = costs.cold_cost(meta.n_tokens) if costs is not None else None
    restore = costs.restore_cost(meta.size, tier=TIER) if costs is not None else None
    return PageStats(
        key=key,
        size=meta.size,
        n_tokens=meta.n_tokens,
        created=meta.created,
        last_used=meta.last_used,
        hits=meta.hits,
        sharers=max(len(meta.owners), 1),
        chain_pages=chain_pages,
        prefill_s=prefill or 0.0,
        restore_s=restore or 0.0,
    )


def protected_keys(pinned: set[bytes], owners: Mapping[bytes, Iterable[Manifest]]) -> set[bytes]:
    """Pinned pages and every page before one on a prefix through it (``owners`` maps a pinned
    page to the manifests that list it)."""
    out = set(pinned)
    for key, manifests in owners.items():
        for man in manifests:
            keys = man.keys
            if key in keys:
                out.update(keys[: keys.index(key)])
    return out


def eviction_order(candidates: Iterable[Candidate], policy: Policy, now: float) -> list[Candidate]:
    """Candidates in the order they go: lowest priority first, ties deepest first, then by key
    (so the order is the same in every process)."""
    return sorted(candidates, key=lambda c: (policy.priority(c.stats, now), -c.depth, c.stats.key))


@dataclass(frozen=True)
class EvictionResult:
    manifests_removed: int
    pages_removed: int
    kept_in_use: int  # manifests in scope left because a page of theirs is in use


class Evictor:
    """Runs eviction passes over the store with one policy."""

    def __init__(
        self, parts: Parts, tree: Tree, pins: Pins, policy: Policy, costs: CostModel | None
    ) -> None:
        self.parts = parts
        self.tree = tree
        self.pins = pins
        self.policy = policy
        self.costs = costs

    def _used(self) -> int:
        assert self.parts.store is not None
        return self.parts.store.volume()

    def _metas(self) -> dict[bytes, PageMeta]:
        assert self.parts.store is not None
        out: dict[bytes, PageMeta] = {}
        for key, raw in self.parts.store.items(META):
            try:
                out[key[1:]] = PageMeta.unpack(raw)
            except StoreDataError:
                continue  # reconciliation quarantines it
        return out

    def _owners_of(
        self, pinned: set[bytes], metas: Mapping[bytes, PageMeta]
    ) -> dict[bytes, list[Manifest]]:
        out: dict[bytes, list[Manifest]] = {}
        for key in pinned:
            meta = metas.get(key)
            for mid in meta.owners if meta is not None else ():
                try:
                    man = self.tree.manifest(mid)
                except StoreDataError:
                    continue
                if man is not None:
                    out.setdefault(key, []).append(man)
        return out

    def evict_to(
        self, target: int, *, model_identity: str | None = None, everything: bool = False
    ) -> EvictionResult:
        """Evict until the store uses at most ``target`` bytes (with ``everything``: every page
        in scope that is not in use). ``model_identity`` limits the scope to one model's pages.
        """
        parts = self.parts
        store = parts.store
        assert store is not None
        metas = self._metas()
        scope: set[bytes] | None = None
        in_scope: list[Manifest] = []
        if model_identity is not None:
            manifests, _ = self.tree.manifests(repair=True)
            in_scope = [m for m in manifests if m.model_identity == model_identity]
            scope = {key for man in in_scope for key in man.keys}
        manifests_before = len(in_scope) if scope is not None else store.count(MAN)
        pinned = self.pins.live()
        protected = protected_keys(pinned, self._owners_of(pinned, metas))
        now = time.time()
        chains = chain_lengths({key: (meta.parent, meta.depth) for key, meta in metas.items()})
        candidates = [
            Candidate(page_stats(key, meta, self.costs, chains[key]), meta.depth)
            for key, meta in metas.items()
            if key not in protected and (scope is None or key in scope)
        ]
        gone: set[bytes] = set()
        for cand in eviction_order(candidates, self.policy, now):
            if not everything and self._used() <= target:
                break
            if cand.stats.key in gone:
                continue
            try:
                deleted = self.tree.evict_page(cand.stats.key, self.pins.live())
            except Exception as exc:
                parts.health.fault(exc, "evict")
                continue
            gone.update(deleted)
            parts.removed(deleted)
            for key in deleted:
                meta = metas.get(key)
                if meta is not None:
                    self.policy.evicted(page_stats(key, meta, self.costs), now)
        if scope is not None:
            manifests, _ = self.tree.manifests(repair=True)
            left = [m for m in manifests if m.model_identity == model_identity]
        else:
            left = []
        after = len(left) if scope is not None else store.count(MAN)
        kept = 0
        if pinned and (everything or self._used() > target):
            pool = left if scope is not None else self.tree.manifests(repair=True)[0]
            kept = sum(1 for man in pool if any(k in pinned for k in man.keys))
        return EvictionResult(max(manifests_before - after, 0), len(gone), kept)
