"""L1 policy: which prefixes stay resident as device checkpoints of the live context.

Pure bookkeeping, no llama.cpp: the runtime asks this index which checkpoint slot holds a prompt's
longest resident prefix and which slots to drop or fill, then makes the checkpoint calls itself
and hands back an opaque handle (the checkpoint's cell metadata) to keep with the entry. Entries are found by walking the prompt's page-key chain (full pages) and then comparing tokens
inside the entries that hold the last matched page, so a lookup costs O(pages) whatever the
entry count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..identity import chain_key, page_keys
from .base import ParkPlan, ResidentMatch, common_prefix

__all__ = ["ResidentEntry", "ResidentIndex", "ResidentStatus", "common_prefix"]

Tokens = npt.NDArray[np.int32]


@dataclass
class ResidentEntry:
    """One prefix checkpointed in slot ``seq_id``: its tokens, every key that reaches into it,
    and the runtime's handle to restore it."""

    seq_id: int
    tokens: Tokens
    page_keys: list[bytes]
    handle: bytes = b""
    pins: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ResidentStatus:
    """L1's budget and usage, in tokens."""

    enabled: bool
    prefixes: int
    tokens: int
    budget_tokens: int
    max_prefixes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ResidentIndex:
    """L1 (a :class:`~skippy_llama.tiers.base.ResidentTier`): LRU index of resident prefixes
    with pins and a resident-token budget.

    The budget is charged by each entry's full length: every checkpoint holds its own copy of
    its cells, so this is exactly the memory the checkpoints take.
    """

    def __init__(
        self, seq_ids: Sequence[int], budget_tokens: int, page_tokens: int, *, window: int = 0
    ) -> None:
        self._free = list(seq_ids)
        #: the sliding-window size of SWA models (0: none). A checkpoint of such a model holds
        #: only the last ``window`` cells of its sliding-window layers (llama.cpp writes no masked
        #: cell), so one longer than the window is exact only at its full length: cut shorter,
        #: the window before the cut is missing (measured on Gemma 3 270M: logits off by 9.0).
        self.window = window
        self._entries: OrderedDict[int, ResidentEntry] = OrderedDict()
        self._by_page: dict[bytes, set[int]] = {}
        self.budget_tokens = budget_tokens
        self.page_tokens = page_tokens
        self.max_prefixes = len(self._free)

    name = "l1"

    @property
    def used_tokens(self) -> int:
        return sum(e.n_tokens for e in self._entries.values())

    def entries(self) -> list[ResidentEntry]:
        """Entries from least to most recently used."""
        return list(self._entries.values())

    def match(self, root: bytes, tokens: Tokens, limit: int) -> ResidentMatch | None:
        """Longest resident prefix of ``tokens[:limit]`` (no side effects).

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
        best: ResidentMatch | None = None
        for seq_id in holders:
            entry = self._entries[seq_id]
            n = matched + common_prefix(tokens[matched:limit], entry.tokens[matched:])
            if self.window and entry.n_tokens > self.window and n < entry.n_tokens:
                continue  # the cut prefix's sliding window is not in the checkpoint
            if n > 0 and (best is None or n > best.n_tokens):
                best = ResidentMatch(seq_id, n, entry.handle)
        return best

    def touch(self, seq_id: int) -> None:
        """``seq_id`` served a request: it becomes the most recently used."""
        if seq_id in self._entries:
            self._entries.move_to_end(seq_id)

    def entry(self, seq_id: int) -> ResidentEntry:
        return self._entries[seq_id]

    def plan_park(self, root: bytes, tokens: Tokens) -> ParkPlan | None:
        """Choose a slot for a new prefix, evicting LRU unpinned entries as needed.

        ``root`` is not needed here (entries are keyed when committed). Entries that are a
        prefix of the new one are superseded (it covers them). Returns ``None``
        when an entry already holds the whole prefix (it becomes the most recently used), when
        nothing can be freed (everything pinned) or when the prefix is empty.
        """
        n = min(len(tokens), self.budget_tokens)
        n -= n % self.page_tokens if n < len(tokens) else 0
        if n <= 0:
            return None
        for e in self._entries.values():
            if e.n_tokens >= n and np.array_equal(e.tokens[:n], tokens[:n]):
                self._entries.move_to_end(e.seq_id)
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

    def commit_park(self, plan: ParkPlan, root: bytes, tokens: Tokens, handle: bytes) -> None:
        """Record that ``plan`` was carried out: ``tokens[:n]`` now in slot ``seq_id``."""
        self.abandon_park(plan)
        self._free.remove(plan.seq_id)
        body = np.array(tokens[: plan.n_tokens], dtype=np.int32)
        keys = page_keys(root, body, self.page_tokens)
        entry = ResidentEntry(plan.seq_id, body, keys, handle)
        self._entries[plan.seq_id] = entry
        for key in keys:
            self._by_page.setdefault(key, set()).add(plan.seq_id)

    def abandon_park(self, plan: ParkPlan) -> None:
        """Forget every entry ``plan`` touches: their slots were (or may have been) overwritten."""
        for seq_id in (*plan.evict, plan.seq_id):
            self.remove(seq_id)

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

    def status(self) -> ResidentStatus:
        """Prefixes, tokens and budget."""
        return ResidentStatus(
            True, len(self._entries), self.used_tokens, self.budget_tokens, self.max_prefixes
        )

    def close(self) -> None:
        """Nothing to release: the checkpoints belong to the context."""

    def clear(self) -> list[int]:
        """Forget every entry; returns the sequence ids the runtime must clear."""
        ids = list(self._entries)
        for seq_id in ids:
            self.remove(seq_id)
        return ids
