"""``SkippyLlama``: a drop-in ``llama_cpp.Llama`` whose prompts reuse cached KV prefixes.

The context has the n_ctx cells plain ``llama_cpp.Llama`` builds, in one unified KV cache, and
sequence 0 is the working sequence it always uses, alone in cells ``[0, n)`` as in a cold run.
Resident prefixes (L1) are llama.cpp *device checkpoints* kept under sequence ids 1..N: copies of
a sequence's K/V tensors held by the context (VRAM on GPU builds), sized to the prefix, so the
KV memory is at most the context plus the resident budget. Before a prompt is prefilled, the
longest cached prefix (the live sequence, a checkpoint, else L2/L3 pages) is put into sequence 0
and only the suffix is decoded. Only the part of the sequence decoded in batches (as a cold
prefill would have) is reused or recorded: a lone generated token only where the load-time
probe found lone decodes bit-identical to batched ones (``lone_decodes_exact``).

Nothing is done per turn that a linear chat does not need: the live sequence is checkpointed
only when a prompt is about to leave it, and an L3 record captures only the tokens L3 lacks.
"""

from __future__ import annotations

import functools
import logging
import mmap
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import llama_cpp
import llama_cpp._internals as internals
import numpy as np

from ..admission import AdmissionPolicy
from ..cache import LookupResult, PrefixCache
from ..config import Settings, load_settings
from ..errors import StateFormatError, TierError
from ..events import CacheEvent
from ..hostmem import BufferPool, HostBuffer
from ..identity import CacheIdentity, paging_refusal
from ..packages.kvdtype import KVDtypeResolution, resolve_kv_dtype
from ..packages.loader import LoadedPackage, load_package
from ..pinned import cuda_pinner
from ..roster import Verdict
from ..state import (
    KVLayout,
    assemble_into,
    assembled_size,
    page_from_bytes,
    parse_layout,
    parse_state,
)
from ..tiers.disk import DiskTier
from ..tiers.ram import RamTier
from ..tiers.resident import ResidentIndex, common_prefix
from ..tiers.resident_costs import ResidentCosts
from . import native, native_ext, split_verdicts
from .chat_head import template_head
from .identity_params import build_identity
from .recipe import native_verdict
from .timing import on_tokens

log = logging.getLogger("skippy_llama")

WORKING_SEQ = 0
#: Prompt tokens always decoded, never restored. Stock llama.cpp decodes a lone token with other
#: kernels than a batch, and its logits then differ from a cold prefill's (measured: up to 0.66
#: on SmolLM2); two or more tokens decode bit-identically.
DECODED_SUFFIX = 2
#: The lone-decode probe (see ``SkippyLlama._lone_decodes_exact``): this many tokens decoded one
#: at a time after the split probe's prompt (stock SmolLM2 Q4_1 on AVX-512 gives the same
#: logits for a lone 16th token, but not for a lone 17th to 24th).
LONE_PROBE_TOKENS = 8
#: The split probe (see ``SkippyLlama._split_invariant``): a prompt of this many tokens, decoded
#: whole and then split after each of these many tokens (parts of every residue class that
#: grouped kernels treat apart, and the two-token tail a prompt's suffix can be: Gemma 3 Q4_K_M
#: differs at each of them, SmolLM2 Q4_1 at none).
SPLIT_PROBE_TOKENS = 16
SPLIT_PROBE_AT = (1, 3, 6, 11, 13, 14)
#: The context fields that choose llama.cpp's kernels, part of a probe verdict's key.
_KERNEL_FIELDS = (
    "n_ctx",
    "n_batch",
    "n_ubatch",
    "n_seq_max",
    "n_threads",
    "n_threads_batch",
    "type_k",
    "type_v",
    "flash_attn_type",
    "offload_kqv",
    "swa_full",
    "kv_unified",
)
#: Sequence id used as scratch by range captures (empty at rest; also checkpoint slot 1).
SCRATCH_SEQ = 1
#: On GPU builds the L3 record of a sequence that grew from its last record waits until this
#: many tokens are unrecorded (see ``SkippyLlama.defer_record_tokens``).
DEFER_RECORD_TOKENS = 2048
#: K/V types whose device checkpoints llama.cpp copies whole: F32, F16 and BF16 (ggml type 30,
#: which llama-cpp-python does not name)
_DEVICE_CHECKPOINT_TYPES = frozenset((llama_cpp.GGML_TYPE_F32, llama_cpp.GGML_TYPE_F16, 30))

_context_hook = threading.local()


def _sequence_count(needed: int) -> int:
    """``n_seq_max`` for a context that uses ``needed`` sequence ids: the next power of two.

    On the CPU build a prefill ran 6-7 % slower in a unified context of 3, 5 or 6 sequences than
    in one of 1, 2, 4 or 8 (500-token prompts, SmolLM2, 2 cores, 20-30 paired runs each); the
    unused ids cost a logits row each in llama.cpp's output buffer and nothing else.
    """
    return 1 << max(needed - 1, 0).bit_length()


class _HookedContext(internals.LlamaContext):  # type: ignore[misc]
    """``LlamaContext`` that lets ``SkippyLlama`` adjust the parameters of the one it builds.

    ``Llama.__init__`` offers no ``n_seq_max``/``kv_unified``; building its context and then a
    second one would double load time and peak memory. The adjustment is thread-local and set
    only inside ``SkippyLlama.__init__``, so every other context is built exactly as before.
    """

    def __init__(self, *, model: Any, params: Any, verbose: bool = True) -> None:
        adjust = getattr(_context_hook, "adjust", None)
        if adjust is not None:
            adjust(params)
        super().__init__(model=model, params=params, verbose=verbose)


if not issubclass(internals.LlamaContext, _HookedContext):
    internals.LlamaContext = _HookedContext  # type: ignore[misc]


