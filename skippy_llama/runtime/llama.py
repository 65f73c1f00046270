"""``SkippyLlama``: a drop-in ``llama_cpp.Llama`` whose prompts reuse cached KV prefixes.

The context is re-created with one KV stream per sequence: sequence 0 is the working sequence
``llama_cpp.Llama`` always uses, and sequences 1..N hold resident prefixes (L1). Before a prompt
is prefilled, the longest cached prefix (L1, else L2/L3 pages) is put into sequence 0 and only
the suffix is decoded; after a request, the part of the sequence that was decoded in batches
(as a cold prefill would have) is parked and recorded: a lone generated token is never reused.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import llama_cpp
import llama_cpp._internals as internals
import numpy as np

from ..admission import AdmissionPolicy
from ..cache import LookupResult, PrefixCache
from ..config import Settings, load_settings
from ..errors import SkippyError, StateFormatError
from ..events import CacheEvent
from ..identity import CacheIdentity, ModelIdentity, file_digest, paging_refusal
from ..packages.kvdtype import KVDtypeResolution, resolve_kv_dtype
from ..packages.loader import LoadedPackage, load_package
from ..state import KVLayout, assemble, page_from_bytes, parse_state
from ..tiers.disk import DiskTier
from ..tiers.ram import RamTier
from ..tiers.resident import ResidentIndex, common_prefix
from . import native
from .timing import on_first_token

log = logging.getLogger("skippy_llama")

WORKING_SEQ = 0
#: Prompt tokens always decoded, never restored. llama.cpp decodes a lone token with other
#: kernels than a batch, and its logits then differ from a cold prefill's (measured: up to 0.66
#: on SmolLM2); two or more tokens decode bit-identically.
DECODED_SUFFIX = 2


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
        self._chat_request = False  # inside create_chat_completion: the next turn extends the reply
        self._copy_pending = False
        # leading working-sequence tokens whose cells equal a batched (cold) prefill's
        self._exact = 0
        super().__init__(model_path, **kwargs)
        self.cache_disabled_reason: str | None = None
        if self.context_params.embeddings:
            self.cache_disabled_reason = "embedding contexts are not cached"
        elif self._is_recurrent or self._is_hybrid:
            arch = str(self.metadata.get("general.architecture", "unknown"))
            self.cache_disabled_reason = paging_refusal(arch, (), recurrent=True)
        settings = self.cache_settings
        self._n_ctx_user = self._n_ctx
        slots = settings.l1.max_prefixes if settings.l1.enabled else 0
        # each resident prefix owns a preallocated KV stream, so by default every slot may fill
        budget = settings.l1.budget_tokens or self._n_ctx_user * slots
        resident: ResidentIndex | None = None
        if self.cache_disabled_reason is None and slots > 0:
            self._recreate_context(n_seq_max=1 + slots)
            resident = ResidentIndex(range(1, slots + 1), budget, settings.page_tokens)
        elif self.cache_disabled_reason is not None:
            log.warning("skippy-llama cache disabled: %s", self.cache_disabled_reason)
        self.kv_layout = self._probe_layout() if self.cache_disabled_reason is None else None
        self.cache_identity = self._identity()
        disk, ram, admission = self._open_tiers()
        self.prefix_cache = PrefixCache(
            identity=self.cache_identity,
            page_tokens=settings.page_tokens,
            resident=resident,
            ram=ram,
            disk=disk,
            admission=admission,
        )

    def _open_tiers(self) -> tuple[DiskTier | None, RamTier | None, AdmissionPolicy | None]:
        """Open L3 (and L2 on top of it) when configured; fail open to L1 only."""
        settings = self.cache_settings
        if settings.l3.mode == "off" or self.kv_layout is None:
            return None, None, None
        if self.cache_identity.n_swa > 0:
            # sliding-window models mask old cells per layer; pages of them are not certified
            log.warning(
                "skippy-llama: SWA model (n_swa=%d): L2/L3 off, L1 only", self.cache_identity.n_swa
            )
            return None, None, None
        admission = AdmissionPolicy()
        disk = DiskTier(settings.l3, admission=admission)
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
        if resolution.type_v not in ("F16", "F32", "BF16") and "flash_attn" not in kwargs:
            kwargs["flash_attn"] = True
        kwargs.update(resolution.llama_kwargs())
        llm = cls(str(package.gguf_path), **kwargs)
        llm.model_package = package
        llm.kv_dtype = resolution
        return llm

    # -- context and identity -------------------------------------------------------------

    def _recreate_context(self, *, n_seq_max: int) -> None:
        # Llama.__init__ offers no n_seq_max, so the context it made is replaced by one with a
        # KV stream per sequence. Streams, not one unified cache: attention sums over cells in
        # cell order, so a prefix is only bit-exact when the working sequence sits in cells
        # [0, n) exactly as in a cold run; a cross-stream copy keeps every cell index.
        params = llama_cpp.llama_context_params.from_buffer_copy(self.context_params)
        params.n_ctx = self._n_ctx_user * n_seq_max
        params.n_seq_max = n_seq_max
        params.kv_unified = False
        self._ctx.close()  # type: ignore[no-untyped-call]
        self._ctx = self._stack.enter_context(
            contextlib.closing(
                internals.LlamaContext(model=self._model, params=params, verbose=self.verbose)
            )
        )
        if self._lora_adapter is not None:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self._lora_adapter)  # type: ignore[misc]
            scales = (ctypes.c_float * 1)(self.lora_scale)
            llama_cpp.llama_set_adapters_lora(self._ctx.ctx, adapters, 1, scales)
        self.n_tokens = 0

    def _scratch_decode(self) -> None:
        """Decode one token into an emptied working sequence (the caller drops it again)."""
        native.seq_rm(self.ctx, WORKING_SEQ)
        self.n_tokens = 0
        self._decode([self.token_bos() if self.token_bos() >= 0 else 0])

    def _probe_layout(self) -> KVLayout | None:
        """Decode one token into the working sequence to read the live KV layout, then drop it."""
        try:
            self._scratch_decode()
            return parse_state(native.get_seq_state(self.ctx, WORKING_SEQ)).layout
        except Exception as exc:  # fail-open: without a layout only L1 is used
            log.warning("skippy-llama: could not read the KV layout (%s); L2/L3 disabled", exc)
            return None
        finally:
            native.seq_rm(self.ctx, WORKING_SEQ)
            self.n_tokens = 0

    def _identity(self) -> CacheIdentity:
        model = self._model.model
        meta = self.metadata
        geometry: dict[str, int | float | str] = {
            "n_layer": int(llama_cpp.llama_model_n_layer(model)),
            "n_embd": int(llama_cpp.llama_model_n_embd(model)),
            "n_head": int(llama_cpp.llama_model_n_head(model)),
            "n_head_kv": int(llama_cpp.llama_model_n_head_kv(model)),
            "n_vocab": int(self._n_vocab),
            "n_ctx_train": int(llama_cpp.llama_model_n_ctx_train(model)),
        }
        p = self.context_params
        layout = self.kv_layout
        return CacheIdentity(
            model=ModelIdentity(
                digest=file_digest(self.model_path),
                architecture=str(meta.get("general.architecture", "unknown")),
                geometry=geometry,
                name=Path(self.model_path).name,
            ),
            layout_digest=layout.digest() if layout is not None else "none",
            type_k=int(p.type_k),
            type_v=int(p.type_v),
            flash_attn=p.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            v_trans=bool(layout.v_trans) if layout is not None else False,
            rope_freq_base=float(p.rope_freq_base),
            rope_freq_scale=float(p.rope_freq_scale),
            yarn=(
                float(p.yarn_ext_factor),
                float(p.yarn_attn_factor),
                float(p.yarn_beta_fast),
                float(p.yarn_beta_slow),
                float(p.yarn_orig_ctx),
                float(p.rope_scaling_type),
            ),
            n_swa=int(llama_cpp.llama_model_n_swa(model)),
            kv_unified=False,
            backend="any" if self.cache_settings.cross_backend else native.backend_name(),
            namespace=self.cache_settings.namespace,
        )

    def n_ctx(self) -> int:
        """The context window the caller asked for (spare resident cells are not counted)."""
        return getattr(self, "_n_ctx_user", None) or super().n_ctx()

    @property
    def caching(self) -> bool:
        return self.cache_disabled_reason is None

    # -- the cached paths -----------------------------------------------------------------

    def _restore(self, tokens: np.ndarray[Any, np.dtype[np.int32]], event: CacheEvent) -> None:
        """Put the longest cached prefix of ``tokens`` into the working sequence."""
        limit = max(len(tokens) - DECODED_SUFFIX, 0)
        exact = self._exact_tokens()
        live = common_prefix(self.input_ids[:exact].astype(np.int32), tokens[:limit])
        # Llama.generate would reuse the live sequence up to the last token, generated tokens
        # included; only the exact part may be reused
        self.n_tokens = min(exact, limit)
        found = self.prefix_cache.lookup(tokens, limit, live)
        event.lookup_ms = found.lookup_s * 1e3
        event.fallbacks.extend(found.fallbacks)
        started = time.perf_counter()
        if found.payloads and not self._load_pages(found, tokens, event):
            # fail open: the working sequence was cleared, so take what L1 alone offers
            found = self.prefix_cache.lookup_resident(tokens, limit)
        if found.tier == "l1" and found.seq_id is not None:
            self._copy_resident(found, tokens)
        event.restore_ms = (time.perf_counter() - started) * 1e3
        event.tier = found.tier
        event.cached_tokens = found.n_tokens

    def _exact_tokens(self) -> int:
        return min(self._exact, self.n_tokens)

    def _decode(self, tokens: Sequence[int]) -> None:
        """``Llama.eval`` without the cache: every decode also applies queued stream copies.

        A batch of two or more tokens right after the exact part extends it; a lone token (a
        generated one) takes other kernels, so the exact part stops before it.
        """
        before = self.n_tokens
        exact = self._exact_tokens()
        super().eval(tokens)
        self._copy_pending = False
        self._exact = self.n_tokens if len(tokens) >= 2 and exact == before else exact

    def _apply_pending_copies(self) -> None:
        """Make llama.cpp carry out queued stream copies before stream 0 is overwritten.

        A cross-stream ``seq_cp`` only copies buffers at the next decode; writing stream 0 with
        ``set_data`` before that would let a parked prefix pick up the restored bytes. A one-token
        decode (dropped again right away) is the public way to run the copy.
        """
        if not self._copy_pending:
            return
        self._scratch_decode()
        native.seq_rm(self.ctx, WORKING_SEQ)
        self.n_tokens = 0

    def _load_pages(
        self, found: LookupResult, tokens: np.ndarray[Any, Any], event: CacheEvent
    ) -> bool:
        """Assemble L2/L3 pages into a blob and restore it into the working sequence."""
        assert self.kv_layout is not None
        started = time.perf_counter()
        try:
            pages = [
                page_from_bytes(p).head(n) for p, n in zip(found.payloads, found.uses, strict=True)
            ]
            blob = assemble(pages, self.kv_layout, seq_id=WORKING_SEQ)
            if sum(p.n_tokens for p in pages) != found.n_tokens:
                raise StateFormatError("restored pages do not cover the planned prefix")
            self._apply_pending_copies()
            ok = native.set_seq_state(self.ctx, blob, WORKING_SEQ)
        except SkippyError as exc:
            ok = False
            event.fallbacks.append(f"{found.tier}: {exc}")
            self.prefix_cache.fallback(type(exc).__name__)
        if not ok:
            native.seq_rm(self.ctx, WORKING_SEQ)
            self.n_tokens = 0
            if not event.fallbacks:
                event.fallbacks.append(f"{found.tier}: llama_state_seq_set_data refused the blob")
                self.prefix_cache.fallback("set_data_refused")
            return False
        self.input_ids[: found.n_tokens] = tokens[: found.n_tokens]
        self.n_tokens = self._exact = found.n_tokens
        self._requires_eval = True
        event.restored_bytes = len(blob)
        if self.prefix_cache.admission is not None:
            self.prefix_cache.admission.costs.observe_restore(
                len(blob), time.perf_counter() - started
            )
        return True

    def _copy_resident(self, found: LookupResult, tokens: np.ndarray[Any, Any]) -> None:
        assert found.seq_id is not None
        native.copy_stream(self.ctx, found.seq_id, WORKING_SEQ, keep=found.n_tokens)
        self._copy_pending = True
        self.input_ids[: found.n_tokens] = tokens[: found.n_tokens]
        self.n_tokens = self._exact = found.n_tokens
        self._requires_eval = True

    def _park(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` of the working sequence resident for later prompts."""
        resident = self.prefix_cache.resident
        n_tokens = min(n_tokens, self.n_tokens)
        if resident is None or n_tokens == 0:
            return
        tokens = self.input_ids[:n_tokens].astype(np.int32)
        plan = resident.plan_park(tokens)
        if plan is None:
            self.prefix_cache.counters.park_skipped += 1
            return
        for seq_id in plan.evict:
            native.seq_rm(self.ctx, seq_id)
        native.copy_stream(self.ctx, WORKING_SEQ, plan.seq_id, keep=plan.n_tokens)
        self._copy_pending = True
        resident.commit_park(plan, self.prefix_cache.root, tokens)
        self.prefix_cache.counters.parked += 1

    def generate(  # type: ignore[override]
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, Sequence[int] | None, None]:
        """``Llama.generate`` that first restores the longest cached prefix of ``tokens``."""
        reset = kwargs.get("reset", True)
        if not self.caching or not reset or len(tokens) == 0:
            return (yield from super().generate(tokens, *args, **kwargs))
        prompt = np.asarray(tokens, dtype=np.int32)
        event = CacheEvent(prompt_tokens=len(prompt))
        started = time.perf_counter()
        self._restore(prompt, event)
        self._in_generate = True

        def first() -> None:
            event.ttft_ms = (time.perf_counter() - started) * 1e3
            event.prefill_ms = event.ttft_ms - event.lookup_ms - event.restore_ms

        try:
            yield from on_first_token(super().generate(tokens, *args, **kwargs), first)
        finally:
            self._in_generate = False
            event.suffix_tokens = event.prompt_tokens - event.cached_tokens
            event.repaired_tokens = self._repair(len(prompt))
            self.last_cache_event = event
            self._park(self._exact_tokens())
            self._record(event)

    def _record(self, event: CacheEvent) -> None:
        """Queue the exact part of the working sequence for L3, but its last two tokens.

        A repeat of the prompt cannot use those two (see ``DECODED_SUFFIX``). Only what L3 lacks
        is captured and written: the record continues the stored page tree where this prompt
        leaves it, so a prompt that branched off a stored prefix adds just its own tokens.
        """
        cache = self.prefix_cache
        if cache.disk is None or self.kv_layout is None:
            return
        admission = cache.admission
        if (
            admission is not None
            and event.suffix_tokens >= cache.page_tokens
            and event.prefill_ms > 0
        ):
            admission.costs.observe_prefill(event.suffix_tokens, event.prefill_ms / 1e3)
        point = self._exact_tokens() - DECODED_SUFFIX
        tokens = self.input_ids[: max(point, 0)].astype(np.int32)
        plan = cache.plan_record(tokens, point)
        if plan is None:
            return
        try:
            state = parse_state(native.get_seq_state(self.ctx, WORKING_SEQ))
            if state.layout.digest() != self.kv_layout.digest():
                raise StateFormatError("captured state does not match the probed KV layout")
            cache.record(plan, state, tokens)
        except SkippyError as exc:  # fail open: the request already succeeded
            cache.fallback(f"record: {type(exc).__name__}")
            log.warning("skippy-llama: could not record the prefix for L3: %s", exc)

    def close(self) -> None:
        """Free the model and context; pending L3 writes are flushed first (bounded wait)."""
        cache = getattr(self, "prefix_cache", None)
        if cache is not None and cache.disk is not None:
            cache.disk.close()
        super().close()

    def _repair(self, n_prompt: int) -> int:
        """Re-decode generated tokens as one batch so their cells equal a cold prefill's.

        Tokens decoded one at a time take llama.cpp's single-row kernels, whose results differ
        in the low bits from the batched prefill a cold prompt would get; parking them as they
        are would make the next turn's output depend on the cache. Returns the tokens re-decoded.
        """
        n_generated = self.n_tokens - n_prompt
        mode = self.cache_settings.l1.repair_generated
        if n_generated <= 0 or mode == "never" or (mode == "auto" and not self._chat_request):
            return 0
        generated = self.input_ids[n_prompt : self.n_tokens].tolist()
        native.seq_rm(self.ctx, WORKING_SEQ, n_prompt, -1)
        self.n_tokens = n_prompt
        self._decode(generated)
        return n_generated

    def eval(self, tokens: Sequence[int]) -> None:
        """``Llama.eval`` that restores a cached prefix first when called on its own.

        Inside ``generate`` the prefix was already restored, so this is plain decoding.
        """
        if self._in_generate or not self.caching or len(tokens) < 2:
            self._decode(tokens)
            return
        whole = np.concatenate(
            [self.input_ids[: self.n_tokens].astype(np.int32), np.asarray(tokens, np.int32)]
        )
        event = CacheEvent(prompt_tokens=len(whole))
        started = time.perf_counter()
        self._restore(whole, event)
        self._decode(whole[self.n_tokens :].tolist())
        event.prefill_ms = (
            (time.perf_counter() - started) * 1e3 - event.lookup_ms - event.restore_ms
        )
        event.suffix_tokens = event.prompt_tokens - event.cached_tokens
        self.last_cache_event = event
        self._park(self._exact_tokens())
        self._record(event)

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
        """``Llama.create_chat_completion``; its reply is repaired for the next turn (see
        ``l1.repair_generated``)."""
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

    def clear_cache(self) -> None:
        """Drop every resident prefix (L1) from the context."""
        resident = self.prefix_cache.resident
        if resident is not None:
            for seq_id in resident.clear():
                native.seq_rm(self.ctx, seq_id)
