"""``SkippyLlama``: a drop-in ``llama_cpp.Llama`` whose prompts reuse cached KV prefixes.

The context has the n_ctx cells plain ``llama_cpp.Llama`` builds, in one unified KV cache, and
sequence 0 is the working sequence it always uses, alone in cells ``[0, n)`` as in a cold run.
Resident prefixes (L1) are llama.cpp *device checkpoints* kept under sequence ids 1..N. Before a
prompt is prefilled, the cache plans how to get its longest cached prefix into sequence 0
(:mod:`skippy_llama.plan`), the KV seam executes that plan (:mod:`.seam`), the cache commits what
served (:meth:`PrefixCache.commit`), and only the suffix is decoded. This class keeps the
``Llama`` overrides; which cells are exact is tracked by its :class:`~.working.WorkingSequence`:
only the part of the sequence decoded in batches (as a cold prefill would have) is reused or
recorded; a lone generated token only where the load-time probe found lone decodes
bit-identical to batched ones (``lone_decodes_exact``). The request path, probes, recording, chat
repair and status live in their own modules beside this one, and take the working sequence and
the cache, never this object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import llama_cpp
import numpy as np
import numpy.typing as npt

from ..config import Settings, load_settings
from ..costs import CostModel
from ..events import CacheEvent
from ..packages.kvdtype import KVDtypeResolution, resolve_user_kv_types
from ..packages.loader import LoadedPackage, load_package
from ..pinned import cuda_pinner
from ..prefetch import PrefetchResult
from ..tiers.factory import wants_pages
from . import probes, repair
from .arena_setup import open_page_paths
from .bus import BusRate, seed_costs
from .cache_setup import l1_budget, open_cache, open_seam
from .context import adjusted, sequence_count
from .identity_params import build_identity
from .prompt_tokens import completion_tokens
from .recording import DECODED_SUFFIX, DEFER_RECORD_TOKENS, Recorder, default_defer_tokens
from .restore import restore_prefix
from .restore_points import RestorePointPath, open_for_model
from .seam import backend_name
from .status import cache_status
from .timing import on_tokens
from .working import WorkingSequence, WorkingView, guard

log = logging.getLogger("skippy_llama")

__all__ = ["DECODED_SUFFIX", "DEFER_RECORD_TOKENS", "SkippyLlama"]


class SkippyLlama(WorkingView, llama_cpp.Llama):
    """A ``llama_cpp.Llama`` with a paged, tiered KV-prefix cache.

    Takes every argument ``llama_cpp.Llama`` takes, plus ``cache_settings`` and ``cost_model``.
    Without settings they come from ``SKIPPY_*`` environment variables and the ``SKIPPY_CONFIG``
    TOML file. ``cost_model`` replaces the measured rules that decide whether a restore or a
    park pays (``skippy_llama.costs.AlwaysRestore`` restores whenever a tier can).

    After each completion ``last_cache_event`` tells which tier served the prompt, how many tokens
    were reused and how long each step took; completion responses also carry
    ``usage["prompt_tokens_details"]["cached_tokens"]`` as OpenAI's API does.

    Example:
        >>> llm = SkippyLlama("model.gguf", n_ctx=4096)
        >>> llm.create_completion("A long shared prefix ... question 1", max_tokens=16)
        >>> llm.create_completion("A long shared prefix ... question 2", max_tokens=16)
        >>> llm.last_cache_event.tier
        'l1'
    """

    def __init__(
        self,
        model_path: str,
        *,
        cache_settings: Settings | None = None,
        cost_model: CostModel | None = None,
        **kwargs: Any,
    ) -> None:
        self.cache_settings = settings = cache_settings or load_settings().settings
        self.last_cache_event: CacheEvent | None = None
        self.model_package: LoadedPackage | None = None
        self.kv_dtype: KVDtypeResolution = resolve_user_kv_types(kwargs)
        self.in_generate = False
        self._chat_request = False  # inside create_chat_completion: a later prompt extends it
        self._epoch = 0  # request counter: a stream finalized late must not touch a newer one
        slots = settings.l1.max_prefixes if settings.l1.enabled else 0
        # sequence 1 doubles as the scratch sequence of range captures for records (stock builds)
        aux = max(slots, 1 if wants_pages(settings) else 0)
        with adjusted(sequence_count(1 + aux)):
            super().__init__(model_path, **kwargs)
        p = self.context_params
        on_cpu = backend_name() == "CPU"
        self.seam = open_seam(self.ctx, p.type_k, p.type_v, on_cpu=on_cpu)
        self.working = seq = WorkingSequence(
            self,
            self.seam,
            disabled_reason=probes.cache_refusal(self),
            allow_uncertified=settings.native.allow_uncertified,
            repair_generated=settings.l1.repair_generated,
        )
        seq.granule, refused = probes.canonical_granule(seq)
        seq.disabled_reason = seq.disabled_reason or refused
        seq.lone_decodes_exact = seq.granule == 1 and probes.lone_decodes_exact(seq)
        #: Long page restores run in chunks, each read while the last is imported (needs the
        #: append import): on an H100 a first 32k-token L3 restore went from 0.56 to 0.34 of cold;
        #: on the CPU, where the import is a memcpy, up to 1.4x slower (restore-chunked-cpu-s39).
        self.pipeline_restores = not on_cpu
        offloaded = self.model_params.n_gpu_layers != 0 and bool(p.offload_kqv)
        if settings.pin_host_buffers:
            self.seam.buffers.pinner = cuda_pinner(backend_name(), offloaded)
        window = int(llama_cpp.llama_model_n_swa(self._model.model))
        seq.sliding_window = window > 0
        self.l1_budget_tokens = l1_budget(
            settings,
            self.n_ctx(),
            slots,
            on_device=self.seam.on_device,
            disabled_reason=seq.disabled_reason,
        )
        # the durable identity and pages need the layout now; L1 alone reads it only when
        # asked (cache_status), so loading costs what plain Llama's does
        layout = seq.layout if wants_pages(settings) else None
        self.cache_identity = build_identity(
            self, settings, layout, split_dependent=seq.granule > 1
        )
        costs = cost_model if cost_model is not None else CostModel()
        #: The load-time bus probe's rate where pages may be restored (None elsewhere, or when it
        #: failed): page tiers not yet measured are planned at it (``runtime/bus.py``).
        self.bus: BusRate | None = seed_costs(
            costs,
            layout,
            backend_name(),
            kv_offloaded=offloaded,
            pinned=self.seam.buffers.pinner is not None,
        )
        self.prefix_cache = open_cache(
            settings,
            self.cache_identity,
            layout,
            costs,
            caching=self.caching,
            slots=slots,
            budget=self.l1_budget_tokens,
            window=window,
        )
        paths = open_page_paths(
            self.ctx,
            self.seam,
            self.prefix_cache,
            layout,
            seq.verdict,
            on_device=offloaded,
            pinner=self.seam.buffers.pinner,
            n_ctx=self.n_ctx(),
        )
        #: Why pages read from L3 are assembled into a state blob rather than copied per layer
        #: from their own bytes straight into the KV tensors (None: copied; ``arena_setup.py``).
        self.page_copy_refusal: str | None = paths.page_copy_refusal
        #: Why L2 keeps page bytes rather than its host arena, whose restores copy pages per
        #: layer straight into the KV tensors (None: the arena serves).
        self.arena_refusal: str | None = paths.arena_refusal
        #: Why records are captured through the state format rather than exported into arena
        #: slots off the request path (None: exported; ``runtime/export.py``).
        self.export_refusal: str | None = paths.export_refusal
        #: Whole-sequence restore points at prompt ends, for recurrent and hybrid models (which
        #: the paged cache refuses) where they are exact, and for sliding-window models when L3
        #: is on; None otherwise.
        self.restore_points: RestorePointPath | None = open_for_model(
            seq, settings, self.cache_identity, model_path, window
        )
        exports = self.seam.exporter is not None
        self.recorder = Recorder(
            seq, self.prefix_cache, default_defer_tokens(on_cpu=on_cpu, exports=exports)
        )

    @classmethod
    def from_package(
        cls,
        path: str | Path,
        *,
        type_k: str | int | None = None,
        type_v: str | int | None = None,
        verify_hashes: bool = True,
        **kwargs: Any,
    ) -> SkippyLlama:
        """Load the GGUF of a model package with the live K/V types its metadata resolves to.

        The package is verified first (a tampered file raises :class:`PackageError`). ``type_k``
        and ``type_v`` are explicit user overrides and win over the publisher metadata; a
        quantized V cache turns flash attention on unless ``flash_attn`` is given, since llama.cpp
        needs it. ``kv_dtype`` on the returned model says which rule chose the types.
        """
        package = load_package(path, verify_hashes=verify_hashes)
        resolution = package.resolve(type_k, type_v)
        if resolution.needs_flash_attn and "flash_attn" not in kwargs:
            kwargs["flash_attn"] = True
        kwargs.update(resolution.llama_kwargs())
        llm = cls(str(package.gguf_path), **kwargs)
        llm.model_package = package
        llm.kv_dtype = resolution
        return llm

    @property
    def defer_record_tokens(self) -> int:
        """A record waits while fewer than this many of its tokens are unrecorded (0: never;
        GPU builds that capture through the state format: always; see ``Recorder.defer_tokens``
        and ``recording.default_defer_tokens``)."""
        return self.recorder.defer_tokens

    @defer_record_tokens.setter
    def defer_record_tokens(self, tokens: int) -> None:
        self.recorder.defer_tokens = tokens

    # -- the request path: tokens -> plan -> seam -> commit ------------------------------

    def _finish(self, event: CacheEvent, prompt_tokens: int, *, repairable: bool) -> None:
        """A request ended: remember its reply and record what the tiers lack."""
        event.suffix_tokens = event.prompt_tokens - event.cached_tokens
        self.working.reply_start, self.working.reply_repairable = prompt_tokens, repairable
        self.last_cache_event = event
        recording = time.perf_counter()
        guard(self.prefix_cache, "record", None, lambda: self.recorder.after_request(event))
        # the one step of the request path after its last token: in the request's time
        event.record_ms = (time.perf_counter() - recording) * 1e3

    def generate(  # type: ignore[override]
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, Sequence[int] | None, None]:
        """``Llama.generate`` that first restores the longest cached prefix of ``tokens``."""
        reset = kwargs.get("reset", True)
        self.seam.settle()  # a record's export still copying cells must end first
        if self.restore_points is not None and reset and len(tokens) > 0:
            self.reset()  # the live sequence holds lone-decoded tokens: never continued
            self._epoch += 1
            epoch = self._epoch

            def ended(event: CacheEvent) -> None:
                self.last_cache_event = event

            # Llama.generate decodes the rest through self.eval: plain decoding after the
            # restore, never the paged cache's restore (a sliding-window model keeps its paged
            # L1 beside the points; that path did not know the restored cells and decoded the
            # whole prompt again: Gemma 3 after a restart from L3 took 1.2-1.8x cold)
            self.in_generate = True
            try:
                return (yield from self.restore_points.generate(tokens, args, kwargs, ended))
            finally:
                if epoch == self._epoch:
                    self.in_generate = False
        if not self.caching or not reset or len(tokens) == 0:
            return (yield from super().generate(tokens, *args, **kwargs))
        self._epoch += 1
        epoch = self._epoch
        prompt = np.asarray(tokens, dtype=np.int32)
        event = CacheEvent(prompt_tokens=len(prompt))
        started = time.perf_counter()
        self.recorder.unless_continued(prompt)
        cache, seq = self.prefix_cache, self.working
        restore_prefix(seq, cache, prompt, event, pipeline=self.pipeline_restores)
        self.in_generate = True
        seq.last_sampled = None

        def seen(i: int, token: int) -> None:
            # the caller stops after a token without evaluating it (end of generation, length)
            seq.last_sampled = token
            if i:
                return
            event.ttft_ms = (time.perf_counter() - started) * 1e3
            event.prefill_ms = event.ttft_ms - event.park_ms - event.lookup_ms - event.restore_ms
            suffix = event.prompt_tokens - event.cached_tokens
            cache.costs.observe_prefill(suffix, event.prefill_ms / 1e3)

        try:
            yield from on_tokens(super().generate(tokens, *args, **kwargs), seen)
        finally:
            # a stream abandoned by its caller is finalized whenever it is collected, maybe in
            # the middle of a newer request: then it must leave the working sequence alone
            if epoch == self._epoch:
                self.in_generate = False
                self._finish(event, len(prompt), repairable=self._chat_request)

    def eval(self, tokens: Sequence[int]) -> None:
        """``Llama.eval`` that restores a cached prefix first when called on its own.

        Inside ``generate`` the prefix was already restored, so this is plain decoding.
        """
        self.seam.settle()
        if self.in_generate or not self.caching or len(tokens) < 2:
            self.working.decode(tokens)
            return
        self._epoch += 1
        whole = np.concatenate(
            [self.input_ids[: self.n_tokens].astype(np.int32), np.asarray(tokens, np.int32)]
        )
        event = CacheEvent(prompt_tokens=len(whole))
        started = time.perf_counter()
        self.recorder.unless_continued(whole)
        restore_prefix(
            self.working, self.prefix_cache, whole, event, pipeline=self.pipeline_restores
        )
        self.working.decode(whole[self.n_tokens :].tolist())
        elapsed_ms = (time.perf_counter() - started) * 1e3
        event.prefill_ms = elapsed_ms - event.park_ms - event.lookup_ms - event.restore_ms
        suffix = event.prompt_tokens - event.cached_tokens
        self.prefix_cache.costs.observe_prefill(suffix, event.prefill_ms / 1e3)
        self._finish(event, len(whole), repairable=False)

    def prepare_next_turn(self, stop: Callable[[], bool] | None = None) -> int:
        """Do now, while nothing waits, what the next request would otherwise do first:
        re-decode the last reply as one batch (so the next turn reuses it exactly), decode the
        chat template's head after it, keep the chat resident when several chats take turns,
        and make a waiting L3 record. Outputs do not change. See ``runtime/repair.py``.

        Args:
            stop: asked between those steps; once it returns True the rest is left to the
                next request (a server passes "a request is waiting"), so a request waits
                for one step at most.

        Returns:
            the tokens decoded: 0 when there is nothing to do.
        """
        if not self.caching or self.in_generate:
            return 0
        return repair.prepare_next_turn(self.working, self.prefix_cache, self.recorder, stop)

    def prefetch(
        self,
        prompt: str | Sequence[int] | npt.NDArray[np.int32],
        *,
        stop: Callable[[], bool] | None = None,
    ) -> PrefetchResult:
        """Bring the L3 pages of a prompt that is likely to come next into L2, so that its
        request restores from RAM instead of disk. Outputs do not change.

        A no-op (``stopped == "off"``) unless both L2 and L3 are on. Never raises: a failing
        tier is a counted miss (``cache_status()["counters"]["prefetch_misses"]``). It neither
        decodes nor touches the working sequence or L1, so with token ids it may run on another
        thread while this object serves a request (text is tokenized here first).

        Args:
            prompt: a completion prompt as text (tokenized as ``create_completion`` does) or
                the token ids the request will use.
            stop: asked before each L3 read; once it returns True the prefetch ends there.

        Returns:
            what it did: pages and bytes copied, tokens L2 now covers, why it stopped.

        Example:
            >>> llm.prefetch(next_prompt).stopped
            'complete'
        """
        if not self.caching:
            return PrefetchResult(stopped="off")
        try:
            tokens = completion_tokens(self, prompt) if isinstance(prompt, str) else prompt
        except Exception as exc:  # text llama.cpp cannot tokenize: the request will say so
            log.warning("skippy-llama: prefetch could not tokenize the prompt (%s)", exc)
            return PrefetchResult(stopped="error")
        return self.prefix_cache.prefetch(tokens, stop=stop)

    def create_completion(self, *args: Any, **kwargs: Any) -> Any:
        """``Llama.create_completion`` whose usage reports ``prompt_tokens_details.cached_tokens``."""
        result = super().create_completion(*args, **kwargs)
        if isinstance(result, Iterator):
            return result
        event = self.last_cache_event
        usage = cast("dict[str, Any] | None", result.get("usage"))
        if isinstance(usage, dict):
            usage["prompt_tokens_details"] = {
                "cached_tokens": event.cached_tokens if event is not None else 0
            }
        return result

    def create_chat_completion(self, *args: Any, **kwargs: Any) -> Any:
        """``Llama.create_chat_completion``; a reply left for another chat is repaired first
        (see ``l1.repair_generated``)."""
        self._chat_request = True
        try:
            result = super().create_chat_completion(*args, **kwargs)
        finally:
            self._chat_request = False
        return self._chat_stream(result) if isinstance(result, Iterator) else result

    def _chat_stream(self, chunks: Iterator[Any]) -> Iterator[Any]:
        # a streamed reply is generated while the caller iterates, after the call returned
        self._chat_request = True
        try:
            yield from chunks
        finally:
            self._chat_request = False

    # -- whole-context calls ----------------------------------------------------------------

    def _leave_live(self) -> None:
        """Checkpoint the live sequence before a whole-context call replaces or forgets it."""
        if getattr(self, "prefix_cache", None) is None or not self.caching:
            return  # called while Llama.__init__ runs, or without a cache
        self.recorder.flush()
        seq, cache = self.working, self.prefix_cache
        if seq.live_exact() > 0:
            event = CacheEvent()
            guard(
                cache, "park", event, lambda: repair.displace(seq, cache, seq.live_exact(), event)
            )

    def reset(self) -> None:
        """``Llama.reset``; the live sequence stays reusable as a resident prefix."""
        self._leave_live()
        super().reset()  # type: ignore[no-untyped-call]
        self.working.exact = 0

    def save_state(self) -> llama_cpp.LlamaState:
        """``Llama.save_state``; the state also remembers which of its cells are exact.

        Resident prefixes live in checkpoints outside the KV cells, so the state holds the
        working sequence alone, exactly as plain ``Llama``'s does.
        """
        self.seam.settle()
        state = super().save_state()
        state.skippy_exact = self.working.exact_tokens()  # type: ignore[attr-defined]
        state.skippy_scored = min(self.working.scored, self.n_tokens)  # type: ignore[attr-defined]
        return state

    def load_state(self, state: llama_cpp.LlamaState) -> None:
        """``Llama.load_state``; resident prefixes stay valid (they are not in the KV cells).

        Cells of a state saved elsewhere are trusted as exact only when this class saved it.
        """
        self._leave_live()
        super().load_state(state)
        seq = self.working
        seq.exact = min(int(getattr(state, "skippy_exact", 0)), self.n_tokens)
        seq.scored = min(int(getattr(state, "skippy_scored", 0)), self.n_tokens)
        seq.reply_repairable = False

    def clear_cache(self) -> None:
        """Drop every resident prefix (L1) and restore point."""
        self.seam.settle()
        if self.restore_points is not None:
            self.restore_points.clear()
        resident = self.prefix_cache.resident
        if resident is not None:
            resident.clear()

    def cache_status(self) -> dict[str, Any]:
        """In-process cache state: L1 memory and counters (what ``kv-cache status`` cannot see),
        and the restore points held in memory (recurrent and hybrid models)."""
        self.seam.settle()
        status = cache_status(self.working, self.prefix_cache, self.l1_budget_tokens)
        if self.restore_points is not None:
            status["restore_points"] = self.restore_points.status()
        return status

    def flush_cache(self, timeout: float = 60.0) -> bool:
        """Make a waiting L3 record now and wait until the record-taking tiers stored it.

        A GPU build leaves each record waiting until another prompt takes the sequence, the
        server's idle gap (``prepare_next_turn``) or ``close``, so that no device copy sits
        between a reply and the next request; call this where the pages must be durable now
        (before another process reads the store, or a handoff).

        Returns:
            False when the L3 writer did not finish within ``timeout`` seconds.
        """
        cache = self.prefix_cache
        self.recorder.flush()
        disk = cache.disk
        return disk.flush(timeout) if disk is not None else True

    def close(self) -> None:
        """Free the model and context; pending L3 writes are flushed first (bounded wait)."""
        cache = getattr(self, "prefix_cache", None)
        if cache is not None:
            self.recorder.flush()
            cache.close()
        points = getattr(self, "restore_points", None)
        if points is not None:
            points.close()
        seam = getattr(self, "seam", None)
        if seam is not None:
            seam.close()
        super().close()
