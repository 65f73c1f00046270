"""Helpers for real-model integration tests."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import llama_cpp
import numpy as np

from skippy_llama.runtime.chat_head import chat_formatter

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had done before him. There were one hundred and twelve of them, worn smooth "
    "in the middle by generations of boots. At the top he trimmed the wick, polished the great "
    "lens until it shone, and wound the clockwork that turned the light. Ships far out at sea "
    "watched for its pulse: two long flashes and one short, the signature of this rock and no "
    "other. In storms the tower shook and the windows wept with spray, but the light never "
    "failed while he kept it. Between the rounds he wrote in the logbook: the wind, the swell, "
    "the vessels that passed, and once, in a careful hand, the night a whale surfaced so close "
    "to the rocks that he could hear it breathe. "
)


def aligned(llm: llama_cpp.Llama, n: int) -> int:
    """``n`` rounded down to the canonical batch boundary of ``llm`` (1 where reuse is
    token-granular: a SkippyLlama on the CPU with flash attention off, or a plain Llama)."""
    granule = int(getattr(llm, "granule", 1))
    return n - n % granule


def last_logits(llm: llama_cpp.Llama) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Logits of the last decoded token (copied)."""
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def cold_logits(cold: llama_cpp.Llama, prompt: list[int]) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Last-token logits of ``prompt`` prefilled from an empty context by the plain ``cold``."""
    cold.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(cold.ctx), True)
    cold.eval(prompt)
    return last_logits(cold)


class CountingLlama(llama_cpp.Llama):
    """Plain Llama that records how many prompt tokens each ``generate`` prefilled."""

    prefilled: list[int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefilled = []
        self._first_eval = False

    def generate(  # type: ignore[override]
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, Any, None]:
        self._first_eval = True
        return (yield from super().generate(tokens, *args, **kwargs))

    def eval(self, tokens: Sequence[int]) -> None:
        if self._first_eval:
            self.prefilled.append(len(tokens))
            self._first_eval = False
        super().eval(tokens)


#: Filler words, about one token each, that pad a prompt a token or two at a time.
_FILLER = [
    "so",
    "then",
    "he",
    "went",
    "up",
    "the",
    "stairs",
    "once",
    "more",
    "and",
    "looked",
    "out",
    "at",
    "the",
    "sea",
]


def short_of_a_boundary(
    llm: llama_cpp.Llama, build: Callable[[str], Any], granule: int, room: int
) -> Any:
    """``build(filler)`` for the shortest filler whose prompt ends at most ``room`` tokens
    before a multiple of ``granule``, so that a reply of more than ``room`` tokens crosses a
    canonical batch boundary (where reuse ends on them, a reply inside one granule is never
    repaired). ``build`` returns a prompt string or a list of chat messages; with a granule of
    1 the filler is empty."""
    filler: list[str] = []
    for _ in range(2 * granule + len(_FILLER)):
        built = build(" ".join(filler))
        n = prompt_tokens(llm, built)
        if granule - n % granule <= room:
            return built
        filler.append(_FILLER[len(filler) % len(_FILLER)])
    raise AssertionError(f"no filler brings the prompt within {room} tokens of a boundary")


def prompt_tokens(llm: llama_cpp.Llama, prompt: str | list[Any]) -> int:
    """Tokens ``llm`` prefills for a completion prompt, or for chat messages rendered by the
    model's own template as ``create_chat_completion`` renders them (with the assistant's turn)."""
    if isinstance(prompt, str):
        return len(llm.tokenize(prompt.encode()))
    formatter = chat_formatter(llm)
    assert formatter is not None, "the model has no GGUF chat template"
    rendered = formatter(messages=prompt)
    return len(
        llm.tokenize(rendered.prompt.encode(), add_bos=not rendered.added_special, special=True)
    )
