"""Building ``Llama``'s one context with the sequences the cache needs.

``llama_cpp.Llama.__init__`` offers no ``n_seq_max``/``kv_unified``; building its context and
then a second one would double load time and peak memory. :class:`_HookedContext` lets
``SkippyLlama`` adjust the parameters of the context it builds; the adjustment is thread-local
and set only inside ``SkippyLlama.__init__`` (:func:`adjusted`), so every other context is
built exactly as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import llama_cpp
import llama_cpp._internals as internals

_context_hook = threading.local()


def sequence_count(needed: int) -> int:
    """``n_seq_max`` for a context that uses ``needed`` sequence ids: the next power of two.

    On the CPU build a prefill ran 6-7 % slower in a unified context of 3, 5 or 6 sequences than
    in one of 1, 2, 4 or 8 (500-token prompts, SmolLM2, 2 cores, 20-30 paired runs each); the
    unused ids cost a logits row each in llama.cpp's output buffer and nothing else.
    """
    return 1 << max(needed - 1, 0).bit_length()


class _HookedContext(internals.LlamaContext):  # type: ignore[misc]
    """``LlamaContext`` whose parameters ``SkippyLlama`` may adjust (see the module docstring)."""

    def __init__(self, *, model: Any, params: Any, verbose: bool = True) -> None:
        adjust = getattr(_context_hook, "adjust", None)
        if adjust is not None:
            adjust(params, model)
        super().__init__(model=model, params=params, verbose=verbose)


if not issubclass(internals.LlamaContext, _HookedContext):
    internals.LlamaContext = _HookedContext  # type: ignore[misc]


@contextlib.contextmanager
def adjusted(n_seq_max: int) -> Iterator[None]:
    """Contexts built inside get ``n_seq_max`` sequences in one unified KV cache, except for
    recurrent and hybrid models: the paged cache refuses them and their restore points live in
    sequence 0 alone, so their context is plain ``Llama``'s own (one sequence). Served from
    restore points or as plain ``Llama``, they must answer as a cold plain ``Llama`` does, and
    on a GPU a context of eight unified sequences need not: a hybrid's logits there differed
    from a cold plain ``Llama``'s by ~1e-4 with restore points off (H100, session 48,
    ``benchmarks/results/gpu-logs/s48-h100/points_tests_ngl-1_lane1.log``)."""

    def adjust(params: Any, model: Any) -> None:
        if n_seq_max <= 1 or params.embeddings:
            return  # embedding contexts keep llama-cpp-python's own multi-sequence setup
        handle = getattr(model, "model", None)
        if handle is not None and (
            llama_cpp.llama_model_is_recurrent(handle) or llama_cpp.llama_model_is_hybrid(handle)
        ):
            return
        params.n_seq_max = n_seq_max
        # one unified cache: the working sequence sits in cells [0, n) as in plain Llama,
        # and sharing cells with a scratch sequence copies nothing
        params.kv_unified = True

    _context_hook.adjust = adjust
    try:
        yield
    finally:
        _context_hook.adjust = None
