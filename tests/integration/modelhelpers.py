"""Helpers for real-model integration tests."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from skippy_llama.config import Settings
from skippy_llama.costs import AlwaysRestore
from skippy_llama.events import CacheEvent
from skippy_llama.runtime.chat_head import chat_formatter
from skippy_llama.runtime.llama import SkippyLlama

Logits = np.ndarray[Any, np.dtype[np.float32]]

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


def last_logits(llm: llama_cpp.Llama) -> Logits:
    """Logits of the last decoded token (copied)."""
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def cold_logits(cold: llama_cpp.Llama, prompt: list[int]) -> Logits:
    """Last-token logits of ``prompt`` prefilled from an empty context by the plain ``cold``."""
    cold.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(cold.ctx), True)
    cold.eval(prompt)
    return last_logits(cold)


def text_tokens(path: Path, n: int, repeats: int = 4) -> list[int]:
    """The first ``n`` tokens of ``TEXT`` repeated ``repeats`` times, by the model's vocabulary."""
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize((TEXT * repeats).encode())[:n]
    finally:
        llm.close()


def prefill_logits(
    path: Path, tokens: list[int], *, n_ctx: int, flash_attn: bool = False
) -> Logits:
    """The last logits of a one-shot prefill of ``tokens`` on a fresh plain ``Llama``."""
    plain = llama_cpp.Llama(
        str(path), n_ctx=n_ctx, n_batch=512, flash_attn=flash_attn, verbose=False
    )
    try:
        plain.eval(tokens)
        return last_logits(plain)
    finally:
        plain.close()


def tiered_llama(
    path: Path,
    store: Path,
    *,
    n_ctx: int,
    flash_attn: bool = False,
    l2_budget: str | None = None,
    l1: bool = False,
) -> SkippyLlama:
    """SkippyLlama with L1 off (unless ``l1``), an L3 in ``store``, L2 only given
    ``l2_budget``, and every restore taken (``AlwaysRestore``), so that a test sees the page
    tiers serve."""
    settings = Settings(
        l1={"enabled": l1},
        l2={"budget": l2_budget} if l2_budget is not None else {},
        l3={"mode": "fixed", "budget": "1GiB", "directory": str(store), "minimum_free": "1GiB"},
    )
    return SkippyLlama(
        str(path),
        n_ctx=n_ctx,
        n_batch=512,
        flash_attn=flash_attn,
        verbose=False,
        cache_settings=settings,
        cost_model=AlwaysRestore(),
    )


def serve(llm: SkippyLlama, prompt: list[int], cold: Logits) -> tuple[CacheEvent, bool]:
    """Serve ``prompt`` from an empty working sequence: its cache event and whether its last
    logits equal ``cold``."""
    llm.reset()
    llm.eval(prompt)
    event = llm.last_cache_event
    assert event is not None
    return event, bool((last_logits(llm) == cold).all())


def serve_until(
    llm: SkippyLlama, prompt: list[int], cold: Logits, tier: str, times: int, tries: int
) -> tuple[list[CacheEvent], list[bool]]:
    """:func:`serve` ``prompt`` until ``tier`` has served it ``times`` times or ``tries``
    requests have run (L3 serves until its second fill promotes the pages into L2); each
    request's cache event and whether its last logits equal ``cold``."""
    events: list[CacheEvent] = []
    exact: list[bool] = []
    while sum(e.tier == tier for e in events) < times and len(events) < tries:
        event, same = serve(llm, prompt, cold)
        events.append(event)
        exact.append(same)
    return events, exact


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
