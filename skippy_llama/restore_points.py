"""Restore points: whole-sequence states of recurrent and hybrid models at prompt ends.

A recurrent layer (Mamba, Gated DeltaNet, a short convolution) keeps one state per sequence, for
the position the sequence is at, so a prefix of such a model can be restored only where its state
was captured (DESIGN.md section 13, issue 46). This first step keeps the whole sequence state
(``llama_state_seq_get_data``: attention cells and recurrent state together) at the end of each
prompt, where a chat's next turn or the next question on a shared document continues. A later
prompt that extends a stored point's tokens restores the deepest one and decodes only the rest.

The store is pure bookkeeping (no llama.cpp): points are keyed by the chain key of their tokens
(:func:`skippy_llama.identity.chain_key` from the cache identity's root), and evicted least
recently used first to stay within a byte budget.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .identity import chain_key

#: Bytes all restore points of one model may hold by default (host RAM).
DEFAULT_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class RestorePoint:
    """The whole state of a sequence holding exactly ``tokens``."""

    tokens: npt.NDArray[np.int32]
    blob: bytes

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class RestorePointStore:
    """Restore points keyed by the chain key of their tokens, LRU within ``max_bytes``.

    Example:
        >>> store = RestorePointStore(root=b"model", max_bytes=1 << 20)
        >>> store.put([1, 2, 3], b"state")
        True
        >>> store.best([1, 2, 3, 4]).n_tokens
        3
    """

    def __init__(self, root: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._points: OrderedDict[bytes, RestorePoint] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # stored points per token count
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._points)

    def _key(self, tokens: npt.NDArray[np.int32]) -> bytes:
        return chain_key(self.root, tokens)

    def put(self, tokens: Sequence[int] | npt.NDArray[np.integer[Any]], blob: bytes) -> bool:
        """Keep ``blob`` as the state after ``tokens``; False when it exceeds the whole budget.

        A point already stored for the same tokens is replaced; older points are evicted until
        the new one fits.
        """
        arr = np.array(tokens, dtype=np.int32)
        if len(arr) == 0 or len(blob) > self.max_bytes:
            return False
        key = self._key(arr)
        self._drop(key)
        while self._points and self.bytes + len(blob) > self.max_bytes:
            self._drop(next(iter(self._points)))
        self._points[key] = RestorePoint(arr, blob)
        self._lengths[len(arr)] += 1
        self.bytes += len(blob)
        return True

    def best(self, prompt: Sequence[int] | npt.NDArray[np.integer[Any]]) -> RestorePoint | None:
        """The deepest stored point whose tokens are a proper prefix of ``prompt`` (at least one
        prompt token is left to decode, whose logits sampling needs); marks it recently used."""
        arr = np.asarray(prompt, dtype=np.int32)
        for n in sorted((n for n in self._lengths if n < len(arr)), reverse=True):
            key = self._key(arr[:n])
            point = self._points.get(key)
            # the tokens are compared too: a key collision must be a miss, never a wrong state
            if point is not None and np.array_equal(point.tokens, arr[:n]):
                self._points.move_to_end(key)
                return point
        return None

    def clear(self) -> None:
        """Drop every point."""
        self._points.clear()
        self._lengths.clear()
        self.bytes = 0

    def _drop(self, key: bytes) -> None:
        point = self._points.pop(key, None)
        if point is None:
            return
        self.bytes -= len(point.blob)
        self._lengths[point.n_tokens] -= 1
        if self._lengths[point.n_tokens] == 0:
            del self._lengths[point.n_tokens]
