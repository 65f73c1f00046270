"""Restore points on the request path of recurrent and hybrid models (issue 46, first step).

Paged prefixes are refused for these models (``identity.paging_refusal``): a prefix of cells is not
a prefix of their state. What is exact instead is a whole-sequence state captured where a prompt
ended: :mod:`skippy_llama.runtime.restore_probe` found a restore of it, followed by the rest of a
longer prompt decoded as a batch, bit-identical to a cold prefill for Mamba2, Gated DeltaNet
(Qwen3.5), Granite 4 hybrid and LFM2 on the CPU with flash attention off
(``benchmarks/results/restore-points-cpu.json``). So a request's prompt is restored from the
deepest stored restore point it extends (:class:`skippy_llama.restore_points.RestorePointStore`),
only the rest is decoded, and the state at its end is stored for the next request.

The live sequence is never continued as it is: its generated tokens were decoded one at a time,
which need not equal a batched prefill's results, so every request starts from a restore point or
from nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import llama_cpp
import numpy as np

from ..events import CacheEvent
from ..restore_points import RestorePointStore
from . import native
from .restore_probe import restores_exactly
from .timing import on_tokens
from .working import WorkingSequence

log = logging.getLogger("skippy_llama")

_WORKING_SEQ = 0


def open_restore_points(
    seq: WorkingSequence, *, l1_enabled: bool, root: bytes
) -> RestorePointPath | None:
    """Restore points for the working sequence ``seq`` when its model is recurrent or hybrid and
    this build makes its restores exact, else None (the model is then served as plain
    ``Llama``, as before).

    Asks for what the load-time check relies on: L1 on (``l1_enabled``), no embeddings or
    per-token logits rows (restored tokens come without them), the CPU backend without BLAS and
    flash attention off (where batch splits do not change results), and
    :func:`restores_exactly` in this context. The points are keyed under the cache identity's
    ``root``.
    """
    llm = seq.llm
    if not (llm._is_recurrent or llm._is_hybrid) or not l1_enabled:
        return None
    p = llm.context_params
    flash = p.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    if p.embeddings or llm._logits_all or flash:
        return None
    if native.backend_name() != "CPU" or "BLAS" in native.registered_backends():
        return None
    if not restores_exactly(llm._model.model, llm.ctx):
        log.info("skippy-llama: restores are not exact for this model here; no restore points")
        return None
    return RestorePointPath(seq, RestorePointStore(root))


class RestorePointPath:
    """Serves ``SkippyLlama.generate`` of a recurrent or hybrid model from restore points."""

    def __init__(self, seq: WorkingSequence, store: RestorePointStore) -> None:
        self.seq = seq
        self.store = store

    def generate(
        self,
        tokens: Sequence[int],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        finished: Callable[[CacheEvent], None],
    ) -> Generator[int, Sequence[int] | None, None]:
        """``Llama.generate(tokens, *args, **kwargs)`` after restoring the deepest restore point
        of ``tokens``; the state at the prompt's end becomes a restore point. The caller has
        reset the model: the live sequence holds lone-decoded tokens and is never continued.
        ``finished`` gets the request's event when the generation ends."""
        seq, llm = self.seq, self.seq.llm
        prompt = np.asarray(tokens, dtype=np.int32)
        event = CacheEvent(prompt_tokens=len(prompt))
        started = time.perf_counter()
        self._restore(prompt, event)

        def seen(i: int, token: int) -> None:
            seq.last_sampled = token
            if i:
                return
            event.ttft_ms = (time.perf_counter() - started) * 1e3
            event.prefill_ms = event.ttft_ms - event.restore_ms
            # the prompt is decoded and its first token sampled, not yet evaluated
            if llm.n_tokens == len(prompt):
                self.store.put(prompt, bytes(native.get_seq_state(llm.ctx, _WORKING_SEQ)))

        try:
            yield from on_tokens(llama_cpp.Llama.generate(llm, tokens, *args, **kwargs), seen)
        finally:
            event.suffix_tokens = event.prompt_tokens - event.cached_tokens
            finished(event)

    def _restore(self, prompt: np.ndarray[Any, np.dtype[np.int32]], event: CacheEvent) -> None:
        point = self.store.best(prompt)
        if point is None:
            return
        t0 = time.perf_counter()
        llm = self.seq.llm
        if not native.set_seq_state(llm.ctx, bytearray(point.blob), _WORKING_SEQ):
            native.seq_rm(llm.ctx, _WORKING_SEQ)
            event.fallbacks.append("restore point: llama_state_seq_set_data refused it")
            return
        n = point.n_tokens
        # Llama.generate keeps these n tokens (its prefix match) and decodes the rest
        llm.input_ids[:n] = point.tokens
        llm.n_tokens = n
        event.tier = "l1"
        event.cached_tokens = n
        event.restored_bytes = len(point.blob)
        event.restore_ms = (time.perf_counter() - t0) * 1e3

    def clear(self) -> None:
        """Drop every restore point."""
        self.store.clear()
