"""L1 policy: which prefixes stay resident in spare sequence ids of the live context.

Pure bookkeeping, no llama.cpp: the runtime asks this index where a prompt's longest resident
prefix lives and which sequence ids to drop or fill, then performs the ``seq_cp``/``seq_rm`` calls
itself. Entries are found by walking the prompt's page-key chain (full pages) and then comparing tokens
inside the entries that hold the last matched page, so a lookup costs O(pages) whatever the
entry count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..identity import chain_key, page_keys

Tokens = npt.NDArray[np.int32]


def common_prefix(a: Tokens, b: Tokens) -> int:
    """Length of the common prefix of two token arrays."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


@dataclass
class ResidentEntry:
    """One prefix parked in sequence ``seq_id``: its tokens and every key that reaches into it."""

    seq_id: int
    tokens: Tokens
    page_keys: list[bytes]
    pins: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ResidentHit:
    """The longest resident prefix of a prompt: copy ``n_tokens`` cells from ``seq_id``."""

    seq_id: int
    n_tokens: int


@dataclass(frozen=True)
class ParkPlan:
    """What the runtime must do to park a prefix: drop ``evict`` sequences, then fill ``seq_id``."""

    seq_id: int
    n_tokens: int
    evict: tuple[int, ...] = field(default_factory=tuple)


class ResidentIndex:
    """LRU index of resident prefixes with pins and a resident-token budget.

    The budget is charged by each entry's full length, an upper bound on the distinct cells it
    holds (entries that share cells are charged twice), so the context never runs out of cells.
    """

    def __init__(self, seq_ids: Sequence[int], budget_tokens: int, page_tokens: int) -> None:
        self._free = list(seq_ids)
        self._entries: OrderedDict[int, ResidentEntry] = OrderedDict()
        self._by_page: dict[bytes, set[int]] = {}
        self.budget_tokens = budget_tokens
        self.page_tokens = page_tokens

    @property
    def used_tokens(self) -> int:
        return sum(e.n_tokens for e in self._entries.values())

    def entries(self) -> list[ResidentEntry]:
        """Entries from least to most recently used."""
        return list(self._entries.values())

    def lookup(self, root: bytes, tokens: Tokens, limit: int) -> ResidentHit | None:
        """Longest resident prefix of ``tokens[:limit]``.

        Walks the page-key chain from ``root`` over full pages, then extends token by token into
        the entries that hold the last matched page: a resident copy of cells ``[0, m)`` is exact
        for any ``m`` up to where the tokens differ, so no partial page is wasted.
        """
        p = self.page_tokens
        parent, matched = root, 0
        holders: set[int] = set(self._entries)
        while matched + p <= limit:
            key = chain_key(parent, tokens[matched : matched + p])
            found = self._by_page.get(key)
            if not found:
                break
            parent, matched, holders = key, matched + p, found
        best: ResidentHit | None = None
        for seq_id in holders:
            entry = self._entries[seq_id]
            n = matched + common_prefix(tokens[matched:limit], entry.tokens[matched:])
            if n > 0 and (best is None or n > best.n_tokens):
                best = ResidentHit(seq_id, n)
        if best is not None:
            self._entries.move_to_end(best.seq_id)
        return best

    def plan_park(self, tokens: Tokens) -> ParkPlan | None:
        """Choose a sequence id for a new prefix, evicting LRU unpinned entries as needed.

        Entries that are a prefix of the new one are superseded (it covers them). Returns ``None``
        when nothing can be freed (everything pinned) or the prefix is empty.
        """
        n = min(len(tokens), self.budget_tokens)
        n -= n % self.page_tokens if n < len(tokens) else 0
        if n <= 0:
            return None
        evict = [
            e.seq_id
            for e in self._entries.values()
            if e.pins == 0 and e.n_tokens <= n and np.array_equal(e.tokens, tokens[: e.n_tokens])
        ]
        used = self.used_tokens - sum(self._entries[s].n_tokens for s in evict)
        free = len(self._free) + len(evict)
        for e in self._entries.values():
            if used + n <= self.budget_tokens and free > 0:
                break
            if e.pins == 0 and e.seq_id not in evict:
                evict.append(e.seq_id)
                used -= e.n_tokens
                free += 1
        if used + n > self.budget_tokens or free == 0:
            return None
        seq_id = evict[0] if not self._free else self._free[0]
        return ParkPlan(seq_id=seq_id, n_tokens=n, evict=tuple(evict))

    def commit_park(self, plan: ParkPlan, root: bytes, tokens: Tokens) -> None:
        """Record that ``plan`` was carried out: evictions done, ``tokens[:n]`` now in ``seq_id``."""
        for seq_id in plan.evict:
            self.remove(seq_id)
        if plan.seq_id in self._free:
            self._free.remove(plan.seq_id)
        body = np.array(tokens[: plan.n_tokens], dtype=np.int32)
        keys = page_keys(root, body, self.page_tokens)
        entry = ResidentEntry(plan.seq_id, body, keys)
        self._entries[plan.seq_id] = entry
        for key in keys:
            self._by_page.setdefault(key, set()).add(plan.seq_id)

    def remove(self, seq_id: int) -> None:
        """Forget the entry in ``seq_id`` (the runtime has removed or will remove its cells)."""
        entry = self._entries.pop(seq_id, None)
        if entry is None:
            return
        for key in entry.page_keys:
            holders = self._by_page.get(key)
            if holders is not None:
                holders.discard(seq_id)
                if not holders:
                    del self._by_page[key]
        self._free.append(seq_id)

    def pin(self, seq_id: int) -> None:
        self._entries[seq_id].pins += 1

    def unpin(self, seq_id: int) -> None:
        entry = self._entries.get(seq_id)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def clear(self) -> list[int]:
        """Forget every entry; returns the sequence ids the runtime must clear."""
        ids = list(self._entries)
        for seq_id in ids:
            self.remove(seq_id)
        return ids
