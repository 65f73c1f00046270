"""The request path: prompt -> plan -> (park) -> seam -> (plan again) -> commit.

One request flows down and back once: the cache plans (no side effects), the live sequence is
parked first where the plan says so, the KV seam executes the plan reading pages from
``cache.pages``, a step that failed is planned again here without the failed tiers, and the
cache commits what served.
"""

from __future__ import annotations

import time

import numpy as np
import numpy.typing as npt

from ..cache import PrefixCache
from ..events import CacheEvent
from ..plan import Prompt, RestoreOutcome, RestorePlan
from .recording import DECODED_SUFFIX
from .repair import displace
from .working import WorkingSequence, guard


def restore_prefix(
    seq: WorkingSequence,
    cache: PrefixCache,
    tokens: npt.NDArray[np.int32],
    event: CacheEvent,
    *,
    pipeline: bool,
) -> None:
    """Put the longest cached prefix of ``tokens`` into the working sequence ``seq``.

    ``pipeline``: long page restores may run in chunks (``SkippyLlama.pipeline_restores``).
    """
    started = time.perf_counter()
    exact = seq.live_exact()
    prompt = Prompt(
        tokens=tokens,
        limit=max(len(tokens) - DECODED_SUFFIX, 0),
        live=seq.tokens(exact),
        live_cells=seq.seam.live_cells(),
        granule=seq.granule,
        scored=seq.scored_tokens,
        sliding_window=seq.sliding_window,
        can_append=cache.takes_records and seq.verdict.append_import,
        # what the last record handed to L3 comes back from there without a park
        live_recorded=min(seq.held_tokens(), exact),
    )
    plan = cache.plan(prompt)
    event.park_skipped = plan.park_skipped
    if plan.park:
        # the prompt leaves the live sequence: keep it resident before it is overwritten;
        # parking changes L1, so the plan is made again afterwards
        parking = time.perf_counter()
        guard(cache, "park", event, lambda: displace(seq, cache, exact, event))
        event.park_ms = (time.perf_counter() - parking) * 1e3
        plan = cache.plan(prompt)
    event.lookup_ms = (time.perf_counter() - started) * 1e3 - event.park_ms
    # Llama.generate would reuse the live sequence up to the last token, generated tokens
    # included; only the exact part may be reused
    seq.keep_exact(plan.keep)
    restoring = time.perf_counter()
    pipeline = pipeline and seq.verdict.append_import
    outcome = _execute(seq, cache, plan, prompt, pipeline)
    outcome.restore_s = time.perf_counter() - restoring
    n = outcome.n_tokens
    seq.adopt(n, tokens if outcome.restored else None)
    event.restore_ms = (time.perf_counter() - restoring) * 1e3
    event.tier = outcome.tier
    event.cached_tokens = n
    event.restored_bytes = outcome.restored_bytes
    if outcome.fetched:
        event.codec = cache.identity.codec_name  # one identity, one codec (codecs/select.py)
    if outcome.plan.base_tokens:
        event.l1_tokens = outcome.plan.base_tokens
        event.appended_tokens = outcome.plan.appended_tokens
    event.fallbacks.extend(outcome.fallbacks)
    cache.commit(plan, outcome, prompt)


def _execute(
    seq: WorkingSequence, cache: PrefixCache, plan: RestorePlan, prompt: Prompt, pipeline: bool
) -> RestoreOutcome:
    """Execute ``plan``, and after a failed step the next-shallower plan from the same
    planner, without the tiers that failed, down to a cold prefill (which cannot fail)."""
    notes: list[str] = []
    faults: list[str] = []
    excluded: set[str] = set()
    layout = seq.layout
    while True:
        outcome = seq.seam.execute(
            plan, cache.pages, layout, append=prompt.can_append, pipeline=pipeline
        )
        notes += outcome.fallbacks
        faults += outcome.faults
        if not outcome.failed:
            outcome.fallbacks, outcome.faults = notes, faults
            return outcome
        resident = cache.resident
        if outcome.broken_checkpoint is not None and resident is not None:
            resident.remove(outcome.broken_checkpoint)
        excluded.update(outcome.failed_tiers)
        if seq.seam.live_cells() < plan.keep:
            prompt = prompt.without_live()
        plan = cache.plan(prompt, exclude=frozenset(excluded))
