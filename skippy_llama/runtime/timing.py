"""Time the first token of a ``Llama.generate`` generator without changing what it yields."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

TokenGen = Generator[int, Sequence[int] | None, None]


def on_first_token(inner: TokenGen, callback: Callable[[], None]) -> TokenGen:
    """Re-yield ``inner`` (forwarding ``send`` values), calling ``callback`` at its first token.

    ``inner`` is closed when this generator is closed, so ``Llama.generate``'s cleanup runs when
    a caller stops early (stop sequence, ``max_tokens``).
    """
    first = True
    sent: Sequence[int] | None = None
    try:
        while True:
            try:
                token = next(inner) if first else inner.send(sent)
            except StopIteration:
                return
            if first:
                first = False
                callback()
            sent = yield token
    finally:
        inner.close()
