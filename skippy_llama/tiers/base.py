"""The tier protocol: what the planner and the cache ask of every tier, and nothing more.

Two kinds of tier serve a prompt:

- a **resident** tier (L1) holds whole prefixes as device checkpoints of the live context; it
  answers :meth:`ResidentTier.match` with the slot that holds the longest one, and the runtime's
  KV seam copies that checkpoint;
- a **page** tier (L2, L3, a remote store, a test's in-memory dict) holds content-addressed
  token pages under chain keys (:func:`skippy_llama.identity.chain_key`); the planner walks a
  prompt's page path through :meth:`PageTier.holds` and :meth:`PageTier.children`, and the cache
  fetches the chosen pages with :meth:`PageTier.fetch`.

Lookups (``match``, ``holds``, ``children``) change no state; the cache commits what served a
request afterwards (LRU touches, promotions, counters). ``PrefixCache`` composes an ordered list
of tiers, cheapest first, built by :mod:`skippy_llama.tiers.factory`: a new tier is a new module
that implements one of these protocols and registers a factory there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..identity import chain_key
from .records import PrefixRecord

Tokens = npt.NDArray[np.int32]
Payload = bytes | memoryview


def common_prefix(a: Tokens, b: Tokens) -> int:
    """Length of the common prefix of two token arrays."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class TierStatus(Protocol):
    """A tier's status result: anything that renders itself as JSON."""

    def to_json(self) -> dict[str, Any]: ...


@runtime_checkable
class Tier(Protocol):
    """What every tier offers the cache, the server and the CLI."""

    #: short name, unique in one cache: ``l1``, ``l2``, ``l3``, ``remote`` ...
    name: str

    def status(self) -> TierStatus:
        """Budget, usage and counters, as a typed result with ``to_json()``."""
        ...

    def clear(self) -> Any:
        """Drop everything the tier holds (what it returns is tier-specific)."""
        ...

    def close(self) -> None:
        """Release the tier's resources; pending writes are flushed first."""
        ...


@dataclass(frozen=True)
class ResidentMatch:
    """The longest resident prefix of a prompt: ``n_tokens`` cells of checkpoint ``seq_id``,
    which the runtime restores from ``handle``."""

    seq_id: int
    n_tokens: int
    handle: bytes = b""


@dataclass(frozen=True)
class ParkPlan:
    """What the runtime must do to park a prefix: drop ``evict`` checkpoints, then checkpoint
    the working sequence's first ``n_tokens`` cells into slot ``seq_id``."""

    seq_id: int
    n_tokens: int
    evict: tuple[int, ...] = field(default_factory=tuple)


@runtime_checkable
class ResidentTier(Tier, Protocol):
    """L1: prefixes resident as checkpoints of the live context.

    Parking is a transaction the runtime carries out between :meth:`plan_park` and
    :meth:`commit_park` (or :meth:`abandon_park` when the checkpoint call failed): the tier
    only keeps the books, the KV seam makes the checkpoint.
    """

    def match(self, root: bytes, tokens: Tokens, limit: int) -> ResidentMatch | None:
        """The longest resident prefix of ``tokens[:limit]`` (no side effects)."""
        ...

    def touch(self, seq_id: int) -> None:
        """``seq_id`` served a request: it becomes the most recently used."""
        ...

    def plan_park(self, root: bytes, tokens: Tokens) -> ParkPlan | None:
        """Where to checkpoint ``tokens`` (a prefix under ``root``): the slot to fill and the
        slots to drop first; None when it is held already, nothing can be freed or it is empty."""
        ...

    def commit_park(self, plan: ParkPlan, root: bytes, tokens: Tokens, handle: bytes) -> None:
        """``plan`` was carried out: ``tokens[:plan.n_tokens]`` are resident in its slot,
        restored by the runtime's opaque ``handle``."""
        ...

    def abandon_park(self, plan: ParkPlan) -> None:
        """``plan`` failed part way: forget every slot it touches (they may be overwritten)."""
        ...


