"""Chat repair: re-decode a generated reply as one batch, so the next turn reuses it exactly.

A reply's tokens are decoded one at a time, and on stock llama.cpp those cells differ in the low
bits from the batched prefill a cold prompt gets; keeping them would make a later turn's output
depend on the cache. A next turn that extends the reply decodes it again inside its own prefill;
:func:`prepare_next_turn` does it earlier, while nothing waits, and :func:`displace` before a
prompt leaves the live sequence for another chat.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import llama_cpp

from ..cache import PrefixCache
from ..events import CacheEvent
from .chat_head import template_head
from .recording import Recorder
from .working import WorkingSequence, guard


def gains_boundary(seq: WorkingSequence, exact: int) -> bool:
    """Whether re-decoding the cells after ``exact`` makes more of them exact: only up to
    the last canonical boundary (the cells after it are decoded again by the next prefill
    on a batch-split-sensitive backend), so a reply inside one granule gains nothing."""
    return seq.aligned(seq.n_tokens) > exact


def repair(seq: WorkingSequence, start: int, ahead: Sequence[int] = ()) -> int:
    """Re-decode the working sequence from ``start`` (the last reply's canonical boundary) as
    one batch so its cells equal a cold prefill's, and decode ``ahead`` (tokens predicted to
    follow it) in the same batch. Returns the tokens decoded."""
    tokens = [*seq.llm.input_ids[start : seq.n_tokens].tolist(), *ahead]
    seq.cut(start)
    seq.decode(tokens)
    return len(tokens)


def park(seq: WorkingSequence, cache: PrefixCache, n_tokens: int) -> None:
    """Checkpoint the first ``n_tokens`` of the working sequence for later prompts, where
    the cache's planner says it pays and fits."""
    n_tokens = min(n_tokens, seq.n_tokens)
    if n_tokens <= 0:
        return
    tokens = seq.tokens(n_tokens)
    plan = cache.park_plan(tokens)
    if plan is None:
        return
    try:
        handle, seconds = seq.seam.park(plan)
    except BaseException:
        cache.abandon_park(plan)
        raise
    cache.commit_park(plan, tokens, handle, seconds)


def displace(seq: WorkingSequence, cache: PrefixCache, exact: int, event: CacheEvent) -> None:
    """Checkpoint the live sequence's exact part; a chat reply after it is repaired first.

    Done only when a prompt leaves the live sequence, never after each reply: a linear chat,
    whose next prompt extends the reply, decodes the reply inside its next prefill (one
    batch, as a cold prefill would) and pays nothing here.
    """
    mode = seq.repair_generated
    start = seq.aligned(seq.reply_start)
    wanted = mode == "always" or (mode == "auto" and seq.reply_repairable)
    if wanted and exact == start and gains_boundary(seq, exact):
        event.repaired_tokens = repair(seq, start)
        exact = seq.exact_tokens()
    park(seq, cache, exact)


def prepare_next_turn(
    seq: WorkingSequence,
    cache: PrefixCache,
    recorder: Recorder,
    stop: Callable[[], bool] | None = None,
) -> int:
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

    ``stop`` is asked between the steps (the L3 record, the re-decode, the checkpoint); once it
    returns True the rest is left for the next request to do as it would have.

    Returns the tokens decoded: 0 when there is nothing to do (no reply in the live sequence,
    or already prepared). The caller makes sure caching is on and no streamed reply is still
    being read.
    """
    stopped = stop or (lambda: False)
    recorder.flush()  # idle time: the capture costs no request anything
    if stopped():
        return 0
    exact = seq.live_exact()
    if seq.lone_decodes_exact and exact == seq.n_tokens > seq.reply_start:
        start = exact  # the reply is exact as generated: only what follows it is left
    # one token alone cannot be decoded as a batch: the next prefill takes it along
    elif (
        exact != seq.aligned(seq.reply_start)
        or not gains_boundary(seq, exact)
        or seq.n_tokens - exact < 2
    ):
        return 0
    else:
        start = seq.aligned(seq.reply_start)
    ahead = predicted_continuation(seq) if seq.reply_repairable else []
    if start == seq.n_tokens:
        seq.last_sampled = None  # decoded now: a second call predicts nothing more
        if not ahead:
            return 0
    repaired: list[int] = []
    if not guard(cache, "prepare", None, lambda: repaired.append(repair(seq, start, ahead))):
        seq.drop()  # a half-repaired reply is neither the old cells nor exact
        return 0
    cache.count_prepared(repaired[0])  # before ``stopped`` is asked again: a server watches it
    parked = cache.counters.parked
    if parked and not stopped():
        # a failed checkpoint leaves the working sequence as it was: the next request parks
        guard(cache, "park", None, lambda: park(seq, cache, seq.exact_tokens()))
        if cache.counters.parked > parked:
            cache.count_parked_ahead()
    return repaired[0]


def predicted_continuation(seq: WorkingSequence) -> list[int]:
    """How a chat's next prompt continues the live reply: its last sampled token, which the
    reply's text holds unless it ended the generation, then the template's head (see
    ``chat_head.py``; found once per model). Empty where the template gives no head."""
    if seq.chat_head is None:
        seq.chat_head = template_head(seq.llm)
    last = seq.last_sampled
    if not seq.chat_head or last is None:
        return []
    if llama_cpp.llama_vocab_is_eog(seq.llm._model.vocab, last):
        return seq.chat_head  # the template writes its own end of turn
    return [last, *seq.chat_head]
