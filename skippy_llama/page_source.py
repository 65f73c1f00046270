"""The page tiers as the KV seam reads them: a :class:`~skippy_llama.plan.PageSource`.

``PrefixCache.pages`` is one of these. A plan names each page's tier; this reads them in order,
stops at the first page that cannot be read or verified, and promotes pages read from a deeper
tier into the shallower ones. It plans, counts and commits nothing: that stays with the cache.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

from .plan import FetchedPage, PageRef
from .tiers.arena import ArenaSlot, HostArena
from .tiers.base import DigestedPageTier, PageTier, Payload, Tier
from .tiers.ram import RamTier


class TierPages:
    """Reads and promotes pages across ``tiers`` (cheapest first)."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.tiers = tuple(tiers)
        self._by_name = {t.name: t for t in self.tiers}
        # asked once here: a runtime protocol check walks every member of the protocol (~0.1
        # ms; a restore of 31 pages made 76 of them on its read threads)
        self._digested: dict[str, DigestedPageTier] = {
            t.name: t for t in self.tiers if isinstance(t, DigestedPageTier)
        }
        self._pages: dict[str, PageTier] = {
            t.name: t for t in self.tiers if isinstance(t, PageTier)
        }
        self._order = [t.name for t in self.tiers]

    def fetch(self, pages: Sequence[PageRef]) -> list[FetchedPage]:
        """The longest prefix of ``pages`` that can be read and verified, in order (a
        pipelined restore fetches a plan's pages a chunk at a time)."""
        out: list[FetchedPage] = []
        for name, group in itertools.groupby(pages, key=lambda page: page.tier):
            run = list(group)
            tier = self._pages.get(name)
            keys = [p.key for p in run]
            got: list[tuple[Payload, bytes | None]]
            digested = self._digested.get(name)
            if digested is not None:
                # each page with the digest its read verified, for promotion (see FetchedPage)
                got = digested.fetch_digested(keys, queued=True)
            elif tier is not None:
                got = [(payload, None) for payload in tier.fetch(keys)]
            else:
                got = []
            out += [FetchedPage(name, p.key, b, d) for p, (b, d) in zip(run, got, strict=False)]
            if len(got) < len(run):
                break
        return out

    def promote(self, fetched: Sequence[FetchedPage], prefix_tokens: int) -> None:
        """Offer pages fetched from a deeper tier to the shallower page tiers (L3 -> L2), for a
        prefix of ``prefix_tokens``; before the reading thread's next fetch reuses their bytes."""
        order = self._order
        for page in fetched:
            depth = order.index(page.tier) if page.tier in order else 0
            for name in order[:depth]:
                tier = self._pages.get(name)
                if tier is not None:
                    tier.promote(page.key, page.payload, prefix_tokens, page.digest)

    def prepare_reads(self, nbytes: int) -> None:
        """Ready the calling thread for fetches of up to ``nbytes`` of pages in the tiers that
        read through per-thread buffers and connections (L3's ``prepare_reads``), so that its
        first fetch takes no page faults and opens nothing (``KVSeam.warm_reads`` calls this
        on its read-ahead threads)."""
        for tier in self.tiers:
            prepare = getattr(tier, "prepare_reads", None)
            if prepare is not None:
                prepare(nbytes)

    def reads_storage(self, pages: Sequence[PageRef]) -> bool:
        """Whether fetching ``pages`` reads storage or the network (some page's tier is not
        ``in_memory``), so that a restore has reads to overlap."""
        return any(not self._in_memory(page.tier) for page in pages)

    def _in_memory(self, name: str) -> bool:
        tier = self._pages.get(name)
        return tier is not None and tier.in_memory

    def in_arena(self, pages: Sequence[PageRef]) -> bool:
        """Whether every page of ``pages`` is held in one tier's host arena (L2 with the
        patched per-layer copies), so a restore can copy them straight into the KV tensors
        (no side effects)."""
        tier = self._arena_tier(pages)
        return tier is not None and tier.in_arena([p.key for p in pages])

    @contextlib.contextmanager
    def arena_read(
        self, pages: Sequence[PageRef]
    ) -> Iterator[tuple[HostArena, list[ArenaSlot]] | None]:
        """The arena and the slots of the longest prefix of ``pages`` it holds (verified as a
        fetch is), locked against fills and evictions until the block ends; None when the
        pages are not all in one arena tier."""
        tier = self._arena_tier(pages)
        if tier is None:
            yield None
            return
        with tier.arena_read([p.key for p in pages]) as held:
            yield held

    def promoted_in_arena(self, pages: Sequence[PageRef]) -> bool:
        """Whether the host arena that deeper tiers' pages are promoted into (L2's) holds
        every page of ``pages`` by key, whatever tier the plan reads them from: a page read
        from L3 and promoted while it is restored (no side effects)."""
        tier = self._mirror()
        return tier is not None and tier.in_arena([p.key for p in pages])

    @contextlib.contextmanager
    def promoted_read(
        self, pages: Sequence[PageRef]
    ) -> Iterator[tuple[HostArena, list[ArenaSlot]] | None]:
        """As :meth:`arena_read`, from the arena of :meth:`promoted_in_arena`, for pages read
        from a deeper tier (not counted as that arena's hits: they were read where the plan
        says); None when there is no such arena."""
        tier = self._mirror()
        if tier is None:
            yield None
            return
        with tier.arena_read([p.key for p in pages], count=False) as held:
            yield held

    def _mirror(self) -> RamTier | None:
        return next((t for t in self.tiers if isinstance(t, RamTier) and t.arena is not None), None)

    def _arena_tier(self, pages: Sequence[PageRef]) -> RamTier | None:
        names = {page.tier for page in pages}
        if len(names) != 1:
            return None
        tier = self._by_name.get(names.pop())
        return tier if isinstance(tier, RamTier) and tier.arena is not None else None
