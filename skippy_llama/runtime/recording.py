"""L3 records of the working sequence: what to capture, when, and handing it to the cache.

Only what the record-taking tiers lack is captured: the record continues the stored page tree
where the prompt leaves it, and only the cells of its new pages leave the context. Where the
seam has an exporter (patch 0006 certified, ``runtime/export.py``), they are exported into
arena slots right after the request's decode (on CUDA on the exporter's thread, by asynchronous
device-to-host copies; on the CPU a memcpy), and the L3 writer cuts, compresses, hashes and
writes the pages from there: nothing of the record lands on a request but the plan (a few
lookups), the CPU's memcpy and, for the next request, the wait for an export still copying. Elsewhere the cells are captured through
the state format; then on GPU builds every record waits (``Recorder.defer_tokens``): the
capture is made before another prompt takes the sequence (on that request, which must keep the
cells first), while idle (``prepare_next_turn``), or on ``close``, never between a reply and
the request after it.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import numpy as np

from ..cache import PrefixCache
from ..errors import StateFormatError
from ..events import CacheEvent
from ..hostmem import HostBuffer
from ..state import parse_state
from ..tiers.records import PendingPayload
from .working import WorkingSequence, guard

#: On GPU builds a record waits while fewer than this many of its tokens are unrecorded: always,
#: since no sequence is that long (see ``Recorder.defer_tokens``). Issue 36: captured
#: right after each reply, a 32k-token prefix cost 0.84 of a cold prefill on an H200 before the
#: next request could start.
DEFER_RECORD_TOKENS = 1 << 30
#: Prompt tokens always decoded, never restored (see ``SkippyLlama``): a repeat of a prompt
#: reuses all but these.
DECODED_SUFFIX = 2


def default_defer_tokens(*, on_cpu: bool, exports: bool) -> int:
    """``Recorder.defer_tokens`` for a build: records wait only on GPU builds that capture
    through the state format (a synchronized copy per layer); where records are exported
    asynchronously (``exports``) or the capture is a memcpy (the CPU), never."""
    return 0 if on_cpu or exports else DEFER_RECORD_TOKENS


class Recorder:
    """Records the working sequence ``seq`` into ``cache``'s record-taking tiers.

    Args:
        seq: the working sequence.
        cache: the cache whose tiers take the records.
        defer_tokens: see :attr:`defer_tokens`.
    """

    def __init__(self, seq: WorkingSequence, cache: PrefixCache, defer_tokens: int) -> None:
        self.seq = seq
        self.cache = cache
        #: A record waits while fewer than this many of its tokens are unrecorded (0: never
        #: waits; GPU builds: always). On a GPU build a capture copies from the device (one
        #: synchronized copy per layer and K/V on a stock build, ~1 ms each on an H200), which
        #: must not sit between a reply and the next request; the record is made before
        #: another prompt takes the sequence, in ``prepare_next_turn`` and in ``close``, so an
        #: orderly exit loses nothing. On the CPU a capture is a memcpy: nothing to save.
        self.defer_tokens = defer_tokens
        #: the tokens of the last record made, and the point of a record left for later
        self.recorded: np.ndarray[Any, np.dtype[np.int32]] | None = None
        self.deferred = 0

    def settle(self) -> None:
        """Wait for a record's export still copying cells out of the context (see
        ``runtime/export.py``): before anything touches the context."""
        self.seq.seam.settle()

    def after_request(self, event: CacheEvent) -> None:
        """Queue the exact part of the working sequence, as far as a repeat can use it.

        A repeat of the prompt decodes its last two tokens (``DECODED_SUFFIX``) and reuses
        whole granules only.
        """
        seq, cache = self.seq, self.cache
        layout = seq.layout
        if not cache.takes_records or layout is None or not layout.pageable:
            return
        point = min(seq.exact_tokens(), seq.aligned(event.prompt_tokens - DECODED_SUFFIX))
        if self._may_wait(point):
            self.deferred = point
            cache.count_deferred()
            return
        self.record(point)

    def _may_wait(self, point: int) -> bool:
        """Whether the record up to ``point`` may wait (see :attr:`defer_tokens`): while
        fewer than that many tokens past the last record it continues are unrecorded."""
        bound = self.defer_tokens
        if bound <= 0 or point <= 0:
            return False
        base = self.recorded
        continued = (
            base is not None
            and len(base) <= point
            and np.array_equal(self.seq.llm.input_ids[: len(base)], base)
        )
        covered = len(base) if continued and base is not None else 0
        return point - covered < bound

    def unless_continued(self, tokens: np.ndarray[Any, np.dtype[np.int32]]) -> None:
        """Make a waiting record now, unless ``tokens`` (the next prompt) continue it."""
        self.settle()
        point = self.deferred
        if point and not (
            len(tokens) >= point and np.array_equal(tokens[:point], self.seq.llm.input_ids[:point])
        ):
            self.flush()

    def flush(self) -> None:
        """Make a waiting record now, before the working sequence changes (or while idle)."""
        self.settle()
        point = self.deferred
        if point:
            guard(self.cache, "record", None, lambda: self.record(point))

    def record(self, point: int) -> None:
        """Queue the working sequence's first ``point`` tokens, as far as they are exact."""
        seq, cache = self.seq, self.cache
        layout = seq.layout
        assert layout is not None
        self.deferred = 0
        # a waiting record may find cells cleared behind the cache's back since
        point = min(point, seq.live_exact())
        tokens = seq.tokens(point)
        self.recorded = tokens
        seq.held = None
        plan = cache.plan_record(tokens, point)
        if plan is None:
            seq.held = tokens  # all stored already
            return
        parts = [(start, end) for _, _, start, end in plan.new]
        exporter = seq.seam.exporter
        export = seq.seam.export(parts)
        if exporter is not None and export is not None:
            # the cells are on their way into arena slots; the writer makes the pages
            payloads = [
                PendingPayload(slot.nbytes, functools.partial(export.page_bytes, i))
                for i, slot in enumerate(export.slots)
            ]
            release = exporter.release(export)
            try:
                taken = cache.record_payloads(plan, payloads, tokens, release)
            except BaseException:
                release()
                raise
            seq.held = tokens if taken else None
            return
        start = plan.new[0][2] if plan.new else point
        blob = seq.seam.capture(start, point, range_export=seq.verdict.range_export)
        # the writer cuts the pages out of the capture later, then gives its buffer back
        release = functools.partial(seq.seam.buffers.give, cast(HostBuffer, blob.obj))
        try:
            state = parse_state(blob, first=start)
            if state.layout.digest() != layout.digest():
                raise StateFormatError("captured state does not match the probed KV layout")
        except BaseException:
            release()
            raise
        seq.held = tokens if cache.record(plan, state, tokens, release) else None
