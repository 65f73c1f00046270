"""The remote tier under the page-tier protocol (``tiers/base.py``), for one cache identity.

Reads: the planner asks :meth:`RemoteTier.match_path` once per prompt that the local tiers do
not cover (one pipelined round trip for all of the prompt's aligned page keys), never a round
trip per page; :meth:`RemoteTier.fetch` brings the chosen pages in pipelined batches, each
verified. Writes: L3's background writer calls :meth:`RemoteTier.push` after L3 stored a record
(``DiskTier.add_write_listener``), so nothing is sent on the request path; the runtime's records
are never offered here directly. Pages a remote hit brought are stored in L3 by the runtime's
usual record of the request (what L3 lacks is captured and written).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..base import RemoteMatch
from ..records import PrefixRecord
from .store import RemoteStore


@dataclass(frozen=True)
class RemoteStatus:
    """The remote tier's state and this process's counters (no server call)."""

    body: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return dict(self.body)


class RemoteTier:
    """:class:`~.store.RemoteStore` as a page tier of the cache identity ``root``.

    Args:
        store: the connected store client.
        root: the cache identity root its keys live under.
        load: the verified bytes of a page L3 holds (for records that reuse pages the server
            lacks), or None.
        page_tokens: tokens per page; a page of fewer (a record's tail, or a page after a
            branch point) is entered in its parent's child index when pushed, so a match finds
            it though no aligned key names it.
    """

    name = "remote"
    takes_records = False
    in_memory = False

    def __init__(
        self,
        store: RemoteStore,
        root: bytes,
        load: Callable[[bytes], bytes | None] | None = None,
        page_tokens: int = 128,
    ) -> None:
        self.store = store
        self.root = root
        self._load = load
        self.page_tokens = page_tokens

    @property
    def serving(self) -> bool:
        return self.store.available

    def holds(self, key: bytes, *, queued: bool = False) -> bool:
        return False  # found by match_path, once per prompt: a round trip per page would cost

    def children(self, parent: bytes, *, queued: bool = False) -> list[tuple[bytes, bytes]]:
        return []  # the server holds aligned pages by key; branch points are L3's

    def match_path(self, keys: Sequence[bytes]) -> RemoteMatch:
        """How many leading ``keys`` (a prompt's aligned page keys) the server holds, and the
        pages indexed after the deepest of them."""
        return self.store.match(self.root, keys)

    def fetch(self, keys: Sequence[bytes]) -> list[bytes | memoryview]:
        return list(self.store.fetch(keys, root=self.root))

    def offer(self, record: PrefixRecord) -> bool:
        record.drop()  # never offered (takes_records is False)
        return False

    def promote(
        self, key: bytes, payload: bytes | memoryview, prefix_tokens: int, digest: bytes | None
    ) -> None:
        """Nothing is promoted into the remote tier: it is the deepest."""

    def note_miss(self) -> None:
        """Misses are counted by :meth:`RemoteStore.match`."""

    def push(self, record: PrefixRecord, stored: Mapping[bytes, bytes]) -> None:
        """Send a record L3 just stored (from L3's writer thread; see the module docstring)."""
        if record.cache_identity == self.root.hex():
            short = [page.key for page in record.pages if page.n_tokens < self.page_tokens]
            self.store.push(record, stored=stored, load=self._load, index=short)

    def status(self) -> RemoteStatus:
        return RemoteStatus(self.store.status())

    def clear(self) -> dict[str, Any]:
        """Delete this cache identity's keys on the server (other identities' stay)."""
        return self.store.clear(self.root.hex())

    def close(self) -> None:
        self.store.close()