@runtime_checkable
class PageTier(Tier, Protocol):
    """A store of content-addressed pages (L2, L3, remote ...)."""

    #: whether the runtime's records (new pages of a prompt) are offered to this tier; a mirror
    #: such as L2 takes pages only by promotion from a deeper tier
    takes_records: bool
    #: whether a fetch copies from host memory (L2): a restore from such tiers alone has no
    #: storage or network read to overlap with its import
    in_memory: bool

    @property
    def serving(self) -> bool:
        """Whether lookups may use the tier now."""
        ...

    def holds(self, key: bytes, *, queued: bool = False) -> bool:
        """Whether page ``key`` is held (``queued``: pages still waiting to be written count)."""
        ...

    def children(self, parent: bytes, *, queued: bool = False) -> list[tuple[bytes, bytes]]:
        """Pages stored after node ``parent``: ``(key, tokens as <i4 bytes)``; may be empty for a
        tier that only finds whole aligned pages by key."""
        ...

    def fetch(self, keys: Sequence[bytes]) -> list[Payload]:
        """Verified payloads of the longest prefix of ``keys`` held; never raises."""
        ...

    def offer(self, record: PrefixRecord) -> bool:
        """Take a record's new pages (never blocking the request); True when accepted.

        The tier must call ``record.drop()`` (or let its writer release the record) exactly
        once whatever it decides.
        """
        ...

    def promote(
        self, key: bytes, payload: Payload, prefix_tokens: int, digest: bytes | None
    ) -> None:
        """A deeper tier served ``payload`` for a prefix of ``prefix_tokens``: keep a copy if
        the tier's rules say so (a no-op for tiers that are not mirrors). ``digest``: the one
        the read verified for these bytes, where the serving tier keeps digests
        (:class:`DigestedPageTier`; None where it does not, or for a page not stored yet)."""
        ...

    def note_miss(self) -> None:
        """Count a lookup that found no page of this tier."""
        ...


#: What a prefetch target did with a page offered to it: ``added``, ``held`` (it had the same
#: bytes), ``too_large`` (over its payload cap), ``full`` (no room it may take) or ``foreign``
#: (not a page it may hold: a mirror keeps only the current bytes of the tier it mirrors).
PrefetchFill = Literal["added", "held", "too_large", "full", "foreign"]


@runtime_checkable
class PrefetchTier(PageTier, Protocol):
    """A page tier a prefetch fills (a mirror such as L2): pages of a likely-next prompt, read
    from deeper page tiers ahead of its request, are offered to it as predictions that it keeps
    under its own rules (:mod:`skippy_llama.prefetch`). Safe on any thread."""

    def predict(self, keys: Sequence[bytes]) -> int:
        """Mark the pages of ``keys`` it holds as predicted (a prefetch found them here: later
        prefetches leave them alone); returns how many it holds."""
        ...

    def take_prefetched(
        self, key: bytes, payload: Payload, protect: frozenset[bytes], digest: bytes | None
    ) -> PrefetchFill:
        """Keep a copy of page ``key`` a prefetch read from a deeper tier (``payload`` may be a
        view into a read buffer: copy it), evicting none of ``protect`` (the same prompt's
        other pages). ``digest``: the one the read verified for these bytes, where the source
        tier keeps digests (:class:`DigestedPageTier`; None where it does not)."""
        ...


@runtime_checkable
class DigestedPageTier(PageTier, Protocol):
    """A page tier whose reads say which bytes they returned (L3: the digest each page's read
    verified), so a mirror of it keeps a copy (prefetched or promoted after a restore) under
    the digest of the bytes it copied. A digest asked after the read could answer for bytes
    written since, and the mirror would then serve the old bytes as the new ones."""

    def fetch_digested(
        self, keys: Sequence[bytes], *, queued: bool = False
    ) -> list[tuple[Payload, bytes | None]]:
        """Written pages of the longest prefix of ``keys`` held, each with its read's digest;
        with ``queued``, what :meth:`fetch` serves (pages still waiting to be written too,
        those without a digest: None). Never raises."""
        ...


