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

Beyond the process's own points (L1 here: host memory on the CPU) a point is kept in the tiers
of :func:`skippy_llama.tiers.factory.build_point_tiers`: L2 (host RAM, a mirror of L3, whole
states) and L3 (disk, survives a restart), which keeps a point composed: its attention cells as
pages shared with every point through them, plus the state that is not per token
(``tiers/l3/points.py``), all keyed by chain keys under the cache identity and verified on read;
and the remote store (``tiers/remote/points.py``, the same composed form on a server several
hosts share), which takes a point after L3 stored it (or directly without L3). The lookup
restores the deepest point, in any tier, that the prompt extends; a point served by a deeper
tier is copied into L3, then L2 (a mirror of L3), and L1.

Sliding-window models (Gemma 3), whose window of cells at p exists only at p, take the same path
when L3 or the remote tier is on: there the part that is not per token is the SWA layers' window of cells, and
points are kept only on positions where a restore is exact (:data:`SWA_ALIGN`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from ..config import Settings
from ..events import CacheEvent
from ..identity import CacheIdentity
from ..restore_points import (
    PointOwner,
    PointTier,
    RestorePoint,
    RestorePointStore,
    lone_free_points,
    lone_ubatch,
    prefill_points,
)
from ..tiers.factory import build_point_tiers
from ..tiers.l3.trace import TraceWriter
from . import native, native_ext, recipe
from .restore_probe import aligned_restores_exactly, lone_suffixes_exact, restores_exactly
from .timing import on_tokens
from .working import WorkingSequence

log = logging.getLogger("skippy_llama")

_WORKING_SEQ = 0

#: A long prompt is prefilled in chunks ending at restore points placed on multiples of this
#: many tokens (:func:`skippy_llama.restore_points.prefill_points`): a later prompt that shares
#: only part of it (the next question on a shared document) continues from the deepest one
#: instead of from nothing. Chosen, not yet derived from the cost model: at 256 a 2,000-token
#: document leaves at most 255 tokens to re-decode for its next question.
POINT_EVERY = 256

#: A sliding-window (SWA) model's restore point is exact only at positions that are multiples of
#: this many tokens and of the context's ``n_ubatch`` (:meth:`RestorePointPath.keeps`). Its state
#: holds every cell of the full-attention layers but only the window's last ``n_swa`` cells of the
#: SWA layers, which a restore puts in the cache's first cells: shifted by p - n_swa from where a
#: cold prefill (plain ``Llama``'s full-size SWA cache, one cell per position) keeps them, which
#: changes the CPU kernels' summation blocks. Measured on Gemma 3 270M Q4_K_M (CPU, flash
#: attention off): restores at 512, 768 ... 1,792 tokens of a 2,030-token prompt gave the cold
#: logits bit for bit, at 1,900 they were 1.69 off; shifts of 1, 88 and 148 cells failed in a
#: one-batch probe (0.89-1.79 off). Its quantized weights also take other kernels in small
#: batches (a split after 1 or 13 tokens was up to 1.6 off), so the rest of a prompt must be
#: decoded in the micro-batches the cold prefill used: restore points on ``n_ubatch`` boundaries.
SWA_ALIGN = 256


def open_restore_points(
    seq: WorkingSequence,
    *,
    l1_enabled: bool,
    root: bytes,
    tiers: Callable[[], list[PointTier]] = list,
    owner: PointOwner | None = None,
    trace: Callable[[], TraceWriter | None] = lambda: None,
    window: int = 0,
) -> RestorePointPath | None:
    """Restore points for the working sequence ``seq`` when its model is recurrent or hybrid,
    or has a sliding window of ``window`` (> 0) cells, and this build makes its restores exact,
    else None (a recurrent or hybrid model is then served as plain ``Llama``, as before; a
    sliding-window model by the paged cache's L1).

    Asks for what the load-time check relies on: L1 on (``l1_enabled``), no embeddings or
    per-token logits rows (restored tokens come without them), and on the CPU backend without
    BLAS and flash attention off (where batch splits do not change results)
    :func:`restores_exactly` in this context. Elsewhere (:func:`splits_change_results`: a GPU,
    BLAS, flash attention) a batch split changes the numbers, so points sit on micro-batch
    boundaries, where the rest of a prompt is decoded in the cold prefill's own micro-batches,
    and only where the roster certifies them (a ``restore_points`` row of this architecture,
    backend and flash-attention setting, written by ``scripts/certify.py --restore-points`` on
    that backend) and :func:`aligned_restores_exactly` passes in this context. The points are
    keyed under the cache identity's
    ``root``; ``tiers`` opens the tiers that keep them beyond this process and ``trace`` the
    trace writer (both called only when restore points are on); the tiers list them under
    ``owner``.
    """
    llm = seq.llm
    if not (llm._is_recurrent or llm._is_hybrid or window > 0) or not l1_enabled:
        return None
    p = llm.context_params
    flash = p.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    if p.embeddings or llm._logits_all:
        return None
    # the load-time probe splits prompts into tiny batches, which a quantized SWA model's
    # kernels do not reproduce; its points sit on micro-batch boundaries instead (SWA_ALIGN),
    # so its suffixes are split as the cold prefill splits them, lone micro-batches included
    lone_exact = True
    step = 0
    if splits_change_results(flash):
        step = _certified_step(llm, flash, window)
        if step <= 0:
            return None
    elif window <= 0:
        model = llm._model.model
        # stock ggml-cpu decodes a one-token micro-batch with other kernels (vec_dot) than a
        # batch (sgemm): only patch 0004 makes them agree, and the probe can pass by luck
        lone_exact = native_ext.abi_version() is not None and lone_suffixes_exact(model, llm.ctx)
        if not restores_exactly(model, llm.ctx, lone_free=not lone_exact):
            log.info("skippy-llama: restores are not exact for this model here; no restore points")
            return None
    return RestorePointPath(
        seq,
        RestorePointStore(root),
        tiers(),
        owner or PointOwner(),
        trace=trace(),
        window=window,
        lone_exact=lone_exact,
        step=step,
    )


def splits_change_results(flash: bool) -> bool:
    """Whether a batch split may change this backend's numbers: a GPU or BLAS backend, or
    flash attention (``benchmarks/results/restore-points-cpu.json``: a split prompt differed
    from one batch with flash attention on). There restore points need the roster's row and
    sit on micro-batch boundaries (tests' GPU-like lane turns this on for the CPU)."""
    return flash or native.backend_name() != "CPU" or "BLAS" in native.registered_backends()


def _certified_step(llm: llama_cpp.Llama, flash: bool, window: int) -> int:
    """Where batch splits change results: the step (tokens) restore points keep, from the
    roster's row and this context's micro-batch, once :func:`aligned_restores_exactly` passed
    here; 0 (no points, logged) when the roster does not certify them or the check fails."""
    arch = str(llm.metadata.get("general.architecture", "unknown"))
    verdict = recipe.points_verdict(arch, native.backend_name(), flash)
    if verdict.alignment is None:
        log.info("skippy-llama: no restore points: %s", verdict.reason)
        return 0
    n_batch, n_ubatch = int(llm.n_batch), int(llm.context_params.n_ubatch)
    if n_batch % n_ubatch:
        # Llama.eval's batches from a point would then cut micro-batches the cold prefill's do not
        log.info("skippy-llama: no restore points: n_batch is not a multiple of n_ubatch")
        return 0
    step = math.lcm(verdict.alignment, n_ubatch, SWA_ALIGN if window > 0 else 1)
    if not aligned_restores_exactly(llm, step):
        log.info("skippy-llama: no restore points: a restore at %d tokens is not exact here", step)
        return 0
    return step


def open_for_model(
    seq: WorkingSequence,
    settings: Settings,
    identity: CacheIdentity,
    model_path: str,
    window: int,
) -> RestorePointPath | None:
    """:func:`open_restore_points` for a loaded model: recurrent and hybrid models (which the
    paged cache refuses) and sliding-window models (``window`` > 0) when L3 or the remote tier
    is on (their pages cannot rebuild a prefix, so those tiers keep points); None for any other
    model."""
    deep = settings.l3.mode != "off" or settings.remote.enabled
    swa_points = window > 0 and deep and seq.disabled_reason is None
    if seq.disabled_reason is None and not swa_points:
        return None
    if native_ext.abi_version() is None and swa_points:
        # the sliding-window alignment (SWA_ALIGN) was measured on the patched library only
        log.info("skippy-llama: sliding-window restore points need the patched library")
        return None
    model = identity.model
    return open_restore_points(
        seq,
        l1_enabled=settings.l1.enabled,
        root=identity.root,
        tiers=lambda: build_point_tiers(settings),
        owner=PointOwner(model.id, model.name or Path(model_path).name),
        trace=lambda: TraceWriter.from_settings(settings.l3.trace_file, settings.page_tokens),
        window=window if swa_points else 0,
    )


class RestorePointPath:
    """Serves ``SkippyLlama.generate`` of a recurrent, hybrid or sliding-window model from
    restore points: the process's own ``store`` (L1), then ``tiers`` in order (L2, L3).

    ``window``: the model's sliding window (0: none). Its points are kept only where they
    restore exactly (:data:`SWA_ALIGN`), and the restore starts from an empty cache so the
    window's cells land where they did at capture.

    ``lone_exact``: whether a token decoded in a micro-batch of its own gets a batched
    prefill's results here (:func:`~skippy_llama.runtime.restore_probe.lone_suffixes_exact`).
    Where not (the stock library: ggml-cpu's ``vec_dot`` for one column, sgemm for more), a
    plan never decodes a one-token micro-batch: a point is restored only where the rest of
    the prompt, and the prefill's chunks, avoid one (:func:`lone_free_points`), and a prompt
    whose cold prefill itself decodes one (``Llama.eval``'s last batch of a single token) is
    served as plain ``Llama`` would, keeping no point. On the stock build an LFM2 point
    followed by one token gave logits 8e-4 off a cold prefill; plain ``Llama`` decoding the
    same token alone after the same 90 gave the same 8e-4 (``docs/library.md``)."""

    def __init__(
        self,
        seq: WorkingSequence,
        store: RestorePointStore,
        tiers: Sequence[PointTier] = (),
        owner: PointOwner | None = None,
        every: int = POINT_EVERY,
        trace: TraceWriter | None = None,
        window: int = 0,
        lone_exact: bool = True,
        step: int = 0,
    ) -> None:
        self.seq = seq
        self.store = store
        self.tiers = list(tiers)
        self.owner = owner or PointOwner()
        self.every = every
        #: ``l3.trace_file``'s writer: lookups and points, for ``kv-cache simulate``
        self.trace = trace
        self.window = window
        self.lone_exact = lone_exact
        #: ``Llama.eval``'s batch and llama.cpp's micro-batch: the splits a plan must respect
        self.n_batch = int(seq.llm.n_batch)
        self.n_ubatch = int(seq.llm.context_params.n_ubatch)
        #: points only on multiples of ``step`` tokens (0: any prompt end), where batch splits
        #: change results (:func:`splits_change_results`)
        self.step = step
        #: where a sliding-window model's points are kept (:data:`SWA_ALIGN`), or ``step``
        self.align = step or math.lcm(SWA_ALIGN, int(seq.llm.context_params.n_ubatch))
        if window > 0 or step > 0:
            self.every = math.lcm(every, self.align)

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
        # a prompt whose cold prefill decodes a lone micro-batch cannot be matched by any
        # other split where lone decodes differ: decoded as plain Llama does, nothing kept
        exact = self.lone_exact or not lone_ubatch(len(prompt), self.n_batch, self.n_ubatch)
        taken: list[RestorePoint] = []
        if exact:
            self._restore(prompt, event)
            taken = self._prefill_points(prompt)
        else:
            event.fallbacks.append("restore points: the cold prefill decodes a lone micro-batch")

        def seen(i: int, token: int) -> None:
            seq.last_sampled = token
            if i:
                return
            event.ttft_ms = (time.perf_counter() - started) * 1e3
            event.prefill_ms = event.ttft_ms - event.restore_ms
            # the prompt is decoded and its first token sampled, not yet evaluated
            if exact and llm.n_tokens == len(prompt) and self.keeps(len(prompt)):
                point = self._capture(prompt)
                self.store.put(prompt, point.blob)
                taken.append(point)

        try:
            yield from on_tokens(llama_cpp.Llama.generate(llm, tokens, *args, **kwargs), seen)
        finally:
            event.suffix_tokens = event.prompt_tokens - event.cached_tokens
            # the deeper tiers take the point after the reply, off the time to first token (L3
            # writes it here; the remote tier only queues its push for a background writer)
            for point in taken:
                self._offer(point)
            finished(event)

    def keeps(self, n: int) -> bool:
        """Whether a point after ``n`` tokens restores exactly (always, without a window or step)."""
        return (self.window <= 0 and self.step <= 0) or n % self.align == 0

    def _plan(self, start: int, end: int) -> list[int] | None:
        """Where a prefill of ``[start, end)`` stops to keep points (:func:`prefill_points`),
        without a one-token micro-batch where lone decodes are inexact; None: impossible."""
        points = prefill_points(start, end, self.every)
        if self.lone_exact:
            return points
        return lone_free_points(start, end, points, self.n_batch, self.n_ubatch)

    def _prefill_points(self, prompt: np.ndarray[Any, np.dtype[np.int32]]) -> list[RestorePoint]:
        """Prefill ``prompt`` from where the restore left it in chunks ending at the restore
        points :func:`prefill_points` places, keeping a point at each; ``Llama.generate`` then
        decodes the rest. The load-time check proved a chunked prefill gives the one-batch
        prefill's results here."""
        llm = self.seq.llm
        taken: list[RestorePoint] = []
        for end in self._plan(llm.n_tokens, len(prompt)) or ():
            llama_cpp.Llama.eval(llm, prompt[llm.n_tokens : end].tolist())
            point = self._capture(prompt[:end].copy())
            self.store.put(point.tokens, point.blob)
            taken.append(point)
        return taken

    def _capture(self, tokens: np.ndarray[Any, np.dtype[np.int32]]) -> RestorePoint:
        """The working sequence's state after ``tokens``, with the size of its part that is
        not per token (``PARTIAL_ONLY`` writes it after an 8-byte header), so L3 can keep the
        attention cells as shared pages."""
        ctx = self.seq.llm.ctx
        blob = bytes(native.get_seq_state(ctx, _WORKING_SEQ))
        partial = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        recurrent = int(llama_cpp.llama_state_seq_get_size_ext(ctx, _WORKING_SEQ, partial)) - 8
        return RestorePoint(tokens, blob, max(recurrent, 0))

    def _offer(self, point: RestorePoint) -> None:
        """L3 first, then L2, which mirrors only what L3 holds, and the remote tier, which
        takes what L3 stored (exists before put), or every point where there is no L3."""
        root = self.store.root
        if self.trace is not None:  # pages (shared in L3) + the snapshot beside them
            snapshot = point.recurrent or len(point.blob)
            self.trace.point_record(root, point.tokens, len(point.blob) - snapshot, snapshot)
        self._put(self.tiers, point, remote=True)

    def _put(
        self, tiers: Sequence[PointTier], point: RestorePoint, *, remote: bool, held: bool = False
    ) -> None:
        """Store ``point`` in ``tiers`` by their roles (``PointRole``): the durable tier (L3)
        first; a mirror (L2) only when the durable tier took it (or already holds it:
        ``held``); a shared tier (remote, when ``remote``) when the durable tier took it or
        there is none."""
        root = self.store.root
        disk = next((tier for tier in tiers if tier.role == "durable"), None)
        stored = held or (disk.put_point(root, point, self.owner) if disk is not None else False)
        for tier in tiers:
            mirror = tier.role == "mirror" and stored
            push = tier.role == "shared" and remote and (stored or disk is None)
            if mirror or push:
                tier.put_point(root, point, self.owner)

    def _find(self, prompt: np.ndarray[Any, np.dtype[np.int32]]) -> tuple[str, RestorePoint] | None:
        """The deepest point in any tier whose tokens are a proper prefix of ``prompt``."""
        root = self.store.root
        lengths = set(self.store.lengths())
        for tier in self.tiers:
            lengths.update(tier.point_lengths(root))
        usable = (
            n
            for n in lengths
            if 0 < n < len(prompt) and self.keeps(n) and self._plan(n, len(prompt)) is not None
        )
        for n in sorted(usable, reverse=True):
            head = prompt[:n]
            point = self.store.get(head)
            if point is not None:
                return "l1", point
            for i, tier in enumerate(self.tiers):
                point = tier.get_point(root, head)
                if point is None:
                    continue
                # promote into the shallower tiers (a mirror holds what the durable tier does)
                self._put(self.tiers[:i], point, remote=False, held=tier.role == "durable")
                self.store.put(point.tokens, point.blob)
                return tier.name, point
        return None

    def _restore(self, prompt: np.ndarray[Any, np.dtype[np.int32]], event: CacheEvent) -> None:
        t0 = time.perf_counter()
        found = self._find(prompt)
        if self.trace is not None:
            hit = (found[0], found[1].n_tokens) if found is not None else ("cold", 0)
            self.trace.point_lookup(self.store.root, prompt, hit[1], hit[0])
        if found is None:
            return
        tier, point = found
        llm = self.seq.llm
        if self.window > 0 or self.step > 0:
            # the window's cells must land in the cells they held at capture (SWA_ALIGN), and
            # where splits matter every cell where the cold prefill put it: the restore fills
            # the cache from its first free cell
            llama_cpp.llama_memory_clear(native.memory(llm.ctx), True)
        if not native.set_seq_state(llm.ctx, bytearray(point.blob), _WORKING_SEQ):
            native.seq_rm(llm.ctx, _WORKING_SEQ)
            event.fallbacks.append("restore point: llama_state_seq_set_data refused it")
            return
        n = point.n_tokens
        # Llama.generate keeps these n tokens (its prefix match) and decodes the rest
        llm.input_ids[:n] = point.tokens
        llm.n_tokens = n
        event.tier = tier  # type: ignore[assignment]
        event.cached_tokens = n
        event.restored_bytes = len(point.blob)
        event.restore_ms = (time.perf_counter() - t0) * 1e3

    def status(self) -> dict[str, Any]:
        """The process's restore points (L1), L2's bytes and the remote tier's counters."""
        out: dict[str, Any] = {"l1": {"points": len(self.store), "bytes": self.store.bytes}}
        for tier in self.tiers:
            if tier.role == "mirror":
                out[tier.name] = {"bytes": getattr(tier, "stored_bytes", 0)}
            elif tier.role == "shared":
                status = getattr(tier, "status", None)
                out[tier.name] = status() if status is not None else {}
        return out

    def clear(self) -> None:
        """Drop every restore point this process holds (L1, L2); L3 and the remote tier keep
        their own."""
        self.store.clear()
        for tier in self.tiers:
            if tier.role == "mirror":
                clear = getattr(tier, "clear", None)
                if clear is not None:
                    clear()

    def close(self) -> None:
        """Close the tiers in order: L3 (its point writes are synchronous) drains its writer,
        which runs the remote pushes queued on it while the remote store is still open; the
        remote tier then drains its own lane (without L3) and closes."""
        if self.trace is not None:
            self.trace.close()
        for tier in self.tiers:
            close = getattr(tier, "close", None)
            if close is not None:
                close()
