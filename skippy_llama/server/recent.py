"""The conversations a server served last, as tokens: the ones likely to come back next.

After each request the model thread notes the tokens its working sequence holds (the prompt
and the reply). A chat's next turn extends them, so a conversation that continues one noted
before replaces it; a conversation is one entry however many turns it took. The idle work
(:mod:`.idle`) prefetches the most recent of them that are no longer resident.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import numpy.typing as npt

Tokens = npt.NDArray[np.int32]

#: Conversations remembered (a few more than the idle work prefetches in one gap).
CAPACITY = 16


class RecentConversations:
    """The token sequences of the latest conversations, most recent first (thread-safe)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._items: deque[Tokens] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, tokens: Tokens) -> None:
        """Note a served conversation, first; it replaces one it continues or repeats (the
        longer of the two is kept)."""
        if len(tokens) == 0:
            return
        tokens = np.array(tokens, dtype=np.int32)  # a copy: the caller's buffer changes
        with self._lock:
            kept = []
            for old in self._items:
                if _same_conversation(old, tokens):
                    tokens = old if len(old) > len(tokens) else tokens  # the longer one
                else:
                    kept.append(old)
            self._items.clear()
            self._items.append(tokens)
            self._items.extend(kept[: (self._items.maxlen or 1) - 1])

    def latest(self, n: int) -> list[Tokens]:
        """Up to ``n`` conversations, most recent first."""
        with self._lock:
            return list(self._items)[:n]

    def __len__(self) -> int:
        return len(self._items)


def _same_conversation(a: Tokens, b: Tokens) -> bool:
    """One is a prefix of the other (a later turn, or a repeat of an earlier one)."""
    m = min(len(a), len(b))
    return bool(np.array_equal(a[:m], b[:m]))
