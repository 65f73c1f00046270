"""The working sequence: sequence 0 of a ``SkippyLlama``'s context, as the cache sees it.

The runtime modules (``restore``, ``recording``, ``repair``, ``probes``, ``status``) take this,
never the ``SkippyLlama``: what is live (the model's ``input_ids[:n_tokens]``, as
llama-cpp-python keeps them), which leading tokens are exact (their cells equal a batched cold
prefill's) and scored (``logits_all`` rows this context computed), the seam over its cells,
where a reused prefix may end (the granule), the chat reply it holds, and the layout of its cells
with the native verdict that depends on it. ``SkippyLlama`` keeps the ``Llama`` overrides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from ..cache import PrefixCache
from ..events import CacheEvent
from ..roster import Verdict
from ..state import KVLayout
from .recipe import native_verdict
from .seam import SCRATCH_SEQ, KVSeam, backend_name

log = logging.getLogger("skippy_llama")


class WorkingSequence:
    """Sequence 0 of ``llm``'s context: its exact and scored parts, seam and layout.

    Args:
        llm: the model whose context holds the sequence (its tokens are ``llm.input_ids``).
        seam: the KV seam over the context.
        disabled_reason: why the cache is off for this context (None: caching).
        allow_uncertified: ``native.allow_uncertified`` (see :attr:`verdict`).
        repair_generated: ``l1.repair_generated`` (which replies are re-decoded before the
            sequence is parked).
    """

    def __init__(
        self,
        llm: llama_cpp.Llama,
        seam: KVSeam,
        *,
        disabled_reason: str | None,
        allow_uncertified: bool,
        repair_generated: str,
    ) -> None:
        self.llm = llm
        self.seam = seam
        self.disabled_reason = disabled_reason
        self.allow_uncertified = allow_uncertified
        self.repair_generated = repair_generated
        #: reused prefixes end at multiples of this (``probes.canonical_granule``)
        self.granule = 1
        #: a token decoded alone leaves the cells and logits a batched prefill gives it
        self.lone_decodes_exact = False
        #: the model attends through a sliding window (its cache is never cut back)
        self.sliding_window = False
        #: leading tokens whose cells equal a batched (cold) prefill's
        self.exact = 0
        #: with logits_all: leading tokens whose logits rows this object computed (restored
        #: cells come without rows, and llm.scores, prompt logprobs and perplexity loops read
        #: them)
        self.scored = 0
        #: the last request's reply [reply_start, n_tokens) and whether it may be repaired
        self.reply_start = 0
        self.reply_repairable = False
        self.last_sampled: int | None = None  # the last request's last token (not evaluated)
        self.chat_head: list[int] | None = None  # the chat template's head, once looked up
        #: the tokens of the last record the record-taking tiers took (or found stored)
        self.held: npt.NDArray[np.int32] | None = None
        self._layout: KVLayout | None = None
        self._layout_read = False
        self._verdict: Verdict | None = None

    @property
    def caching(self) -> bool:
        return self.disabled_reason is None

    @property
    def n_tokens(self) -> int:
        """Tokens the sequence holds (llama-cpp-python's count)."""
        return int(self.llm.n_tokens)

    def tokens(self, n: int) -> npt.NDArray[np.int32]:
        """The sequence's first ``n`` tokens."""
        return self.llm.input_ids[: max(n, 0)].astype(np.int32)

    # -- exactness ------------------------------------------------------------------------

    def live_exact(self) -> int:
        """Leading tokens of the working sequence whose cells are exact and still present.

        Whole-context calls made behind the cache's back (``_ctx.kv_cache_clear()`` in
        llama-cpp-python's multimodal handlers, ``llama_memory_seq_rm``) remove cells without
        telling it; the cells actually present bound what may be reused.
        """
        exact = min(self.exact, self.n_tokens)
        if exact > 0:
            exact = min(exact, self.seam.live_cells())
        return self.aligned(max(exact, 0))

    def held_tokens(self) -> int:
        """Leading live tokens the last record handed to the record-taking tiers (or found
        stored there): what a park of them competes with (``Planner.park``)."""
        held = self.held
        n = 0 if held is None else len(held)
        if held is None or n == 0 or n > self.n_tokens:
            return 0
        return n if np.array_equal(self.llm.input_ids[:n], held) else 0

    def aligned(self, n: int) -> int:
        """``n`` rounded down to a canonical batch boundary (see ``granule``)."""
        return n - n % self.granule

    def exact_tokens(self) -> int:
        return min(self.exact, self.n_tokens)

    @property
    def scored_tokens(self) -> int | None:
        """Leading tokens whose logits rows are kept (``logits_all``), else None."""
        return self.scored if self.llm._logits_all else None

    def decode(self, tokens: Sequence[int]) -> None:
        """``Llama.eval`` without the cache, tracking which cells are exact.

        A batch of two or more tokens right after the exact part extends it; a lone token (a
        generated one) takes other kernels, so the exact part stops before it, unless the
        build decodes lone tokens exactly (``lone_decodes_exact``).
        """
        before = self.n_tokens
        exact = self.exact_tokens()
        llama_cpp.Llama.eval(self.llm, tokens)
        if before <= self.scored:
            self.scored = self.n_tokens
        batched = (len(tokens) >= 2 or self.lone_decodes_exact) and exact == before
        self.exact = self.aligned(self.n_tokens) if batched else exact

    def keep_exact(self, n: int) -> None:
        """Keep only the first ``n`` exact tokens (a restore is about to write what follows)."""
        self.llm.n_tokens = self.exact = n
        if self.llm._logits_all:
            self.scored = n

    def adopt(self, n: int, restored: npt.NDArray[np.int32] | None) -> None:
        """The sequence holds ``n`` exact tokens: kept, or written by a restore of
        ``restored`` (the prompt), whose logits the next eval computes."""
        if restored is not None:
            self.llm.input_ids[:n] = restored[:n]
            self.llm._requires_eval = True
        self.llm.n_tokens = self.exact = n

    def cut(self, start: int) -> None:
        """Drop the cells and tokens from ``start`` on (they are decoded again)."""
        self.seam.cut(start)
        self.llm.n_tokens = start

    def drop(self) -> None:
        """Forget the sequence: the next decode starts a cold prefill."""
        self.seam.cut()
        self.llm.n_tokens = self.exact = 0

    # -- what is known of its cells -----------------------------------------------------------

    @property
    def layout(self) -> KVLayout | None:
        """The byte layout of the context's KV cells (``None`` when unknown or not caching).

        Read on first use: from one cell of the sequence when it holds any, otherwise by
        decoding one token into it and dropping it again.
        """
        if not self._layout_read and self.caching:
            try:
                self._layout = self._read_layout()
            except Exception as exc:  # fail-open: without a layout only L1 is used
                log.warning("skippy-llama: could not read the KV layout (%s); L2/L3 disabled", exc)
                self._layout_read = True
            else:
                self._layout_read = self._layout is not None or self.n_tokens == 0
        return self._layout

    def _read_layout(self) -> KVLayout | None:
        if self.seam.live_cells() > 0:
            if int(self.llm.context_params.n_seq_max) <= SCRATCH_SEQ:
                return None  # no spare sequence to share one cell with
            return self.seam.layout_from_cell()
        if self.n_tokens:
            return None  # cleared behind llama-cpp-python's back: probing would hide it
        try:
            bos = self.llm.token_bos()
            self.decode([bos if bos >= 0 else 0])
            # both sections of a sliding-window model's state: the roster row and identity
            # need its layout even though its states are never paged
            return self.seam.layout_from_state()
        finally:
            self.drop()

    @property
    def verdict(self) -> Verdict:
        """Whether the loaded llama.cpp carries skippy's patches, certified for this model."""
        if self._verdict is None:
            layout = self.layout
            found = native_verdict(
                str(self.llm.metadata.get("general.architecture", "unknown")),
                backend_name(),
                layout,
                allow_uncertified=self.allow_uncertified,
            )
            if self._layout is None and not self._layout_read:
                return found  # the layout may still become known: decide again then
            self._verdict = found
        return self._verdict

    @verdict.setter
    def verdict(self, verdict: Verdict) -> None:
        """Plan with ``verdict`` from now on: a benchmark's arm narrows the certified lanes to
        take a stock path on a patched build (``benchmarks/bench_append.py``). What the load
        set up from the verdict it read (page copies, L2's arena) stays as it is."""
        self._verdict = verdict


def guard(cache: PrefixCache, step: str, event: CacheEvent | None, work: Callable[[], Any]) -> bool:
    """Run one cache step; any exception becomes a fallback counted in ``cache`` (fail-open).

    Not only :class:`SkippyError`: a ``ValueError`` from a damaged page or a ``MemoryError``
    from a huge state must never fail a request the model itself can serve.
    """
    try:
        work()
        return True
    except Exception as exc:
        cache.fallback(f"{step}: {type(exc).__name__}")
        if event is not None:
            event.fallbacks.append(f"{step}: {exc}")
        log.warning("skippy-llama: %s failed (%s); continuing without it", step, exc)
        return False


class WorkingView:
    """What ``SkippyLlama`` tells its users of its working sequence (``working``), read from
    the :class:`WorkingSequence`, so the model class keeps only the ``Llama`` overrides."""

    working: WorkingSequence

    @property
    def kv_layout(self) -> KVLayout | None:
        """The byte layout of this context's KV cells (``None`` when unknown or not caching),
        read on first use."""
        return self.working.layout

    @property
    def native_verdict(self) -> Verdict:
        """Whether the loaded llama.cpp carries skippy's patches, certified for this model."""
        return self.working.verdict

    @property
    def cache_disabled_reason(self) -> str | None:
        """Why this context is not cached (None: it is)."""
        return self.working.disabled_reason

    @property
    def caching(self) -> bool:
        """Whether the paged cache serves this context (see :attr:`cache_disabled_reason`)."""
        return self.working.caching

    @property
    def granule(self) -> int:
        """Reused prefixes end at multiples of this (the canonical batch boundary)."""
        return self.working.granule

    @property
    def lone_decodes_exact(self) -> bool:
        """Whether a token decoded alone leaves the cells and logits a batched prefill gives it
        (probed at load): then a reply is reusable as generated, and nothing is repaired."""
        return self.working.lone_decodes_exact

    def live_exact(self) -> int:
        """Leading tokens of the working sequence whose cells are exact and still present."""
        return self.working.live_exact()
