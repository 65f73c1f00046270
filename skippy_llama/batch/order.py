"""The order a batch runs in: a pre-order walk of the token trie of its prompts.

Sorting token sequences lexicographically is that walk (a prefix comes before its extensions,
siblings in token order), and it maximizes the prefix each prompt shares with the one run
before it, which is what the resident L1 prefixes reuse. The order of a subset is the full
order with the other items left out, so a resumed batch runs its remaining items in the order
an uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Sequence


def prefix_order(keys: Sequence[Sequence[int]]) -> list[int]:
    """Indices of ``keys`` in trie pre-order; equal keys keep their input order."""
    return sorted(range(len(keys)), key=lambda i: (tuple(keys[i]), i))
