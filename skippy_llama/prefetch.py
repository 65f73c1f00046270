"""Prefetch: bring a likely-next prompt's pages into a shallow tier before its request comes.

SGLang HiCache's idea for this cache's tiers: the server's idle gap and a batch's trie order
know which prompt probably comes next, and reading its pages from a deeper tier (L3's disk, the
remote store) then, rather than inside the request, turns its restore into one from the tier a
prefetch fills (a :class:`~skippy_llama.tiers.base.PrefetchTier`: L2). Pure cache-layer code (no
llama.cpp, nothing of the working sequence), so it may run on any thread beside a request: L2 is
locked, L3 reads into a buffer per thread and its store is shared by threads and processes.

The prompt's page path is found by the planner over the serving page tiers, each page from the
cheapest tier that holds it, as a restore would read it (L1 left out: its checkpoints live in the
context, which only the request thread touches). The first serving prefetch tier is the target;
the tiers after it are the sources. Pages the target holds are marked predicted; the rest are read
from their source in runs of at most :data:`READ_CHUNK_BYTES` and offered to the target before the
next read reuses the buffer, as predictions under its rules (L2:
:meth:`~skippy_llama.tiers.ram.RamTier.prefetch_fill`). A tier fault is a counted miss; nothing
here raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from .plan import Planner, Prompt
from .tiers.base import (
    DigestedPageTier,
    PageTier,
    PathStep,
    Payload,
    PrefetchFill,
    PrefetchTier,
)

log = logging.getLogger("skippy_llama")

Tokens = npt.NDArray[np.int32]

#: Bytes of pages read from L3 in one call: large enough for the reader's parallel loads, small
#: enough that a background thread's read buffer (kept until its next read) stays modest.
READ_CHUNK_BYTES = 64 << 20

#: Why a prefetch stopped:
#:
#: * ``complete``: every page of the prompt's stored path is in the target tier now;
#: * ``not_stored``: no page tier holds a page of the prompt;
#: * ``off``: no serving tier a prefetch fills (L2), none deeper to read from, or the prompt is
#:   too short to reuse;
#: * ``full``: the target had no room the prefetch may take (see ``tiers/ram.py``);
#: * ``too_large``: a page is over the target's payload cap;
#: * ``foreign``: a page the target may not hold (L2 mirrors L3: a page only the remote tier
#:   holds is not one, nor bytes L3 rewrote or dropped after the prefetch read them);
#: * ``miss``: a page was missing, damaged or unreadable in its source tier (counted there);
#: * ``stopped``: the caller's ``stop`` asked it to (a request is waiting, a batch ends);
#: * ``error``: an unexpected fault, counted and logged.
StopReason = Literal[
    "complete", "not_stored", "off", "full", "too_large", "foreign", "miss", "stopped", "error"
]


#: How a page the target did not take ends the prefetch.
_STOPS: dict[PrefetchFill, StopReason] = {
    "full": "full",
    "too_large": "too_large",
    "foreign": "foreign",
}


@dataclass(frozen=True)
class PrefetchResult:
    """What one :meth:`~skippy_llama.cache.PrefixCache.prefetch` did.

    Attributes:
        pages: pages copied into the target tier (L2).
        bytes: their payload bytes.
        held: pages of the path the target held already.
        tokens: leading prompt tokens whose pages the target now holds or lie wholly inside
            ``skip`` (what the request can take without reading a deeper tier).
        stored_tokens: leading prompt tokens the stored page path covers (every page tier).
        stopped: why it stopped (:data:`StopReason`).
    """

    pages: int = 0
    bytes: int = 0
    held: int = 0
    tokens: int = 0
    stored_tokens: int = 0
    stopped: StopReason = "off"


def _read(source: PageTier, keys: Sequence[bytes]) -> list[tuple[Payload, bytes | None]]:
    """Pages of the longest prefix of ``keys`` that ``source`` holds, each with the digest its
    read verified where the tier keeps one (:class:`DigestedPageTier`), else None."""
    if isinstance(source, DigestedPageTier):
        return list(source.fetch_digested(keys))
    return [(payload, None) for payload in source.fetch(keys)]


def prefetch_target(tiers: Sequence[PageTier]) -> PrefetchTier | None:
    """The first of the page ``tiers`` a prefetch fills, when one after it can be read from."""
    target = next((t for t in tiers if isinstance(t, PrefetchTier)), None)
    return None if target is None or target is tiers[-1] else target


class Prefetcher:
    """The prefetch over one planner's page tiers (a
    :class:`~skippy_llama.cache.PrefixCache`'s ``prefetch`` method, which counts its results).

    Args:
        planner: finds the prompt's page path over its serving page tiers.
    """

    def __init__(self, planner: Planner) -> None:
        self.planner = planner

    def __call__(
        self,
        tokens: Sequence[int] | Tokens,
        stop: Callable[[], bool] | None = None,
        skip: int = 0,
    ) -> PrefetchResult:
        try:
            result = self._run(np.asarray(tokens, dtype=np.int32), stop, skip)
        except Exception as exc:  # fail-open: a prefetch is an optimization
            log.warning("skippy-llama: prefetch failed (%s); continuing without it", exc)
            result = PrefetchResult(stopped="error")
        return result

    def _run(self, tokens: Tokens, stop: Callable[[], bool] | None, skip: int) -> PrefetchResult:
        planner = self.planner
        tiers = planner.page_tiers()
        target = prefetch_target(tiers)
        # the last prompt token is always decoded (its logits are needed): never reused
        limit = len(tokens) - 1
        if target is None or limit < 1:
            return PrefetchResult(stopped="off")
        # written pages only: the target mirrors what its source holds, not what is in flight
        path = planner.page_path(Prompt(tokens, limit), limit, tiers, queued=False)
        steps = path.steps
        if not steps:
            return PrefetchResult(stopped="not_stored")
        at = tiers.index(target)
        sources = planner.sources(path, tiers, queued=False)
        # pages the target (or a tier before it) holds need no read
        here = [tiers.index(source) <= at for source in sources]
        held = target.predict([s.key for s, there in zip(steps, here, strict=True) if there])
        protect = frozenset(step.key for step in steps)
        pages = nbytes = 0
        stopped: StopReason = "complete"
        # pages wholly inside the first ``skip`` tokens come from elsewhere (the live sequence)
        ends = np.cumsum([step.used for step in steps])
        wanted = [not there and end > skip for there, end in zip(here, ends, strict=True)]
        for run in self._runs(steps, sources, wanted):
            if stop is not None and stop():
                stopped = "stopped"
                break
            got = _read(sources[run[0]], [steps[i].key for i in run])
            for i, (payload, digest) in zip(run, got, strict=False):
                # a view into this thread's read buffer: the target copies it before the next
                # read reuses the buffer
                outcome = target.take_prefetched(steps[i].key, payload, protect, digest)
                if outcome == "added":
                    pages += 1
                    nbytes += len(payload)
                if outcome in ("added", "held"):
                    here[i] = True
                    continue
                stopped = _STOPS[outcome]
                break
            if stopped != "complete":
                break
            if len(got) < len(run):
                stopped = "miss"
                break
        covered = 0
        for step, there, end in zip(steps, here, ends, strict=True):
            if not there and end > skip:
                break
            covered += step.used
        return PrefetchResult(
            pages=pages,
            bytes=nbytes,
            held=held,
            tokens=covered,
            stored_tokens=path.n_tokens,
            stopped=stopped,
        )

    def _runs(
        self, steps: Sequence[PathStep], sources: Sequence[PageTier], wanted: Sequence[bool]
    ) -> list[list[int]]:
        """Indices of the ``wanted`` steps, in path order, cut into runs of consecutive pages of
        one source tier, of at most ``READ_CHUNK_BYTES`` (by the planner's bytes per token; one
        page at least)."""
        per_token = max(self.planner.bytes_per_token, 1)
        runs: list[list[int]] = []
        size = 0
        for i, (step, want) in enumerate(zip(steps, wanted, strict=True)):
            if not want:
                continue
            page = step.n_tokens * per_token
            if (
                not runs
                or runs[-1][-1] != i - 1
                or sources[runs[-1][-1]] is not sources[i]
                or size + page > READ_CHUNK_BYTES
            ):
                runs.append([])
                size = 0
            runs[-1].append(i)
            size += page
        return runs
