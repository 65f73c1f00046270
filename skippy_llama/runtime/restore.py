"""The request path: tokens -> plan -> seam -> commit, and what the request's event says."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..events import CacheEvent
from ..plan import Prompt
from . import repair
from .recording import DECODED_SUFFIX

if TYPE_CHECKING:
    from .llama import SkippyLlama


def restore_prefix(
    llm: SkippyLlama, tokens: np.ndarray[Any, np.dtype[np.int32]], event: CacheEvent
) -> None:
    """Put the longest cached prefix of ``tokens`` into the working sequence."""
    cache = llm.prefix_cache
    started = time.perf_counter()
    exact = llm.live_exact()
    prompt = Prompt(
        tokens=tokens,
        limit=max(len(tokens) - DECODED_SUFFIX, 0),
        live=llm.input_ids[:exact].astype(np.int32),
        live_cells=llm.seam.live_cells(),
        granule=llm.granule,
        scored=llm.scored_tokens,
        sliding_window=llm.sliding_window,
        can_append=cache.takes_records and llm.native_verdict.append_import,
    )
    plan = cache.plan(prompt)
    event.park_skipped = plan.park_skipped
    if plan.park:
        # the prompt leaves the live sequence: keep it resident before it is overwritten;
        # parking changes L1, so the plan is made again afterwards
        parking = time.perf_counter()
        llm.guard("park", event, lambda: repair.displace(llm, exact, event))
        event.park_ms = (time.perf_counter() - parking) * 1e3
        plan = cache.plan(prompt)
    event.lookup_ms = (time.perf_counter() - started) * 1e3 - event.park_ms
    # Llama.generate would reuse the live sequence up to the last token, generated tokens
    # included; only the exact part may be reused
    llm.keep_exact(plan.keep)
    restoring = time.perf_counter()
    outcome = llm.seam.execute(
        plan,
        prompt,
        cache,
        llm.kv_layout,
        append=prompt.can_append,
        pipeline=llm.pipeline_restores and llm.native_verdict.append_import,
    )
    n = outcome.n_tokens
    llm.adopt(n, tokens if outcome.restored else None)
    event.restore_ms = (time.perf_counter() - restoring) * 1e3
    event.tier = outcome.tier
    event.cached_tokens = n
    event.restored_bytes = outcome.restored_bytes
    if outcome.fetched:
        event.codec = llm.cache_identity.codec_name  # one identity, one codec (codecs/select.py)
    if outcome.plan.base_tokens:
        event.l1_tokens = outcome.plan.base_tokens
        event.appended_tokens = outcome.plan.appended_tokens
    event.fallbacks.extend(outcome.fallbacks)
    cache.commit(plan, outcome, prompt)
