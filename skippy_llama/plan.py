"""The restore planner: one frozen plan per prompt, every gate in one place (pure, no llama.cpp).

A prompt's tokens and the live working sequence go in (:class:`Prompt`); one
:class:`RestorePlan` comes out: which live cells to keep, whether to checkpoint the live
sequence first, the L1 checkpoint or the pages (per tier) to restore, where the suffix starts,
and why this plan won. Every gate lives here: the canonical granule, ``logits_all``, the sliding
window, the L1 cost rule, the L2/L3 cost rule. A plan carries what executing it needs (the pages,
the checkpoint's handle); the runtime's KV seam reads the pages from a :class:`PageSource` and
says what it did in a :class:`RestoreOutcome`. When a step fails, the request path asks the same
planner again with the failed tiers excluded (``exclude``): the next-shallower plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .costs import CostModel
from .identity import chain_key, page_keys
from .tiers.base import (
    PagePath,
    PageTier,
    PathStep,
    RemotePageTier,
    ResidentTier,
    Tier,
    Tokens,
    best_child,
    common_prefix,
    walk,
)


@dataclass(frozen=True)
class Prompt:
    """What the planner knows of a prompt and of the working sequence it would continue.

    Attributes:
        tokens: the prompt.
        limit: tokens that may be reused (the runtime decodes the last ones whatever is cached).
        live: the tokens of the working sequence's exact cells.
        live_cells: cells the working sequence holds (exact or not).
        granule: reused prefixes end at multiples of this (the canonical batch boundary).
        scored: with ``logits_all``, the cells whose logits rows this context computed (only
            those are reused, from the live sequence alone); None otherwise.
        sliding_window: the model has a sliding-window cache (cut back inside its cells, its
            continuation differs from a cold one).
        can_append: the runtime can continue an L1 prefix with pages (append import).
        live_recorded: leading tokens of ``live`` that the record-taking tiers hold or were
            handed (the runtime's last record): a prompt that destroys them loses only what
            restoring those pages costs, which a park must beat (:meth:`Planner.park`).
    """

    tokens: Tokens
    limit: int
    live: Tokens = field(default_factory=lambda: np.zeros(0, np.int32))
    live_cells: int = 0
    granule: int = 1
    scored: int | None = None
    sliding_window: bool = False
    can_append: bool = False
    live_recorded: int = 0

    def aligned(self, n: int) -> int:
        return n - n % self.granule

    def without_live(self) -> Prompt:
        """The same prompt after the working sequence was cleared."""
        return dataclasses.replace(self, live=self.live[:0], live_cells=0, live_recorded=0)


@dataclass(frozen=True)
class PageRef:
    """One page of a plan: fetched from ``tier``; its first ``used`` tokens are restored."""

    tier: str
    key: bytes
    used: int


@dataclass(frozen=True)
class RestorePlan:
    """How a prompt's prefix gets into the working sequence.

    Attributes:
        tier: what serves: ``l1`` (the live sequence or a checkpoint), a page tier's name, or
            ``cold``.
        n_tokens: cached tokens after the plan; the suffix is prefilled from here.
        keep: live cells kept as they are (the rest of the working sequence is dropped).
        park: checkpoint the live sequence before it is left (the prompt destroys a part of
            it worth keeping: see :meth:`Planner.park`).
        park_skipped: why the live sequence was not parked although the prompt destroys some
            of it (None when it destroys nothing, or there is no L1).
        seq_id: the L1 checkpoint to copy, if any.
        handle: that checkpoint's handle (what the runtime restores it from).
        pages: the pages to fetch and restore, in order.
        base_tokens: for an append plan, the tokens kept from the live sequence (``seq_id`` None)
            or the checkpoint ``seq_id`` below the pages; 0 for a plan that rebuilds the prefix.
        floor: the depth a shallower plan offered (what a failed page plan falls back to).
        limit: the reusable bound the plan was made for (granule-aligned).
        expected_s / cold_s: the cost model's estimate of the restore and of prefilling the
            tokens it saves (None where unmeasured).
        reason: why this plan won.
        skipped: deeper tiers whose hits the cost model rejected.
        searched: page tiers that were searched and held no page of the prompt.
    """

    tier: str
    n_tokens: int
    keep: int
    park: bool = False
    park_skipped: str | None = None
    seq_id: int | None = None
    handle: bytes = b""
    pages: tuple[PageRef, ...] = ()
    base_tokens: int = 0
    floor: int = 0
    limit: int = 0
    expected_s: float | None = None
    cold_s: float | None = None
    reason: str = ""
    skipped: tuple[str, ...] = ()
    searched: tuple[str, ...] = ()

    @property
    def appended_tokens(self) -> int:
        """Tokens an append plan takes from pages (0 for other plans)."""
        return self.n_tokens - self.base_tokens if self.base_tokens else 0

    @property
    def page_tiers(self) -> tuple[str, ...]:
        """The tiers the pages come from, each once, in order."""
        return tuple(dict.fromkeys(page.tier for page in self.pages))

    def short_note(self, n_fetched: int) -> str:
        """What a fetch that got only the first ``n_fetched`` of the pages serves."""
        served = self.n_tokens - sum(page.used for page in self.pages[n_fetched:])
        return (
            f"{self.pages[n_fetched].tier}: served {served} of {self.n_tokens} tokens; a page "
            "was missing or failed verification"
        )

    def truncated(self, n: int) -> RestorePlan:
        """The same plan cut to ``n`` tokens (a short fetch; ``n`` above ``floor``)."""
        if n >= self.n_tokens:
            return self
        # page tokens count from each page's start: an append's first page includes cells
        # below base_tokens that are skipped
        left = n - self.n_tokens + sum(page.used for page in self.pages)
        pages: list[PageRef] = []
        for page in self.pages:
            if left <= 0:
                break
            pages.append(dataclasses.replace(page, used=min(page.used, left)))
            left -= pages[-1].used
        return dataclasses.replace(self, n_tokens=n, pages=tuple(pages))


class Planner:
    """Plans restores across an ordered list of tiers with one cost model."""

    def __init__(
        self,
        root: bytes,
        page_tokens: int,
        tiers: Sequence[Tier],
        costs: CostModel,
        bytes_per_token: int = 0,
    ) -> None:
        self.root = root
        self.page_tokens = page_tokens
        self.tiers = tuple(tiers)
        self.costs = costs
        self.bytes_per_token = bytes_per_token
        # sorted once: an isinstance check against a runtime-checkable protocol walks its
        # members (~0.1 ms on this project's loaded 2-core machine), and every plan asked
        self._residents = tuple(t for t in self.tiers if isinstance(t, ResidentTier))
        self._page_tiers = tuple(t for t in self.tiers if isinstance(t, PageTier))

    def _resident(self, exclude: frozenset[str]) -> ResidentTier | None:
        return next((t for t in self._residents if t.name not in exclude), None)

    def page_tiers(self, exclude: frozenset[str] = frozenset()) -> list[PageTier]:
        """The serving page tiers, cheapest first."""
        return [t for t in self._page_tiers if t.name not in exclude and t.serving]

    def plan(self, prompt: Prompt, *, exclude: frozenset[str] = frozenset()) -> RestorePlan:
        """The best plan for ``prompt``, leaving out the tiers named in ``exclude``."""
        tokens = prompt.tokens
        limit = prompt.aligned(prompt.limit)
        exact = len(prompt.live)
        live = prompt.aligned(common_prefix(prompt.live, tokens[: prompt.limit]))
        if prompt.scored is not None:
            # every prompt token's logits row may be read (llm.scores, prompt logprobs), and
            # cells restored from any tier came without theirs: only cells this context decoded
            # are reused, as plain Llama would; a prompt that leaves them is not parked
            live = min(live, prompt.scored)
            return RestorePlan(
                "l1" if live else "cold", live, live, limit=limit, reason="logits_all: live only"
            )
        reason = "live sequence" if live else "nothing cached"
        if prompt.sliding_window and 0 < live < prompt.live_cells:
            # a sliding-window cache cut back inside its cells continued with logits off by up
            # to 0.93 on Gemma 3 (plain Llama's prefix reuse too): when in doubt, prefill cold
            live, reason = 0, "sliding window: the live sequence cannot be cut"
        resident = self._resident(exclude)
        parkable = live < exact and resident is not None
        park, park_skipped = self.park(prompt) if parkable else (False, None)
        base = RestorePlan(
            "l1" if live else "cold",
            live,
            live,
            park=park,
            park_skipped=park_skipped,
            limit=limit,
            reason=reason,
        )
        best = base
        skipped: list[str] = []
        if resident is not None and limit > live:
            hit = resident.match(self.root, tokens, limit)
            n = prompt.aligned(hit.n_tokens) if hit is not None else 0
            if hit is not None and n > live:
                best = dataclasses.replace(
                    base,
                    tier="l1",
                    n_tokens=n,
                    seq_id=hit.seq_id,
                    handle=hit.handle,
                    reason="resident checkpoint",
                )
        best = self._pages(prompt, limit, best, exclude, skipped)
        if best.seq_id is not None and not best.pages:
            saved = best.n_tokens - live
            if not self.costs.checkpoint_pays(saved):
                # on this machine a checkpoint restore costs more than the prefill it saves
                skipped.append("l1")
                best = base
            else:
                best = dataclasses.replace(
                    best,
                    expected_s=self.costs.checkpoint_restore_seconds,
                    cold_s=self.costs.cold_cost(saved),
                )
        return dataclasses.replace(best, skipped=tuple(skipped))

    def park(self, prompt: Prompt) -> tuple[bool, str | None]:
        """Whether to park the live sequence before ``prompt`` cuts it, and if not, why (None
        when the prompt destroys nothing: it continues the whole live sequence).

        What a park keeps is what the prompt destroys: the live exact tokens past the common
        prefix with the prompt. The shared part is never counted: the prompt's own prefill
        leaves it live again (the cells past the granule boundary included). A park is
        insurance: it pays when its expected saving beats its measured cost (the cost model's
        :meth:`~skippy_llama.costs.CostModel.park_pays`): the chance that the prefix returns
        (``reuse_probability``: one-shot prompts never do) × what bringing the destroyed tokens
        back without it costs beyond a checkpoint restore, where the part the last record
        handed to L3 (``Prompt.live_recorded``) comes back at L3's restore rate, not by a
        prefill. Until those are measured, it must destroy one page at least: a tail shorter
        than a page (a question after a shared document) is prefilled again in a few
        milliseconds, while the park copies the whole prefix (20-26 ms for 1,293 tokens on
        2 CPU cores, issue 42); a tail of a page or more is parked, which measures what parks
        cost here.
        """
        common = common_prefix(prompt.live, prompt.tokens)
        destroyed = len(prompt.live) - common
        if destroyed <= 0:
            return False, None
        tier = next((t.name for t in self.page_tiers() if t.takes_records), "")
        recorded = max(0, min(prompt.live_recorded, len(prompt.live)) - common) if tier else 0
        costs = self.costs
        reuse = costs.reuse_probability
        n_bytes = recorded * self.bytes_per_token
        if costs.park_pays(
            destroyed,
            unmeasured_min=self.page_tokens,
            reuse=reuse,
            recorded_tokens=recorded,
            recorded_bytes=n_bytes,
            tier=tier,
        ):
            return True, None
        gain = costs.park_gain(
            destroyed, reuse=reuse, recorded_tokens=recorded, recorded_bytes=n_bytes, tier=tier
        )
        recall = costs.recall_cost(
            destroyed, recorded_tokens=recorded, recorded_bytes=n_bytes, tier=tier
        )
        if gain is None or recall is None:
            return False, f"{destroyed} tokens lost, under one page: prefilled again if asked"
        saving, park = gain
        restore = costs.checkpoint_restore_seconds or 0.0
        return False, (
            f"{destroyed} tokens lost: bringing them back costs {recall * 1e3:.1f} ms"
            f"{f' ({recorded} from {tier})' if recorded else ''}, a checkpoint restore "
            f"{restore * 1e3:.1f} ms; at a reuse chance of {reuse:.2f} a park would save "
            f"{saving * 1e3:.1f} ms, no more than it costs ({park * 1e3:.1f} ms)"
        )

    def _remote_path(
        self, prompt: Prompt, limit: int, depth: int, tiers: Sequence[PageTier]
    ) -> PagePath | None:
        """The pages a remote tier holds, if deeper than ``depth`` tokens: its aligned pages,
        then the best of the pages stored after them (a record's tail). One lookup per remote
        tier, and none when no whole page could beat ``depth``."""
        p = self.page_tokens
        whole = limit - limit % p
        for tier in tiers:
            if not isinstance(tier, RemotePageTier) or prompt.aligned(whole) <= depth:
                continue
            keys = page_keys(self.root, prompt.tokens[:whole], p)
            held = tier.match_path(keys)
            parents = [self.root, *keys[: held.depth]]
            pairs = zip(keys[: held.depth], parents, strict=False)
            steps = [PathStep(key, parent, p, p) for key, parent in pairs]
            pos = held.depth * p
            tail = best_child(held.children, parents[-1], prompt.tokens[pos:limit])
            end = parents[-1]
            if tail is not None:  # as walk() ends a path: at the node after the used tokens
                steps.append(tail)
                cut = prompt.tokens[pos : pos + tail.used]
                end = tail.key if tail.used == tail.n_tokens else chain_key(end, cut)
            path = PagePath(tuple(steps), end)
            if prompt.aligned(path.n_tokens) > depth:
                return path
        return None

    def page_path(
        self,
        prompt: Prompt,
        limit: int,
        tiers: Sequence[PageTier],
        *,
        depth: int = 0,
        queued: bool = True,
    ) -> PagePath:
        """The longest path of pages ``tiers`` hold that matches ``prompt.tokens[:limit]``: the
        local tiers walked page by page, a remote tier asked once, only when a whole page
        could beat both ``depth`` and the local path. ``queued``: pages still waiting to be
        written count (L3's fetch serves them, issue 42; a prefetch, which can mirror only
        written pages, leaves them out)."""
        local = [t for t in tiers if not isinstance(t, RemotePageTier)]
        path = walk(local, self.root, prompt.tokens, limit, self.page_tokens, queued=queued)
        return self._remote_path(prompt, limit, max(path.n_tokens, depth), tiers) or path

    @staticmethod
    def sources(
        path: PagePath, tiers: Sequence[PageTier], *, queued: bool = True
    ) -> list[PageTier]:
        """For each step of ``path``, the cheapest of ``tiers`` that holds its page (a remote
        tier's pages are found by :meth:`page_path` alone, never by key; ``queued`` as there)."""
        local = [t for t in tiers if not isinstance(t, RemotePageTier)]
        remote = [t for t in tiers if isinstance(t, RemotePageTier)]
        far = remote[0] if remote else tiers[-1]
        # the walk already knows who holds each page it found by key: asked only for the rest
        by_name = {t.name: t for t in local}
        return [
            by_name[s.holder]
            if s.holder in by_name
            else next((t for t in local if t.holds(s.key, queued=queued)), far)
            for s in path.steps
        ]

    def _pages(
        self,
        prompt: Prompt,
        limit: int,
        best: RestorePlan,
        exclude: frozenset[str],
        skipped: list[str],
    ) -> RestorePlan:
        """``best`` or a deeper plan from the page tiers."""
        tiers = self.page_tiers(exclude)
        floor = best.n_tokens
        if not tiers or limit - floor < 1:
            return best
        path = self.page_path(prompt, limit, tiers, depth=floor)
        usable = prompt.aligned(path.n_tokens)
        if usable <= floor:
            if not path.steps:
                best = dataclasses.replace(best, searched=tuple(t.name for t in tiers))
            return best
        sources = self.sources(path, tiers)
        # the deepest source's reads dominate a restore: its rate prices the whole of it
        deepest_tier = max(sources, key=tiers.index)
        deepest = deepest_tier.name
        # a tier not in host RAM reads storage or the network: its unmeasured first restore
        # is planned with those reads (``CostModel.restore_cost``)
        storage = not deepest_tier.in_memory
        append = prompt.can_append and floor > 0
        moved = usable - floor if append else usable
        moved_bytes = moved * self.bytes_per_token
        if not self.costs.pages_pay(moved_bytes, usable - floor, tier=deepest, storage=storage):
            skipped.append(deepest)
            return best
        pages: list[PageRef] = []
        end = 0  # where the page ends in the prompt
        for step, source in zip(path.steps, sources, strict=True):
            if end >= usable:
                break
            used = min(step.used, usable - end)
            end += used
            if append and end <= floor:
                continue  # wholly inside the L1 prefix: never read
            pages.append(PageRef(source.name, step.key, used))
        plan = dataclasses.replace(
            best,
            tier=deepest,
            n_tokens=usable,
            pages=tuple(pages),
            base_tokens=floor if append else 0,
            seq_id=best.seq_id if append else None,
            handle=best.handle if append else b"",
            floor=floor,
            expected_s=self.costs.planned_restore_cost(moved_bytes, tier=deepest, storage=storage),
            cold_s=self.costs.cold_cost(usable - floor),
            reason=f"{len(pages)} pages from {', '.join(dict.fromkeys(p.tier for p in pages))}",
        )
        return plan


@dataclass(frozen=True)
class FetchedPage:
    """A page a plan fetched: its key, bytes and the tier that served it.

    ``digest`` is the one the serving tier's read verified for these bytes (L3's: a
    :class:`~skippy_llama.tiers.base.DigestedPageTier`), None where the tier keeps none or the
    page was not stored yet (a record waiting for L3's writer). Promotion keeps a copy under it:
    a digest asked after the read could answer for bytes written since.
    """

    tier: str
    key: bytes
    payload: bytes | memoryview
    digest: bytes | None = None


class PageSource(Protocol):
    """Where the KV seam reads a plan's pages (``PrefixCache.pages``: the page tiers).

    The seam gets this, never the cache: executing a plan reads pages and hands the ones read
    from deeper tiers back for promotion, and nothing else.
    """

    def fetch(self, pages: Sequence[PageRef]) -> list[FetchedPage]:
        """The longest prefix of ``pages`` that can be read and verified, in order. A page L3
        read uncompressed is a view into the reading thread's buffer: restore it (and promote
        it) before that thread's next fetch."""
        ...

    def promote(self, fetched: Sequence[FetchedPage], prefix_tokens: int) -> None:
        """Offer pages fetched from a deeper tier to the shallower page tiers (L3 -> L2), for a
        prefix of ``prefix_tokens``."""
        ...

    def reads_storage(self, pages: Sequence[PageRef]) -> bool:
        """Whether fetching ``pages`` reads storage or the network (some page is not in host
        RAM), so that a restore has reads to overlap."""
        ...


@dataclass
class RestoreOutcome:
    """What executing a plan did (the runtime's KV seam fills it in).

    Attributes:
        plan: the plan that served: the planned one, cut short, or a shallower fallback; for a
            ``failed`` outcome, the plan that failed.
        restored: cells were written into the working sequence (a checkpoint or pages), so the
            runtime adopts the prompt's first ``plan.n_tokens`` tokens; False when only live
            cells were kept.
        restored_bytes: state bytes loaded from pages.
        restore_s: seconds spent fetching and restoring.
        fetched: the pages restored (the cache promotes those from deeper tiers).
        promoted: ``fetched`` was promoted while it was restored (a pipelined restore, whose
            read buffers are reused chunk after chunk: the payloads are no longer valid).
        fallbacks: why a step was abandoned, for the request's ``CacheEvent``.
        faults: the same as counter keys (``step: ExceptionType`` or ``<tier>_short_read``).
        failed: a step failed and the plan served nothing: the working sequence keeps at most
            its first ``plan.keep`` cells, and the request path plans again without the failed
            tiers (:attr:`RestorePlan.page_tiers`, or ``l1``).
        broken_checkpoint: an L1 checkpoint that could not be copied (the request path drops
            it from L1).
    """

    plan: RestorePlan
    restored: bool = False
    restored_bytes: int = 0
    restore_s: float = 0.0
    fetched: tuple[FetchedPage, ...] = ()
    promoted: bool = False
    fallbacks: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    failed: bool = False
    broken_checkpoint: int | None = None

    @property
    def failed_tiers(self) -> tuple[str, ...]:
        """The tiers a failed plan read from: what the next plan leaves out."""
        return self.plan.page_tiers or ("l1",)

    @property
    def tier(self) -> str:
        return self.plan.tier if self.plan.n_tokens > 0 else "cold"

    @property
    def n_tokens(self) -> int:
        return self.plan.n_tokens