@dataclass(frozen=True)
class RemoteMatch:
    """What a remote tier holds of a prompt, from one lookup.

    Attributes:
        depth: how many of the prompt's leading aligned page keys it holds.
        children: the pages stored right after the deepest of them (or nothing when ``depth``
            is 0), as ``(page key, tokens as little-endian int32)``, authenticated: the page a
            record ended with (a prompt's tail) is found here, since it does not end on a page
            boundary and so has no aligned key.
    """

    depth: int
    children: tuple[tuple[bytes, bytes], ...] = ()


@runtime_checkable
class RemotePageTier(PageTier, Protocol):
    """A page tier behind a network round trip (the remote tier): the planner never walks it
    page by page; it asks once, for all of a prompt's aligned page keys, how deep it holds."""

    def match_path(self, keys: Sequence[bytes]) -> RemoteMatch:
        """How many leading ``keys`` (chain keys of aligned pages, page 0 first) are held, and
        the pages stored after the deepest of them."""
        ...


@dataclass(frozen=True)
class PathStep:
    """One stored page on a prompt's path through the page tree, of which ``used`` tokens match."""

    key: bytes
    parent: bytes
    n_tokens: int
    used: int
    #: the cheapest tier the walk found holding the page by key (None: found as a child)
    holder: str | None = None


@dataclass(frozen=True)
class PagePath:
    """The longest path of stored pages matching a prompt (metadata only, no payloads)."""

    steps: tuple[PathStep, ...]
    #: key of the node the path ends at (the parent of a page that would continue it)
    end: bytes

    @property
    def n_tokens(self) -> int:
        return sum(step.used for step in self.steps)


def best_child(
    children: Iterable[tuple[bytes, bytes]], parent: bytes, rest: Tokens
) -> PathStep | None:
    """The child of ``parent`` (``(key, tokens as <i4 bytes)``) that shares the most leading
    tokens with ``rest``, as a step using those tokens; None when none shares one."""
    best: PathStep | None = None
    for key, raw in children:
        child = np.frombuffer(raw, dtype="<i4")
        m = common_prefix(child, rest)
        if m > 0 and (best is None or m > best.used):
            best = PathStep(key, parent, len(child), m)
    return best


def walk(
    tiers: Sequence[PageTier],
    root: bytes,
    tokens: Tokens,
    limit: int,
    page_tokens: int,
    *,
    queued: bool = False,
) -> PagePath:
    """The longest path of pages any of ``tiers`` holds that matches ``tokens[:limit]``.

    Each step first tries the page a record would have cut at this position (one key test per
    tier); otherwise it compares the prompt with the tokens of the pages stored after this node
    and takes the longest match, possibly a prefix of a page: a prompt that branches off inside a
    page still reuses the tokens before the branch, and continues below that branch point.
    """
    p = page_tokens
    steps: list[PathStep] = []
    parent, pos = root, 0
    while pos < limit:
        n = p - pos % p
        if pos + n <= limit:
            key = chain_key(parent, tokens[pos : pos + n])
            holder = next((t for t in tiers if t.holds(key, queued=queued)), None)
            if holder is not None:
                steps.append(PathStep(key, parent, n, n, holder.name))
                parent, pos = key, pos + n
                continue
        rest = tokens[pos:limit]
        found = (pair for tier in tiers for pair in tier.children(parent, queued=queued))
        best = best_child(found, parent, rest)
        if best is None:
            break
        steps.append(best)
        end = best.key if best.used == best.n_tokens else chain_key(parent, rest[: best.used])
        parent, pos = end, pos + best.used
    return PagePath(tuple(steps), parent)
