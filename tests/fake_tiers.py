"""A page tier over a dict, the one fake the tests use where a page tier is needed without a
store behind it (the planner's, the page source's and the tier protocol's tests): it does what
the page-tier protocol (``skippy_llama.tiers.base.PageTier``) asks, and nothing more."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from skippy_llama.identity import page_keys
from skippy_llama.tiers.records import PrefixRecord

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; the tests also run on 3.10


def holding(keys: Sequence[bytes]) -> dict[bytes, bytes | memoryview]:
    """Pages for :class:`DictPages` whose payloads are their keys (for tests that plan)."""
    return {key: key for key in keys}


@dataclass
class DictStatus:
    """A fake tier's status: its name, the pages it holds and the fetches it served."""

    name: str
    pages: int = 0
    fetches: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "pages": self.pages, "fetches": self.fetches}


@dataclass
class DictPages:
    """Pages in a dict (key -> payload), written at once when offered; promotions into it are
    recorded (``promoted``), and ``fetches`` counts the fetches asked of it.

    :meth:`hold` puts the aligned pages of some tokens under ``root`` (a cache identity) with
    their keys as payloads, for tests that plan without page bytes.
    """

    name: str = "memory"
    pages: dict[bytes, bytes | memoryview] = field(default_factory=dict)
    takes_records: bool = True
    in_memory: bool = False
    serving: bool = True
    root: bytes = b"r" * 16
    page_tokens: int = 64
    #: the pages stored after each node (offered records): parent -> [(key, tokens as <i4)]
    index: dict[bytes, list[tuple[bytes, bytes]]] = field(default_factory=dict)
    promoted: list[tuple[bytes, int]] = field(default_factory=list)
    fetches: int = 0

    def hold(self, tokens: np.ndarray) -> Self:
        """Hold the aligned pages of ``tokens`` (each page's payload is its key)."""
        self.pages.update(holding(page_keys(self.root, tokens, self.page_tokens)))
        return self

    def holds(self, key: bytes, *, queued: bool = False) -> bool:
        return key in self.pages

    def children(self, parent: bytes, *, queued: bool = False) -> list[tuple[bytes, bytes]]:
        return list(self.index.get(parent, ()))

    def fetch(self, keys: Sequence[bytes]) -> list[bytes | memoryview]:
        self.fetches += 1
        out: list[bytes | memoryview] = []
        for key in keys:
            if key not in self.pages:
                break
            out.append(self.pages[key])
        return out

    def offer(self, record: PrefixRecord) -> bool:
        try:
            for page in record.pages:
                if page.payload is not None and page.key not in self.pages:
                    self.pages[page.key] = page.data
                    self.index.setdefault(page.parent, []).append((page.key, page.tokens))
        finally:
            record.drop()
        return True

    def promote(
        self, key: bytes, payload: bytes | memoryview, prefix_tokens: int, digest: bytes | None
    ) -> None:
        self.promoted.append((key, prefix_tokens))

    def note_miss(self) -> None:
        pass

    def status(self) -> DictStatus:
        return DictStatus(self.name, len(self.pages), self.fetches)

    def clear(self) -> None:
        self.pages.clear()
        self.index.clear()

    def close(self) -> None:
        pass
