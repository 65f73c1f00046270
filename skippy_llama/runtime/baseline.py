"""The baselines SkippyLlama is compared with: plain ``llama_cpp.Llama``, and the same with a cold
prefill per request (what ``run`` and ``matrix`` compare to)."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import Any

import llama_cpp

from ..events import CacheEvent
from .timing import on_first_token


class ColdLlama(llama_cpp.Llama):
    """``llama_cpp.Llama`` that forgets its KV state before every prompt and times the first token.

    ``last_cache_event`` is filled the same way ``SkippyLlama`` fills it (tier ``cold``), so both
    can be reported side by side.
    """

    last_cache_event: CacheEvent | None = None

    def generate(  # type: ignore[override]
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, Sequence[int] | None, None]:
        self.reset()  # type: ignore[no-untyped-call]
        event = CacheEvent(prompt_tokens=len(tokens), suffix_tokens=len(tokens))
        started = time.perf_counter()

        def first() -> None:
            event.ttft_ms = event.prefill_ms = (time.perf_counter() - started) * 1e3
            self.last_cache_event = event

        yield from on_first_token(super().generate(tokens, *args, **kwargs), first)


class PlainLlama(llama_cpp.Llama):
    """Unmodified ``llama_cpp.Llama`` (it reuses the prefix live in its context, as users see it),
    named here so the user surfaces above ``runtime/`` need not import ``llama_cpp``."""
