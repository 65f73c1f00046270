"""Which prefixes left the live sequence, and whether a later prompt came back to them (pure).

A park is insurance on a prefix the next prompt destroys; it is worth its cost only as often
as such prefixes return. :class:`Departures` sees every prompt once (``PrefixCache.commit``),
parked or not, so it measures returns even while no park is taken: a prompt that destroys a
page or more of the live sequence is a *departure* of those tokens; a later prompt that shares
at least a page more with a departed prefix than with the live sequence it meets is that
prefix's *return* (each departure returns once). The counts feed the cost model's
``reuse_probability`` (:meth:`~skippy_llama.costs.CostModel.observe_departure`), which the
planner's park rule weighs: one-shot prompts stop paying for parks that never serve (issue 45:
1.71x plain ``Llama`` on an H100 with flash attention off), two chats taking turns keep them.

Only the recent departures are remembered (``MAX_DEPARTED``, token arrays, a few KB each).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .tiers.base import common_prefix

Tokens = npt.NDArray[np.int32]

#: Departed prefixes remembered: a prefix that returns after this many others left is not seen.
MAX_DEPARTED = 16


@dataclass(frozen=True)
class Seen:
    """What one prompt did: ``departed`` a page or more of the live sequence, ``returned`` to
    a prefix that had departed."""

    departed: bool
    returned: bool


class Departures:
    """Recent departures from the live sequence and their returns (see the module docstring).

    Args:
        page_tokens: the least a prefix must lose to depart, and a prompt must regain to return.
        keep: departed prefixes remembered.
    """

    def __init__(self, page_tokens: int, keep: int = MAX_DEPARTED) -> None:
        self.page_tokens = max(1, page_tokens)
        self._left: deque[Tokens] = deque(maxlen=max(1, keep))

    def __len__(self) -> int:
        return len(self._left)

    def observe(self, tokens: Tokens, live: Tokens) -> Seen:
        """A prompt of ``tokens`` met the live sequence's exact ``live`` tokens."""
        shared = common_prefix(live, tokens)
        returned = False
        for i, gone in enumerate(self._left):
            if common_prefix(gone, tokens) - shared >= self.page_tokens:
                del self._left[i]  # it returned: a departure is counted back once
                returned = True
                break
        departed = len(live) - shared >= self.page_tokens
        if departed:
            self._left.append(np.array(live, dtype=np.int32))
        return Seen(departed, returned)
