"""The seam between L3's store and its admission/eviction policies (pure, no diskcache).

The store (and the trace replay simulator) describe each page with a :class:`PageStats` and ask a
:class:`Policy` two questions: should a new page be admitted, and in which order should pages be
evicted. Policies keep no reference to the store, so the same object drives the live store and
the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

K = TypeVar("K")

#: Eviction goes down to this fraction of the budget once over it, so that it runs in bursts,
#: not per write (the live store and the simulator share it).
LOW_WATERMARK = 0.85


@dataclass(frozen=True)
class PageStats:
    """What a policy may know about one stored (or candidate) page.

    ``sharers`` counts the stored prefixes whose path runs through the page, so a policy can
    charge shared pages fractionally; ``chain_pages`` is the length in pages of the record that
    writes it (at admission) or of the longest stored chain through it (at eviction, see
    :func:`chain_lengths`), 1 where unknown;
    ``prefill_s`` / ``restore_s`` are the measured costs of prefilling the page's tokens cold and
    of restoring them (0.0 while unmeasured).
    """

    key: bytes
    size: int
    n_tokens: int
    created: float
    last_used: float
    hits: int = 0
    sharers: int = 1
    chain_pages: int = 1
    prefill_s: float = 0.0
    restore_s: float = 0.0


def chain_lengths(links: Mapping[K, tuple[K | None, int]]) -> dict[K, int]:
    """Per page, the pages on the longest stored chain through it: the depth of the deepest
    page stored under it, plus one.

    ``links`` maps each stored page to its parent and its depth (0 for a root page). A parent
    that is not in ``links`` ends the walk, and each page passes its length to its parent once,
    deepest first, so damaged links (cycles, wrong depths) cannot loop.
    """
    longest = {key: depth + 1 for key, (_, depth) in links.items()}
    for key, (parent, _) in sorted(links.items(), key=lambda item: -item[1][1]):
        if parent in longest and parent != key:
            longest[parent] = max(longest[parent], longest[key])
    return longest


class Policy(Protocol):
    """Admission and eviction order for L3 pages."""

    name: str

    def admit(self, page: PageStats, now: float) -> bool:
        """Whether a new page is written at all."""
        ...

    def priority(self, page: PageStats, now: float) -> float:
        """Eviction order: pages with the lowest priority are evicted first."""
        ...

    def evicted(self, page: PageStats, now: float) -> None:
        """Told after ``page`` left the store (for ghost lists and aging)."""
        ...


class LruPolicy:
    """Admit everything, evict by last use (the reference every other policy must beat)."""

    name = "lru"

    def admit(self, page: PageStats, now: float) -> bool:
        return True

    def priority(self, page: PageStats, now: float) -> float:
        return page.last_used

    def evicted(self, page: PageStats, now: float) -> None:
        return None
