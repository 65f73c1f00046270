"""L3 records of the working sequence: what to capture, when, and handing it to the cache.

Only what the record-taking tiers lack is captured: the record continues the stored page tree
where the prompt leaves it, and only the cells of its new pages are serialized. On GPU builds
every record waits (``SkippyLlama.defer_record_tokens``): the capture is made before another
prompt takes the sequence (on that request, which must keep the cells first), while idle
(``prepare_next_turn``), or on ``close``, never between a reply and the request after it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..errors import StateFormatError
from ..events import CacheEvent
from ..hostmem import HostBuffer
from ..state import parse_state

if TYPE_CHECKING:
    from .llama import SkippyLlama

#: On GPU builds a record waits while fewer than this many of its tokens are unrecorded: always,
#: since no sequence is that long (see ``SkippyLlama.defer_record_tokens``). Issue 36: captured
#: right after each reply, a 32k-token prefix cost 0.84 of a cold prefill on an H200 before the
#: next request could start.
DEFER_RECORD_TOKENS = 1 << 30
#: Prompt tokens always decoded, never restored (see ``SkippyLlama``): a repeat of a prompt
#: reuses all but these.
DECODED_SUFFIX = 2


class Recorder:
    """Records one ``SkippyLlama``'s working sequence into the cache's record-taking tiers."""

    def __init__(self, llm: SkippyLlama) -> None:
        self.llm = llm
        #: the tokens of the last record made, and the point of a record left for later
        self.recorded: np.ndarray[Any, np.dtype[np.int32]] | None = None
        self.deferred = 0

    def after_request(self, event: CacheEvent) -> None:
        """Queue the exact part of the working sequence, as far as a repeat can use it.

        A repeat of the prompt decodes its last two tokens (``DECODED_SUFFIX``) and reuses
        whole granules only.
        """
        llm = self.llm
        cache = llm.prefix_cache
        layout = llm.kv_layout
        if not cache.takes_records or layout is None or not layout.pageable:
            return
        point = min(llm.exact_tokens(), llm.aligned(event.prompt_tokens - DECODED_SUFFIX))
        if self._may_wait(point):
            self.deferred = point
            cache.count_deferred()
            return
        self.record(point)

    def _may_wait(self, point: int) -> bool:
        """Whether the record up to ``point`` may wait (see ``defer_record_tokens``): while
        fewer than that many tokens past the last record it continues are unrecorded."""
        bound = self.llm.defer_record_tokens
        if bound <= 0 or point <= 0:
            return False
        base = self.recorded
        continued = (
            base is not None
            and len(base) <= point
            and np.array_equal(self.llm.input_ids[: len(base)], base)
        )
        covered = len(base) if continued and base is not None else 0
        return point - covered < bound

    def unless_continued(self, tokens: np.ndarray[Any, np.dtype[np.int32]]) -> None:
        """Make a waiting record now, unless ``tokens`` (the next prompt) continue it."""
        point = self.deferred
        if point and not (
            len(tokens) >= point and np.array_equal(tokens[:point], self.llm.input_ids[:point])
        ):
            self.flush()

    def flush(self) -> None:
        """Make a waiting record now, before the working sequence changes (or while idle)."""
        point = self.deferred
        if point:
            self.llm.guard("record", None, lambda: self.record(point))

    def record(self, point: int) -> None:
        """Queue the working sequence's first ``point`` tokens, as far as they are exact."""
        llm = self.llm
        cache = llm.prefix_cache
        layout = llm.kv_layout
        assert layout is not None
        self.deferred = 0
        # a waiting record may find cells cleared behind the cache's back since
        point = min(point, llm.live_exact())
        tokens = llm.input_ids[: max(point, 0)].astype(np.int32)
        self.recorded = tokens
        plan = cache.plan_record(tokens, point)
        if plan is None:
            return
        start = plan.new[0][2] if plan.new else point
        blob = llm.seam.capture(start, point, range_export=llm.native_verdict.range_export)
        # the writer cuts the pages out of the capture later, then gives its buffer back
        release = functools.partial(llm.seam.buffers.give, cast(HostBuffer, blob.obj))
        try:
            state = parse_state(blob, first=start)
            if state.layout.digest() != layout.digest():
                raise StateFormatError("captured state does not match the probed KV layout")
        except BaseException:
            release()
            raise
        cache.record(plan, state, tokens, release)
