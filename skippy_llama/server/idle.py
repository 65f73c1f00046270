"""Work the server does between requests: re-decode the last reply so its chat's next turn
reuses it (:meth:`SkippyLlama.prepare_next_turn`).

A served chat's next turn extends the reply just generated; its cells came from single-token
decodes, which an exact cache cannot reuse, so the turn would prefill the reply again (median 15
of 40 tokens per turn in ``bench_serve.py --system shared``). Users take seconds to type, so the server does it
in that gap: once no request has started or finished for ``after`` seconds, it takes the model
through llama_cpp.server's own lock, re-decodes the reply as one batch and checkpoints the chat
(so the next user's request need not checkpoint it before restoring its own). A request that
arrives meanwhile waits for the step under way at most (the L3 record, that batch, or the
checkpoint: ``prepare_next_turn(stop=...)`` is asked between them); where requests follow each other
without a gap (a benchmark, a batch client), the gap never opens and nothing runs.

Except that on a loaded machine a client's turnaround can exceed ``after``: profiled with py-spy
(issue 34: 4 users x 3 turns back to back on 2 cores at load 6-8), the idle work ran between
back-to-back turns and took 49 of 1,961 model-thread samples (repair 40, checkpoint 9), which
the next request waited for; decoding took 94 %. It now also waits while any request is admitted
to the queue (:mod:`.queue`), which counts a request from its arrival, before it reaches the
model lock, and gives up the lock it won if one was admitted meanwhile.

After that, where the cache can prefetch (a tier to fill, L2, over a deeper one to read, L3 or
the remote store), the same gap prefetches (:meth:`SkippyLlama.prefetch`) the conversations served
most recently (:mod:`.recent`) that the working sequence or L1 would not serve (the planner says):
their next turns would otherwise restore from disk or the network. A request that arrives
meanwhile waits for one read at most (the prefetch asks the same ``stop`` before each read).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import anyio
import numpy as np
from llama_cpp.server.app import get_llama_proxy, llama_inner_lock, llama_outer_lock

from ..plan import Prompt
from ..prefetch import PrefetchResult
from ..runtime.llama import SkippyLlama
from .recent import RecentConversations, Tokens
from .state import ServingState

#: Conversations prefetched in one idle gap at most (the most recent ones not resident).
PREFETCH_CONVERSATIONS = 4


def _waiting(state: ServingState) -> bool:
    """A request was admitted to the queue and has not finished (it holds or awaits the model)."""
    return state.queue.status().inflight > 0


def _busy(state: ServingState) -> bool:
    """A request holds the model or waits for it: upstream's double lock, or a request admitted
    to the queue that has not reached the lock yet (its body still being read)."""
    return llama_outer_lock.locked() or llama_inner_lock.locked() or _waiting(state)


async def prepare_when_idle(state: ServingState, after: float) -> None:
    """Run until cancelled: ``after`` seconds into each gap between requests, prepare the next
    turn of the chat served last."""
    prepared = state.requests_finished
    while True:
        await anyio.sleep(after / 2)
        finished = state.requests_finished
        if finished == prepared or _busy(state):
            continue
        if time.monotonic() - state.last_activity < after:
            continue
        async with contextlib.asynccontextmanager(get_llama_proxy)():
            if _waiting(state):
                continue  # a request came while this waited for the lock: it goes first
            llm = state.model()
            if llm is not None:
                # fail-open inside: a failed repair is counted and the reply is prefilled later;
                # a request admitted meanwhile waits for one step of it at most
                await state.worker.run(llm.prepare_next_turn, lambda: _waiting(state))
                await state.worker.run(prefetch_recent, llm, state.recent, lambda: _waiting(state))
        prepared = finished


def _resident(llm: SkippyLlama, tokens: Tokens) -> bool:
    """The working sequence or an L1 checkpoint would serve all of ``tokens`` but less than a
    page, by the planner (model thread only: L1 and the working sequence change under
    requests)."""
    cache = llm.prefix_cache
    live = np.asarray(llm.input_ids[: llm.live_exact()], dtype=np.int32)
    served = cache.resident_tokens(Prompt(tokens, len(tokens), live=live))
    return served >= len(tokens) - cache.page_tokens


def prefetch_recent(
    llm: SkippyLlama, recent: RecentConversations, stop: Callable[[], bool]
) -> list[PrefetchResult]:
    """Prefetch the pages of the most recent conversations that are not resident, up to
    :data:`PREFETCH_CONVERSATIONS` of them, most recent first; ``stop`` is asked before each
    conversation and each read. Runs on the model thread. Returns what each prefetch did
    (nothing when the cache cannot prefetch: ``PrefixCache.can_prefetch``)."""
    if not llm.caching or not llm.prefix_cache.can_prefetch:
        return []
    results: list[PrefetchResult] = []
    for tokens in recent.latest(len(recent)):
        if len(results) >= PREFETCH_CONVERSATIONS or stop():
            break
        if not _resident(llm, tokens):
            results.append(llm.prefetch(tokens, stop=stop))
    return results
