"""Per-request timing shared by every side of the matrix: TTFT and the gap between tokens.

The same wrapper goes around ``SkippyLlama``, the cold baseline and plain ``Llama``, so each side
is measured at the same point: from the first step of ``generate`` (lookup, restore and prefill
inside) to each token it yields.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from ..runtime import native
from ..runtime.timing import on_tokens

T = TypeVar("T")


@dataclass
class Timing:
    """One ``generate`` call: time to the first token, then the gap before each later token."""

    prompt_tokens: int = 0
    ttft_ms: float = 0.0
    token_ms: list[float] = field(default_factory=list)
    #: logits of the last prompt token (only when the instance was asked to keep them)
    logits: npt.NDArray[np.float32] | None = None


def timed(base: type[T]) -> type[T]:
    """``base`` (a ``llama_cpp.Llama`` subclass) whose ``generate`` leaves a :class:`Timing` in
    ``matrix_timing``; with ``matrix_keep_logits`` set it also copies the prompt's last logits
    as the first token is yielded (the last decode then was the prompt's)."""

    class Timed(base):  # type: ignore[valid-type,misc]
        matrix_timing: Timing | None = None
        matrix_keep_logits: bool = False

        def generate(
            self, tokens: Sequence[int], *args: Any, **kwargs: Any
        ) -> Generator[int, Sequence[int] | None, None]:
            timing = Timing(prompt_tokens=len(tokens))
            self.matrix_timing = timing
            started = last = time.perf_counter()

            def tick(i: int, _token: int) -> None:
                nonlocal last
                now = time.perf_counter()
                if i == 0:
                    timing.ttft_ms = (now - started) * 1e3
                    if self.matrix_keep_logits:
                        timing.logits = native.last_logits(self.ctx, self.n_vocab())
                else:
                    timing.token_ms.append((now - last) * 1e3)
                last = now

            return (yield from on_tokens(super().generate(tokens, *args, **kwargs), tick))

    Timed.__name__ = Timed.__qualname__ = f"Timed{base.__name__}"
    return Timed  # type: ignore[return-value]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), None for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))
