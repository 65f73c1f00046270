"""Time the first token of a ``Llama.generate`` generator without changing what it yields."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

TokenGen = Generator[int, Sequence[int] | None, None]


def on_tokens(inner: TokenGen, callback: Callable[[int, int], None]) -> TokenGen:
    """Re-yield ``inner`` (forwarding ``send`` values), calling ``callback(i, token)`` as its
    ``i``-th token (from 0) arrives, before it is yielded.

    ``inner`` is closed when this generator is closed, so ``Llama.generate``'s cleanup runs when
    a caller stops early (stop sequence, ``max_tokens``).
    """
    i = 0
    sent: Sequence[int] | None = None
    try:
        while True:
            try:
                token = next(inner) if i == 0 else inner.send(sent)
            except StopIteration:
                return
            callback(i, token)
            i += 1
            sent = yield token
    finally:
        inner.close()


def on_first_token(inner: TokenGen, callback: Callable[[], None]) -> TokenGen:
    """:func:`on_tokens` calling ``callback`` at the first token only."""
    return on_tokens(inner, lambda i, _: callback() if i == 0 else None)