class SkippyLlama(llama_cpp.Llama):
    """A ``llama_cpp.Llama`` with a paged, tiered KV-prefix cache.

    Takes every argument ``llama_cpp.Llama`` takes, plus ``cache_settings``. Without it the
    settings come from ``SKIPPY_*`` environment variables and the ``SKIPPY_CONFIG`` TOML file.

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
        self, model_path: str, *, cache_settings: Settings | None = None, **kwargs: Any
    ) -> None:
        self.cache_settings = cache_settings or load_settings().settings
        self.last_cache_event: CacheEvent | None = None
        self.model_package: LoadedPackage | None = None
        self.kv_dtype: KVDtypeResolution = resolve_kv_dtype(
            user_k=kwargs.get("type_k"),
            user_v=kwargs.get("type_v"),
            publisher=None,
            publisher_unavailable="the model was not loaded from a model package",
        )
        # names such as "q8_0" are accepted for type_k/type_v; llama.cpp wants ggml ids
        for side, ggml_id in (
            ("type_k", self.kv_dtype.ggml_type_k),
            ("type_v", self.kv_dtype.ggml_type_v),
        ):
            if isinstance(kwargs.get(side), str):
                kwargs[side] = ggml_id
        self._in_generate = False
        self._chat_request = (
            False  # inside create_chat_completion: a later prompt extends the reply
        )
        # with logits_all: leading working-sequence tokens whose logits rows this object
        # computed (restored cells come without rows, and llm.scores, prompt logprobs and
        # perplexity loops read them)
        self._scored = 0
        # leading working-sequence tokens whose cells equal a batched (cold) prefill's
        self._exact = 0
        # the last request's reply [start, n_tokens) and whether it may be repaired (chat)
        self._reply_start = 0
        self._reply_repairable = False
        self._epoch = 0  # request counter: a stream finalized late must not touch a newer one
        self._head: list[int] | None = None  # the chat template's head, once looked up
        self._last_sampled: int | None = None  # the last request's last token (not evaluated)
        # host buffers for the blobs of L2/L3 restores and L3 captures, reused: a fresh one
        # each time spends longer in page faults than the state call takes (measured: 0.48 s
        # for 720 MB on the H200 host); a capture stays with the L3 writer until it is cut
        self._buffers = BufferPool()
        # the tokens of the last L3 record made, and the point of a record left for later
        self._recorded: np.ndarray[Any, np.dtype[np.int32]] | None = None
        self._deferred = 0
        settings = self.cache_settings
        slots = settings.l1.max_prefixes if settings.l1.enabled else 0
        # sequence 1 doubles as the scratch sequence of range captures for L3 records
        aux = max(slots, 1 if settings.l3.mode != "off" else 0)
        _context_hook.adjust = self._context_adjuster(_sequence_count(1 + aux))
        try:
            super().__init__(model_path, **kwargs)
        finally:
            _context_hook.adjust = None
        self.cache_disabled_reason: str | None = None
        if self.context_params.embeddings:
            self.cache_disabled_reason = "embedding contexts are not cached"
        elif self._is_recurrent or self._is_hybrid:
            arch = str(self.metadata.get("general.architecture", "unknown"))
            self.cache_disabled_reason = paging_refusal(arch, (), recurrent=True)
        self.granule = self._canonical_granule()
        #: Whether a token decoded alone leaves the cells and logits a batched prefill gives it
        #: (probed at load): then a reply is reusable as generated, and nothing is repaired.
        self.lone_decodes_exact = self.granule == 1 and self._lone_decodes_exact()
        #: A record of the working sequence waits while the sequence only grew from the last
        #: record made and fewer than this many tokens are unrecorded (0: never waits). On a GPU
        #: build a capture pays one synchronized device copy per layer and K/V however few
        #: tokens it takes (~1 ms each on an H200), so a linear chat's turns are captured a few
        #: at a time; the record is made before the sequence is left or cleared, in
        #: ``prepare_next_turn`` and in ``close``, so an orderly exit loses nothing, and a crash
        #: at most this many tokens of L3 (not of any answer). On the CPU a capture is a memcpy:
        #: nothing to save.
        self.defer_record_tokens = 0 if native.backend_name() == "CPU" else DEFER_RECORD_TOKENS
        if settings.pin_host_buffers:
            offloaded = self.model_params.n_gpu_layers != 0 and bool(
                self.context_params.offload_kqv
            )
            self._buffers.pinner = cuda_pinner(native.backend_name(), offloaded)
        # llama.cpp's device checkpoints view a quantized K/V range as size / type_size
        # *elements* (blocks, not elements: 1/32 of a Q8_0 range is copied), so a restore brings
        # back other cells' bytes; quantized caches keep their checkpoints in host memory instead
        p = self.context_params
        self._on_device = all(t in _DEVICE_CHECKPOINT_TYPES for t in (p.type_k, p.type_v))
        self._sliding_window = int(llama_cpp.llama_model_n_swa(self._model.model)) > 0
        # whether a checkpoint pays here (it always does on the CPU; see tiers/resident_costs)
        self._l1_costs = ResidentCosts()
        resident: ResidentIndex | None = None
        self.l1_budget_tokens = 0
        if self.cache_disabled_reason is None and slots > 0:
            # checkpoints hold their own cells: the default budget of n_ctx tokens keeps the KV
            # memory at most twice what plain Llama takes
            self.l1_budget_tokens = settings.l1.budget_tokens or self.n_ctx()
            resident = ResidentIndex(
                range(1, slots + 1),
                self.l1_budget_tokens,
                settings.page_tokens,
                window=int(llama_cpp.llama_model_n_swa(self._model.model)),
            )
            log.info(
                "skippy-llama: L1 keeps up to %d resident prefixes, %d tokens in all, in %s "
                "(KV memory at most %.1fx plain Llama's)",
                slots,
                self.l1_budget_tokens,
                "device checkpoints" if self._on_device else "host memory (quantized K/V)",
                1 + self.l1_budget_tokens / self.n_ctx(),
            )
        elif self.cache_disabled_reason is not None:
            log.warning("skippy-llama cache disabled: %s", self.cache_disabled_reason)
        self._kv_layout: KVLayout | None = None
        self._layout_read = False
        self._verdict: Verdict | None = None
        if settings.l3.mode != "off":
            # the durable identity and L3's pages need the layout now; L1 alone reads it only
            # when asked (cache_status), so loading costs what plain Llama's does
            self._kv_layout = self.kv_layout
        self.cache_identity = self._identity()
        disk, ram, admission = self._open_tiers()
        self.prefix_cache = PrefixCache(
            identity=self.cache_identity,
            page_tokens=settings.page_tokens,
            resident=resident,
            ram=ram,
            disk=disk,
            admission=admission,
            bytes_per_token=self._kv_layout.bytes_per_token if self._kv_layout else 0,
        )

    def _canonical_granule(self) -> int:
        """Reused prefixes end at multiples of this; every prefill starts at one.

        On GPU builds, and on the CPU with flash attention on, llama.cpp's kernels make K/V bytes
        and logits depend on how a prompt is split into micro-batches. Every prefill is then
        decoded in chunks whose boundaries sit at multiples of ``n_ubatch`` (``Llama.eval``
        splits by ``n_batch``, a multiple of it), and cached cells are reused only up to such
        a boundary, so a cached run decodes exactly the micro-batches a cold one does. On the
        CPU with flash attention off the bytes do not depend on the split for most weight
        types (any token boundary then), but not for all (see :meth:`_split_invariant`), nor
        with a BLAS backend.
        """
        flash = self.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        # a BLAS build hands llama.cpp's matrix products of 32 or more tokens to BLAS (ggml-blas
        # min_batch) and smaller ones to ggml's kernels: too large for the probe to see
        blas = "BLAS" in native.registered_backends()
        if native.backend_name() == "CPU" and not flash and not blas and self._split_invariant():
            return 1
        n_ubatch = int(self.context_params.n_ubatch)
        if self.n_batch % n_ubatch:
            self.cache_disabled_reason = (
                f"n_batch {self.n_batch} is not a multiple of n_ubatch {n_ubatch}: "
                "prefills cannot be split canonically"
            )
        return n_ubatch

    def _split_invariant(self) -> bool:
        """Whether this model's prefill gives every token the same results however the prompt
        is split into batches (asked on the CPU with flash attention off).

        Most weight types do there (SmolLM2 Q4_1: 0 of 70 splits of a 171-token prompt changed
        its last logits), but weights that ggml repacks for the CPU (Q4_0, Q4_K, IQ4_NL on AVX2,
        more on Arm) go through kernels that take a batch's columns in groups, so a token's
        results depend on where its batch starts and ends: Gemma 3 270M Q4_K_M changed its last
        logits at 54 of 70 splits, by up to 1.46 (``benchmarks/probe_split.py``), and an L1 hit
        reused at such a point answered differently from a cold prompt. A short prompt decoded
        whole, then split at several points, decides: any difference and reuse ends on
        ``n_ubatch`` boundaries, as on GPU builds. Costs thirteen decodes of 16 tokens or fewer
        (0.45 s for SmolLM2 on two cores) the first time a model is loaded with given kernel
        settings on a build and CPU; later loads reuse the verdict (``split_verdicts``).
        """
        if self.cache_disabled_reason is not None or self.n_ctx() <= SPLIT_PROBE_TOKENS:
            return False
        return self._kept_verdict("split", self._probe_split)

    def _lone_decodes_exact(self) -> bool:
        """Whether tokens decoded one at a time (a reply being generated) leave the same cells
        and logits as the same tokens in a batched prefill (asked where any batch split is).

        Stock ggml-cpu hands products of one column to ``vec_dot``, which sums in another order
        than the sgemm kernels batches take, so a reply's cells differ from a cold prefill's
        and must be decoded again as a batch before a next turn reuses them (``_repair``, or
        the next prefill): exactness's whole cost in a linear chat. The native patch 0004 sends
        single columns through sgemm too, and this probe then finds them equal, so replies are
        reused as generated. Decodes the split probe's prompt whole, then all but its last
        ``LONE_PROBE_TOKENS`` tokens followed by those one at a time, and compares the
        sequence's state bytes (every cell) and the last logits. Kept like the split verdict.
        """
        if self.n_ctx() <= SPLIT_PROBE_TOKENS + LONE_PROBE_TOKENS:
            return False
        return self._kept_verdict("lone", self._probe_lone)

    def _kept_verdict(self, probe: str, run: Callable[[], bool]) -> bool:
        """``probe``'s verdict for this model, build, CPU and kernel settings: kept, else run."""
        p = self.context_params
        settings = (probe, *(f"{f}={int(getattr(p, f))}" for f in _KERNEL_FIELDS))
        key = split_verdicts.verdict_key(self.model_path, settings)
        verdict = split_verdicts.lookup(key)
        if verdict is None:
            verdict = run()
            split_verdicts.remember(key, verdict)
        return verdict

    def _probe_tokens(self, n: int) -> list[int]:
        """The load-time probes' prompt: ``n`` fixed tokens spread over the vocabulary."""
        return [(7919 * i + 101) % self.n_vocab() for i in range(n)]

    def _probe_lone(self) -> bool:
        vocab = self.n_vocab()
        n = SPLIT_PROBE_TOKENS + LONE_PROBE_TOKENS
        tokens = self._probe_tokens(n)

        def decoded(batched: int) -> tuple[bytes, np.ndarray[Any, Any]]:
            self._drop_working()
            llama_cpp.Llama.eval(self, tokens[:batched])  # plain decodes: no cache involved
            for token in tokens[batched:]:
                llama_cpp.Llama.eval(self, [token])
            cells = bytes(native.get_seq_state(self.ctx, WORKING_SEQ))
            return cells, native.last_logits(self.ctx, vocab)

        try:
            cells, logits = decoded(n)
            lone_cells, lone_logits = decoded(SPLIT_PROBE_TOKENS)
            return cells == lone_cells and np.array_equal(logits, lone_logits)
        finally:
            self._drop_working()

    def _probe_split(self) -> bool:
        vocab = self.n_vocab()
        tokens = self._probe_tokens(SPLIT_PROBE_TOKENS)

        def last_logits(split: int) -> np.ndarray[Any, Any]:
            self._drop_working()
            for part in (tokens[:split], tokens[split:]):
                if part:
                    llama_cpp.Llama.eval(self, part)  # plain decodes: no cache involved
            return native.last_logits(self.ctx, vocab)

        try:
            whole = last_logits(0)
            return all(np.array_equal(last_logits(k), whole) for k in SPLIT_PROBE_AT)
        finally:
            self._drop_working()

    @staticmethod
    def _context_adjuster(n_seq_max: int) -> Any:
        def adjust(params: Any) -> None:
            # embedding contexts keep llama-cpp-python's own multi-sequence setup
            if not params.embeddings and n_seq_max > 1:
                params.n_seq_max = n_seq_max
                # one unified cache: the working sequence sits in cells [0, n) as in plain
                # Llama, and sharing cells with a scratch sequence copies nothing
                params.kv_unified = True

        return adjust

    def _open_tiers(self) -> tuple[DiskTier | None, RamTier | None, AdmissionPolicy | None]:
        """Open L3 (and L2 on top of it) when configured; fail open to L1 only."""
        settings = self.cache_settings
        if settings.l3.mode == "off" or self.kv_layout is None:
            return None, None, None
        if self.cache_identity.n_swa > 0 or not self.kv_layout.pageable:
            # measured by scripts/certify.py (roster/split-certified.json, gemma3 rows): the
            # state of a sliding-window model has a second section holding only the window's
            # cells, swa_full or not, so pages cut from a capture cannot rebuild a shorter
            # prefix; and the patched range export / append import handle plain KV caches only
            log.warning(
                "skippy-llama: SWA model (n_swa=%d): L2/L3 off, L1 only", self.cache_identity.n_swa
            )
            return None, None, None
        admission = AdmissionPolicy()
        l3 = settings.l3
        if l3.compression == "auto":
            # a GPU prefill outruns single-page decompression: store pages as they are there
            codec = "zstd" if native.backend_name() == "CPU" else "none"
            l3 = l3.model_copy(update={"compression": codec})
        # the costs this model measured on this backend in earlier processes, kept in the store
        identity = self.cache_identity
        disk = DiskTier(l3, admission=admission, cost_key=(identity.model.id, identity.backend))
        if not disk.serving:
            log.warning(
                "skippy-llama: L3 is %s (%s); continuing without it", disk.state, disk.reason
            )
        ram = RamTier(settings.l2.budget) if settings.l2.budget else None
        return disk, ram, admission

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

    # -- context and identity -------------------------------------------------------------

    @property
    def kv_layout(self) -> KVLayout | None:
        """The byte layout of this context's KV cells (``None`` when unknown or not caching).

        Read on first use: from one cell of the working sequence when it holds any, otherwise by
        decoding one token into it and dropping it again.
        """
        if not self._layout_read and self.caching:
            try:
                self._kv_layout = self._read_layout()
            except Exception as exc:  # fail-open: without a layout only L1 is used
                log.warning("skippy-llama: could not read the KV layout (%s); L2/L3 disabled", exc)
                self._layout_read = True
            else:
                self._layout_read = self._kv_layout is not None or self.n_tokens == 0
        return self._kv_layout

    def _read_layout(self) -> KVLayout | None:
        if native.seq_pos_max(self.ctx, WORKING_SEQ) >= 0:
            if int(self.context_params.n_seq_max) <= SCRATCH_SEQ:
                return None  # no spare sequence to share one cell with
            one = native.capture_range(self.ctx, WORKING_SEQ, SCRATCH_SEQ, 0, 1)
            return parse_layout(one)
        if self.n_tokens:
            return None  # cleared behind llama-cpp-python's back: probing would hide it
        try:
            self._decode([self.token_bos() if self.token_bos() >= 0 else 0])
            # both sections of a sliding-window model's state: the roster row and identity
            # need its layout even though its states are never paged
            return parse_layout(native.get_seq_state(self.ctx, WORKING_SEQ))
        finally:
            native.seq_rm(self.ctx, WORKING_SEQ)
            self.n_tokens = 0

    @property
    def native_verdict(self) -> Verdict:
        """Whether the loaded llama.cpp carries skippy's patches, certified for this model."""
        if self._verdict is None:
            layout = self.kv_layout
            verdict = native_verdict(
                str(self.metadata.get("general.architecture", "unknown")),
                native.backend_name(),
                layout,
                allow_uncertified=self.cache_settings.native.allow_uncertified,
            )
            if layout is None and not self._layout_read:
                return verdict  # the layout may still become known: decide again then
            self._verdict = verdict
        return self._verdict

    def _identity(self) -> CacheIdentity:
        return build_identity(
            self, self.cache_settings, self.kv_layout, split_dependent=self.granule > 1
        )

    @property
    def caching(self) -> bool:
        return self.cache_disabled_reason is None

    # -- the cached paths -----------------------------------------------------------------

    def _live_exact(self) -> int:
        """Leading tokens of the working sequence whose cells are exact and still present.

        Whole-context calls made behind the cache's back (``_ctx.kv_cache_clear()`` in
        llama-cpp-python's multimodal handlers, ``llama_memory_seq_rm``) remove cells without
        telling it; the cells actually present bound what may be reused.
        """
        exact = min(self._exact, self.n_tokens)
        if exact > 0:
            exact = min(exact, native.seq_pos_max(self.ctx, WORKING_SEQ) + 1)
        return self._aligned(max(exact, 0))

    def _aligned(self, n: int) -> int:
        """``n`` rounded down to a canonical batch boundary (see ``granule``)."""
        return n - n % self.granule

    def _guard(self, step: str, event: CacheEvent | None, work: Any) -> bool:
        """Run one cache step; any exception becomes a counted fallback (fail-open).

        Not only :class:`SkippyError`: a ``ValueError`` from a damaged page or a ``MemoryError``
        from a huge state must never fail a request the model itself can serve.
        """
        try:
            work()
            return True
        except Exception as exc:
            self.prefix_cache.fallback(f"{step}: {type(exc).__name__}")
            if event is not None:
                event.fallbacks.append(f"{step}: {exc}")
            log.warning("skippy-llama: %s failed (%s); continuing without it", step, exc)
            return False

    def _drop_working(self) -> None:
        """Forget the working sequence: the next decode starts a cold prefill."""
        native.seq_rm(self.ctx, WORKING_SEQ)
        self.n_tokens = self._exact = 0

    def _restore(self, tokens: np.ndarray[Any, np.dtype[np.int32]], event: CacheEvent) -> None:
        """Put the longest cached prefix of ``tokens`` into the working sequence."""
        limit = max(len(tokens) - DECODED_SUFFIX, 0)
        exact = self._live_exact()
        live = self._aligned(common_prefix(self.input_ids[:exact].astype(np.int32), tokens[:limit]))
        if self._logits_all:
            # every prompt token's logits row may be read (llm.scores, prompt logprobs), and
            # cells restored from any tier came without theirs (their rows hold zeros or another
            # prompt's): only cells this object decoded are reused, as plain Llama would, and a
            # prompt that leaves them is not parked (nothing would restore it); L3 still records
            live = self._scored = min(live, self._scored)
        if self._sliding_window and 0 < live <= native.seq_pos_max(self.ctx, WORKING_SEQ):
            # a sliding-window cache cut back inside its cells continued with logits off by up
            # to 0.93 on Gemma 3 (plain Llama's prefix reuse too): when in doubt, prefill cold
            live = 0
        if live < exact and not self._logits_all:
            # the prompt leaves the live sequence: keep it resident before it is overwritten
            parking = time.perf_counter()
            self._guard("park", event, lambda: self._displace(exact, event))
            event.park_ms = (time.perf_counter() - parking) * 1e3
        # Llama.generate would reuse the live sequence up to the last token, generated tokens
        # included; only the exact part may be reused
        self.n_tokens = live
        self._exact = live
        if self._logits_all:  # nothing is restored: see above
            event.tier, event.cached_tokens = ("l1" if live else "cold"), live
            return
        found = self.prefix_cache.lookup(
            tokens, limit, live, append=self._can_append(), granule=self.granule
        )
        event.lookup_ms = found.lookup_s * 1e3
        event.fallbacks.extend(found.fallbacks)
        started = time.perf_counter()
        if found.payloads and not self._guard(
            found.tier, event, lambda: self._load_pages(found, tokens, event)
        ):
            # fail open: the working sequence was cleared, so take what L1 alone offers
            self._drop_working()
            found = self.prefix_cache.lookup_resident(tokens, limit)
            found = found.truncated(self._aligned(found.n_tokens))
        if (
            found.tier == "l1"
            and found.seq_id is not None
            and not self._l1_costs.restore_pays(found.n_tokens - live)
        ):
            # on this machine a checkpoint restore costs more than the prefill it saves
            self.prefix_cache.counters.restores_skipped += 1
            found = LookupResult("l1" if live else "cold", live)
        if found.tier == "l1" and found.seq_id is not None:
            hit, slot = found, found.seq_id
            if not self._guard("l1", event, lambda: self._copy_resident(hit, tokens)):
                self._drop_working()
                self._forget_resident(slot)
                found = LookupResult("cold", 0)
        event.restore_ms = (time.perf_counter() - started) * 1e3
        event.tier = found.tier if self.n_tokens > 0 else "cold"
        event.cached_tokens = self.n_tokens

    def _can_append(self) -> bool:
        """Whether an L1 prefix may be continued by L2/L3 pages: the loaded library has append
        import and the roster certifies it for this model (else a deeper hit restores all pages)."""
        return self.prefix_cache.disk is not None and self.native_verdict.append_import

    def _displace(self, exact: int, event: CacheEvent) -> None:
        """Checkpoint the live sequence's exact part; a chat reply after it is repaired first.

        Done only when a prompt leaves the live sequence, never after each reply: a linear chat,
        whose next prompt extends the reply, decodes the reply inside its next prefill (one
        batch, as a cold prefill would) and pays nothing here.
        """
        mode = self.cache_settings.l1.repair_generated
        repair = mode == "always" or (mode == "auto" and self._reply_repairable)
        if repair and exact == self._aligned(self._reply_start) and self._gains_boundary(exact):
            event.repaired_tokens = self._repair(self._aligned(self._reply_start))
            exact = self._exact
        self._park(exact)

    def _gains_boundary(self, exact: int) -> bool:
        """Whether re-decoding the cells after ``exact`` makes more of them exact: only up to
        the last canonical boundary (the cells after it are decoded again by the next prefill
        on a batch-split-sensitive backend), so a reply inside one granule gains nothing."""
        return self._aligned(self.n_tokens) > exact

    def _exact_tokens(self) -> int:
        return min(self._exact, self.n_tokens)

    def _decode(self, tokens: Sequence[int]) -> None:
        """``Llama.eval`` without the cache, tracking which cells are exact.

        A batch of two or more tokens right after the exact part extends it; a lone token (a
        generated one) takes other kernels, so the exact part stops before it, unless the
        build decodes lone tokens exactly (``lone_decodes_exact``).
        """
        before = self.n_tokens
        exact = self._exact_tokens()
        super().eval(tokens)
        if before <= self._scored:
            self._scored = self.n_tokens
        batched = (len(tokens) >= 2 or self.lone_decodes_exact) and exact == before
        self._exact = self._aligned(self.n_tokens) if batched else exact

    def _load_pages(
        self, found: LookupResult, tokens: np.ndarray[Any, Any], event: CacheEvent
    ) -> None:
        """Assemble L2/L3 pages into a blob and restore it into the working sequence.

        An append plan first puts its L1 prefix in place (the live sequence cut to it, or a
        checkpoint copied on the device) and append-imports only the pages' cells after it;
        any other plan rebuilds the whole prefix with one ``set_data``.
        """
        assert self.kv_layout is not None
        started = time.perf_counter()
        base = found.base_tokens
        pages = [
            page_from_bytes(p).head(n) for p, n in zip(found.payloads, found.uses, strict=True)
        ]
        if base:
            if not pages or not pages[0].start <= base < pages[0].end:
                raise StateFormatError("the append plan's first page does not reach past L1")
            pages[0] = pages[0].span(base, pages[0].end)
        if base + sum(p.n_tokens for p in pages) != found.n_tokens:
            raise StateFormatError("restored pages do not cover the planned prefix")
        size = assembled_size(pages, self.kv_layout, start=base)
        buf = self._buffers.take(size)
        try:
            assemble_into(buf, pages, self.kv_layout, seq_id=WORKING_SEQ, start=base)
            if base:
                self._place_base(found)
                if not native_ext.append_import(self.ctx, memoryview(buf)[:size], WORKING_SEQ):
                    raise TierError("skippy_state_seq_append_data refused the pages")
                event.l1_tokens, event.appended_tokens = base, found.n_tokens - base
            elif not native.set_seq_state(self.ctx, buf, WORKING_SEQ, size):
                raise TierError("llama_state_seq_set_data refused the blob")
        finally:
            self._buffers.give(buf)
        self._adopt(tokens, found.n_tokens)
        event.restored_bytes = size
        if self.prefix_cache.admission is not None:
            # the whole restore, reads and decompression in the lookup included
            self.prefix_cache.admission.costs.observe_restore(
                size, time.perf_counter() - started + found.lookup_s, ram=found.tier == "l2"
            )

    def _place_base(self, found: LookupResult) -> None:
        """Leave exactly the L1 prefix of an append plan in the working sequence."""
        base = found.base_tokens
        if found.base_seq_id is not None:
            resident = self.prefix_cache.resident
            assert resident is not None
            handle = resident.entry(found.base_seq_id).handle
            native.restore_checkpoint(self.ctx, handle, WORKING_SEQ)
        elif native.seq_pos_max(self.ctx, WORKING_SEQ) + 1 < base:
            raise TierError("the live sequence no longer holds the append plan's L1 prefix")
        # append import continues after the last position: nothing may follow the prefix
        native.seq_rm(self.ctx, WORKING_SEQ, base, -1)

    def _adopt(self, tokens: np.ndarray[Any, Any], n: int) -> None:
        """The working sequence now holds the exact cells of ``tokens[:n]``."""
        self.input_ids[:n] = tokens[:n]
        self.n_tokens = self._exact = n
        self._requires_eval = True

    def _copy_resident(self, found: LookupResult, tokens: np.ndarray[Any, Any]) -> None:
        """Copy a checkpoint into the working sequence and keep its first ``n_tokens`` cells."""
        resident = self.prefix_cache.resident
        assert found.seq_id is not None and resident is not None
        handle = resident.entry(found.seq_id).handle
        started = time.perf_counter()
        native.restore_checkpoint(self.ctx, handle, WORKING_SEQ, on_device=self._on_device)
        self._l1_costs.observe_restore(time.perf_counter() - started)
        native.seq_rm(self.ctx, WORKING_SEQ, found.n_tokens, -1)
        self._adopt(tokens, found.n_tokens)

    def _forget_resident(self, seq_id: int) -> None:
        resident = self.prefix_cache.resident
        if resident is not None:
            resident.remove(seq_id)

    def _park(self, n_tokens: int) -> None:
        """Checkpoint the first ``n_tokens`` of the working sequence for later prompts."""
        resident = self.prefix_cache.resident
        n_tokens = min(n_tokens, self.n_tokens)
        if resident is None or n_tokens == 0:
            return
        tokens = self.input_ids[:n_tokens].astype(np.int32)
        plan = resident.plan_park(tokens) if self._l1_costs.park_pays(n_tokens) else None
        if plan is None:
            self.prefix_cache.counters.park_skipped += 1
            return
        try:
            for slot in plan.evict:
                if slot != plan.seq_id and self._on_device:
                    # a slot keeps its buffers until its next checkpoint: shrink it to one cell
                    native.checkpoint(self.ctx, WORKING_SEQ, slot, 1)
            started = time.perf_counter()
            handle = native.checkpoint(
                self.ctx, WORKING_SEQ, plan.seq_id, plan.n_tokens, on_device=self._on_device
            )
            self._l1_costs.observe_park(time.perf_counter() - started)
        except BaseException:
            resident.abandon_park(plan)
            raise
        resident.commit_park(plan, self.prefix_cache.root, tokens, handle)
        self.prefix_cache.counters.parked += 1

    def generate(  # type: ignore[override]
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, Sequence[int] | None, None]:
        """``Llama.generate`` that first restores the longest cached prefix of ``tokens``."""
        reset = kwargs.get("reset", True)
        if not self.caching or not reset or len(tokens) == 0:
            return (yield from super().generate(tokens, *args, **kwargs))
        self._epoch += 1
        epoch = self._epoch
        prompt = np.asarray(tokens, dtype=np.int32)
        event = CacheEvent(prompt_tokens=len(prompt))
        started = time.perf_counter()
        self._record_unless_continued(prompt)
        self._restore(prompt, event)
        self._in_generate = True

        self._last_sampled = None

        def seen(i: int, token: int) -> None:
            # the caller stops after a token without evaluating it (end of generation, length)
            self._last_sampled = token
            if i:
                return
            event.ttft_ms = (time.perf_counter() - started) * 1e3
            event.prefill_ms = event.ttft_ms - event.park_ms - event.lookup_ms - event.restore_ms
            suffix = event.prompt_tokens - event.cached_tokens
            self._l1_costs.observe_prefill(suffix, event.prefill_ms / 1e3)

        try:
            yield from on_tokens(super().generate(tokens, *args, **kwargs), seen)
        finally:
            # a stream abandoned by its caller is finalized whenever it is collected, maybe in
            # the middle of a newer request: then it must leave the working sequence alone
            if epoch == self._epoch:
                self._in_generate = False
                event.suffix_tokens = event.prompt_tokens - event.cached_tokens
                self._reply_start = len(prompt)
                self._reply_repairable = self._chat_request
                self.last_cache_event = event
                self._guard("record", None, lambda: self._record(event))

    def _record(self, event: CacheEvent) -> None:
        """Queue the exact part of the working sequence for L3, as far as a repeat can use it.

        A repeat of the prompt decodes its last two tokens (see ``DECODED_SUFFIX``) and reuses
        whole granules only (see ``_canonical_granule``). Only what L3 lacks
        is captured and written: the record continues the stored page tree where this prompt
        leaves it, and only the cells of its new pages are serialized.
        """
        cache = self.prefix_cache
        if cache.disk is None or self.kv_layout is None or not self.kv_layout.pageable:
            return
        admission = cache.admission
        if (
            admission is not None
            and event.suffix_tokens >= cache.page_tokens
            and event.prefill_ms > 0
        ):
            admission.costs.observe_prefill(event.suffix_tokens, event.prefill_ms / 1e3)
        # as far as a repeat of this prompt can reuse: not its last DECODED_SUFFIX tokens
        point = min(self._exact_tokens(), self._aligned(event.prompt_tokens - DECODED_SUFFIX))
        if self._record_may_wait(point):
            self._deferred = point
            cache.counters.records_deferred += 1
            return
        self._record_prefix(point)

    def _record_may_wait(self, point: int) -> bool:
        """Whether the record up to ``point`` may wait (see ``defer_record_tokens``)."""
        base = self._recorded
        return (
            base is not None
            and 0 < len(base) <= point < len(base) + self.defer_record_tokens
            and np.array_equal(self.input_ids[: len(base)], base)
        )

    def _record_unless_continued(self, tokens: np.ndarray[Any, np.dtype[np.int32]]) -> None:
        """Make a waiting record now, unless ``tokens`` (the next prompt) continue it."""
        point = self._deferred
        if point and not (
            len(tokens) >= point and np.array_equal(tokens[:point], self.input_ids[:point])
        ):
            self._record_deferred()

    def _record_deferred(self) -> None:
        """Make a waiting record now, before the working sequence changes (or while idle)."""
        point = self._deferred
        if point:
            self._guard("record", None, lambda: self._record_prefix(point))

    def _record_prefix(self, point: int) -> None:
        """Queue the working sequence's first ``point`` tokens, as far as they are exact."""
        cache = self.prefix_cache
        assert self.kv_layout is not None
        self._deferred = 0
        # a waiting record may find cells cleared behind the cache's back since
        point = min(point, self._live_exact())
        tokens = self.input_ids[: max(point, 0)].astype(np.int32)
        self._recorded = tokens
        plan = cache.plan_record(tokens, point)
        if plan is None:
            return
        start = plan.new[0][2] if plan.new else point
        blob = self._capture(start, point)
        # the L3 writer cuts the pages out of the capture later, then gives its buffer back
        release = functools.partial(self._buffers.give, cast(HostBuffer, blob.obj))
        try:
            state = parse_state(blob, first=start)
            if state.layout.digest() != self.kv_layout.digest():
                raise StateFormatError("captured state does not match the probed KV layout")
        except BaseException:
            release()
            raise
        cache.record(plan, state, tokens, release)

    def _capture(self, start: int, end: int) -> memoryview:
        """The working sequence's cells at positions ``[start, end)``, in the stock format, in
        a buffer taken from the pool (``view.obj``; the caller gives it back).

        The patched range export where the roster certifies it, else the stock path (cells
        shared with a scratch sequence and serialized from there); both cost O(end - start).
        """
        buf = self._buffers.take()
        view: memoryview | None = None
        if self.native_verdict.range_export:
            try:
                view = native_ext.range_export(self.ctx, WORKING_SEQ, start, end, buf)
            except TierError as exc:
                log.warning("skippy-llama: range export failed (%s); using the stock path", exc)
        if view is None:
            try:
                view = native.capture_range(self.ctx, WORKING_SEQ, SCRATCH_SEQ, start, end, buf)
            except BaseException:
                self._buffers.give(buf)
                raise
        assert isinstance(view.obj, bytearray | mmap.mmap)
        if view.obj is not buf:  # outgrown: the call wrote a fresh buffer
            self._buffers.retire(buf)
        return view

    def close(self) -> None:
        """Free the model and context; pending L3 writes are flushed first (bounded wait)."""
        cache = getattr(self, "prefix_cache", None)
        if cache is not None and cache.disk is not None:
            self._record_deferred()
            cache.disk.close()
        buffers = getattr(self, "_buffers", None)
        if buffers is not None:
            buffers.clear()
        super().close()

    def _repair(self, start: int, ahead: Sequence[int] = ()) -> int:
        """Re-decode the working sequence from ``start`` (the last reply's canonical boundary)
        as one batch so its cells equal a cold prefill's, and decode ``ahead`` (tokens predicted
        to follow it) in the same batch.

        Tokens decoded one at a time take llama.cpp's single-row kernels, whose results differ
        in the low bits from the batched prefill a cold prompt would get; keeping them as they
        are would make a later turn's output depend on the cache. Returns the tokens decoded.
        """
        tokens = [*self.input_ids[start : self.n_tokens].tolist(), *ahead]
        native.seq_rm(self.ctx, WORKING_SEQ, start, -1)
        self.n_tokens = start
        self._decode(tokens)
        return len(tokens)

    def prepare_next_turn(self) -> int:
        """Do now what the next request would otherwise do first: re-decode the last reply,
        and keep the chat resident when several chats take turns.

        A reply's tokens are decoded one at a time, and those cells differ in the low bits from
        the batched prefill a cold prompt gets; so a next turn that extends the reply decodes
        the reply again inside its own prefill (exactness, see ``l1.repair_generated``). Called
        while nothing else is waiting (a chat app while its user types; ``skippy-llama serve``
        when no request follows a reply within ``--idle-repair-after``), this re-decodes the
        reply as one batch, on the same canonical boundaries a cold prefill uses, so the next
        turn reuses it and prefills only its new tokens. After a chat reply the batch also
        holds the tokens the chat template puts before the next user message (``chat_head.py``),
        which the next prompt then reuses too. Where lone decodes are exact
        (``lone_decodes_exact``) the reply is reusable as generated, and only that head (with
        the reply's last sampled token) is decoded. Outputs do not change: the cells are those a
        cold prefill computes, and a next prompt that does not continue that way keeps only
        what matches. Like every ``Llama`` method it must not run concurrently
        with another call on the same object.

        Once a prompt has left the live sequence in this process (several chats or documents
        take turns), the prepared chat is also checkpointed as a resident prefix now
        (``parked_ahead``), so a request from another chat restores its own prefix without
        first checkpointing this one. A single linear chat never displaces its live sequence
        and pays no checkpoint here. An L3 record left waiting (``defer_record_tokens``) is
        made here too.

        Returns:
            the tokens decoded: 0 when there is nothing to do (no reply in the live
            sequence, already prepared, caching off, or a streamed reply still being read).
        """
        if not self.caching or self._in_generate:
            return 0
        self._record_deferred()  # idle time: the capture costs no request anything
        exact = self._live_exact()
        if self.lone_decodes_exact and exact == self.n_tokens > self._reply_start:
            start = exact  # the reply is exact as generated: only what follows it is left
        # one token alone cannot be decoded as a batch: the next prefill takes it along
        elif (
            exact != self._aligned(self._reply_start)
            or not self._gains_boundary(exact)
            or self.n_tokens - exact < 2
        ):
            return 0
        else:
            start = self._aligned(self._reply_start)
        ahead = self._predicted_continuation() if self._reply_repairable else []
        if start == self.n_tokens:
            self._last_sampled = None  # decoded now: a second call predicts nothing more
            if not ahead:
                return 0
        repaired: list[int] = []
        if not self._guard("prepare", None, lambda: repaired.append(self._repair(start, ahead))):
            self._drop_working()  # a half-repaired reply is neither the old cells nor exact
            return 0
        counters = self.prefix_cache.counters
        counters.turns_prepared += 1
        counters.tokens_prepared += repaired[0]
        if counters.parked:
            parked = counters.parked
            # a failed checkpoint leaves the working sequence as it was: the next request parks
            self._guard("park", None, lambda: self._park(self._exact_tokens()))
            counters.parked_ahead += counters.parked - parked
        return repaired[0]

    def _predicted_continuation(self) -> list[int]:
        """How a chat's next prompt continues the live reply: its last sampled token, which the
        reply's text holds unless it ended the generation, then the template's head (see
        ``chat_head.py``; found once per model). Empty where the template gives no head."""
        if self._head is None:
            self._head = template_head(self)
        last = self._last_sampled
        if not self._head or last is None:
            return []
        if llama_cpp.llama_vocab_is_eog(self._model.vocab, last):
            return self._head  # the template writes its own end of turn
        return [last, *self._head]

    def eval(self, tokens: Sequence[int]) -> None:
        """``Llama.eval`` that restores a cached prefix first when called on its own.

        Inside ``generate`` the prefix was already restored, so this is plain decoding.
        """
        if self._in_generate or not self.caching or len(tokens) < 2:
            self._decode(tokens)
            return
        self._epoch += 1
        whole = np.concatenate(
            [self.input_ids[: self.n_tokens].astype(np.int32), np.asarray(tokens, np.int32)]
        )
        event = CacheEvent(prompt_tokens=len(whole))
        started = time.perf_counter()
        self._record_unless_continued(whole)
        self._restore(whole, event)
        self._decode(whole[self.n_tokens :].tolist())
        elapsed_ms = (time.perf_counter() - started) * 1e3
        event.prefill_ms = elapsed_ms - event.park_ms - event.lookup_ms - event.restore_ms
        event.suffix_tokens = event.prompt_tokens - event.cached_tokens
        self._l1_costs.observe_prefill(event.suffix_tokens, event.prefill_ms / 1e3)
        self._reply_start, self._reply_repairable = len(whole), False
        self.last_cache_event = event
        self._guard("record", None, lambda: self._record(event))

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
        self._record_deferred()
        if self._live_exact() > 0:
            event = CacheEvent()
            self._guard("park", event, lambda: self._displace(self._live_exact(), event))

    def reset(self) -> None:
        """``Llama.reset``; the live sequence stays reusable as a resident prefix."""
        self._leave_live()
        super().reset()  # type: ignore[no-untyped-call]
        self._exact = 0

    def save_state(self) -> llama_cpp.LlamaState:
        """``Llama.save_state``; the state also remembers which of its cells are exact.

        Resident prefixes live in checkpoints outside the KV cells, so the state holds the
        working sequence alone, exactly as plain ``Llama``'s does.
        """
        state = super().save_state()
        state.skippy_exact = self._exact_tokens()  # type: ignore[attr-defined]
        state.skippy_scored = min(self._scored, self.n_tokens)  # type: ignore[attr-defined]
        return state

    def load_state(self, state: llama_cpp.LlamaState) -> None:
        """``Llama.load_state``; resident prefixes stay valid (they are not in the KV cells).

        Cells of a state saved elsewhere are trusted as exact only when this class saved it.
        """
        self._leave_live()
        super().load_state(state)
        self._exact = min(int(getattr(state, "skippy_exact", 0)), self.n_tokens)
        self._scored = min(int(getattr(state, "skippy_scored", 0)), self.n_tokens)
        self._reply_repairable = False

    def clear_cache(self) -> None:
        """Drop every resident prefix (L1)."""
        resident = self.prefix_cache.resident
        if resident is not None:
            resident.clear()

    def cache_status(self) -> dict[str, Any]:
        """In-process cache state: L1 memory and counters (what ``kv-cache status`` cannot see)."""
        resident = self.prefix_cache.resident
        per_token = self.kv_layout.kv_bytes_per_cell if self.kv_layout is not None else 0
        counters = self.prefix_cache.counters
        return {
            "caching": self.caching,
            "disabled_reason": self.cache_disabled_reason,
            "n_ctx": self.n_ctx(),
            "granule": self.granule,
            "lone_decodes_exact": self.lone_decodes_exact,
            "pinned_host_buffers": pinner.stats() if (pinner := self._buffers.pinner) else None,
            "native": self.native_verdict.to_json(),
            "kv_bytes_per_token": per_token,
            "context_kv_bytes": per_token * self.n_ctx(),
            "l1": {
                "slots": len(resident.entries()) if resident is not None else 0,
                "max_prefixes": self.cache_settings.l1.max_prefixes if resident else 0,
                "budget_tokens": self.l1_budget_tokens,
                "budget_bytes": per_token * self.l1_budget_tokens,
                "resident_tokens": resident.used_tokens if resident is not None else 0,
                "resident_bytes": per_token * (resident.used_tokens if resident else 0),
            },
            "counters": {
                "lookups": counters.lookups,
                "hits": dict(counters.hits),
                "misses": counters.misses,
                "fallbacks": dict(counters.fallbacks),
                "parked": counters.parked,
                "parked_ahead": counters.parked_ahead,
                "records": counters.records,
                "restores_skipped": counters.restores_skipped,
                "turns_prepared": counters.turns_prepared,
                "tokens_prepared": counters.tokens_prepared,
            },
        }
