"""Prefetch: bring a likely-next prompt's L3 pages into L2 before its request comes.

SGLang HiCache's idea for this cache's tiers: the server's idle gap and a batch's trie order
know which prompt probably comes next, and reading its pages from disk then, rather than inside
the request, turns its L3 restore into an L2 one. Pure cache-layer code (no llama.cpp, nothing of
the working sequence), so it may run on any thread beside a request: L2 is locked, L3 reads
into a buffer per thread and its store is shared by threads and processes.

The prompt's page path is walked over L2 and L3 as the planner walks it (L1 left out: its
checkpoints live in the context, which only the request thread touches). Pages L2 holds are
marked predicted; the rest are read from L3 in runs of at most :data:`READ_CHUNK_BYTES` and
copied into L2 before the next read reuses the buffer, as a prediction under L2's rules
(:meth:`~skippy_llama.tiers.ram.RamTier.prefetch_fill`). A tier fault is a counted miss; nothing
here raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from .tiers.base import PathStep, walk

if TYPE_CHECKING:
    from .cache import PrefixCache

log = logging.getLogger("skippy_llama")

Tokens = npt.NDArray[np.int32]

#: Bytes of pages read from L3 in one call: large enough for the reader's parallel loads, small
#: enough that a background thread's read buffer (kept until its next read) stays modest.
READ_CHUNK_BYTES = 64 << 20

#: Why a prefetch stopped:
#:
#: * ``complete``: every page of the prompt's stored path is in L2 now;
#: * ``not_stored``: L3 holds no page of the prompt;
#: * ``off``: L2 or L3 is off, not serving, or the prompt is too short to reuse;
#: * ``l2_full``: L2 had no room the prefetch may take (see ``tiers/ram.py``);
#: * ``too_large``: a page is over L2's payload cap;
#: * ``l3_miss``: a page was missing, damaged or unreadable in L3 (counted there);
#: * ``stopped``: the caller's ``stop`` asked it to (a request is waiting, a batch ends);
#: * ``error``: an unexpected fault, counted and logged.
StopReason = Literal[
    "complete", "not_stored", "off", "l2_full", "too_large", "l3_miss", "stopped", "error"
]


@dataclass(frozen=True)
class PrefetchResult:
    """What one :meth:`~skippy_llama.cache.PrefixCache.prefetch` did.

    Attributes:
        pages: pages copied from L3 into L2.
        bytes: their payload bytes.
        held: pages of the path L2 held already.
        tokens: leading prompt tokens whose pages L2 now holds or lie wholly inside ``skip``
            (what the request can take without reading L3).
        stored_tokens: leading prompt tokens the stored page path covers (L2 and L3).
        stopped: why it stopped (:data:`StopReason`).
    """

    pages: int = 0
    bytes: int = 0
    held: int = 0
    tokens: int = 0
    stored_tokens: int = 0
    stopped: StopReason = "off"


class Prefetcher:
    """The prefetch of one :class:`~skippy_llama.cache.PrefixCache` (its ``prefetch`` method)."""

    def __init__(self, cache: PrefixCache) -> None:
        # prefetches may run on several threads (a batch's, the server's model thread): the
        # cache counts them under its lock
        self.cache = cache

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
        self.cache.count_prefetch(result)
        return result

    def _run(self, tokens: Tokens, stop: Callable[[], bool] | None, skip: int) -> PrefetchResult:
        cache = self.cache
        ram, disk = cache.ram, cache.disk
        # the last prompt token is always decoded (its logits are needed): never reused
        limit = len(tokens) - 1
        if ram is None or disk is None or not ram.serving or limit < 1:
            return PrefetchResult(stopped="off")
        path = walk([ram, disk], cache.root, tokens, limit, cache.page_tokens)
        steps = path.steps
        if not steps:
            return PrefetchResult(stopped="not_stored")
        in_l2 = [step.holder == "l2" or ram.holds(step.key) for step in steps]
        held = ram.predict([s.key for s, here in zip(steps, in_l2, strict=True) if here])
        protect = frozenset(step.key for step in steps)
        pages = nbytes = 0
        stopped: StopReason = "complete"
        # pages wholly inside the first ``skip`` tokens come from elsewhere (the live sequence)
        ends = np.cumsum([step.used for step in steps])
        wanted = [not here and end > skip for here, end in zip(in_l2, ends, strict=True)]
        for run in self._runs(steps, wanted):
            if stop is not None and stop():
                stopped = "stopped"
                break
            got = disk.read_with_digests([steps[i].key for i in run])
            for i, (payload, digest) in zip(run, got, strict=False):
                # a view into this thread's read buffer: prefetch_fill copies it before the
                # next read reuses the buffer
                outcome = ram.prefetch_fill(steps[i].key, payload, digest, protect)
                if outcome == "added":
                    pages += 1
                    nbytes += len(payload)
                if outcome in ("added", "held"):
                    in_l2[i] = True
                    continue
                stopped = "l2_full" if outcome == "full" else "too_large"
                break
            if stopped != "complete":
                break
            if len(got) < len(run):
                stopped = "l3_miss"
                break
        covered = 0
        for step, here, end in zip(steps, in_l2, ends, strict=True):
            if not here and end > skip:
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

    def _runs(self, steps: Sequence[PathStep], wanted: Sequence[bool]) -> list[list[int]]:
        """Indices of the ``wanted`` steps, in path order, cut into runs of consecutive pages of
        at most ``READ_CHUNK_BYTES`` (by the cache's bytes per token; one page at least)."""
        per_token = max(self.cache.bytes_per_token, 1)
        runs: list[list[int]] = []
        size = 0
        for i, (step, want) in enumerate(zip(steps, wanted, strict=True)):
            if not want:
                continue
            page = step.n_tokens * per_token
            if not runs or runs[-1][-1] != i - 1 or size + page > READ_CHUNK_BYTES:
                runs.append([])
                size = 0
            runs[-1].append(i)
            size += page
        return runs
