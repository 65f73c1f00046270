"""Chat repair: re-decode a generated reply as one batch, so the next turn reuses it exactly.

A reply's tokens are decoded one at a time, and on stock llama.cpp those cells differ in the low
bits from the batched prefill a cold prompt gets; keeping them would make a later turn's output
depend on the cache. A next turn that extends the reply decodes it again inside its own prefill;
:func:`prepare_next_turn` does it earlier, while nothing waits, and :func:`displace` before a
prompt leaves the live sequence for another chat.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import llama_cpp

from ..events import CacheEvent
from .chat_head import template_head

if TYPE_CHECKING:
    from .llama import SkippyLlama


def gains_boundary(llm: SkippyLlama, exact: int) -> bool:
    """Whether re-decoding the cells after ``exact`` makes more of them exact: only up to
    the last canonical boundary (the cells after it are decoded again by the next prefill
    on a batch-split-sensitive backend), so a reply inside one granule gains nothing."""
    return llm.aligned(llm.n_tokens) > exact


def repair(llm: SkippyLlama, start: int, ahead: Sequence[int] = ()) -> int:
    """Re-decode the working sequence from ``start`` (the last reply's canonical boundary) as
    one batch so its cells equal a cold prefill's, and decode ``ahead`` (tokens predicted to
    follow it) in the same batch. Returns the tokens decoded."""
    tokens = [*llm.input_ids[start : llm.n_tokens].tolist(), *ahead]
    llm.seam.cut(start)
    llm.n_tokens = start
    llm.decode(tokens)
    return len(tokens)


def displace(llm: SkippyLlama, exact: int, event: CacheEvent) -> None:
    """Checkpoint the live sequence's exact part; a chat reply after it is repaired first.

    Done only when a prompt leaves the live sequence, never after each reply: a linear chat,
    whose next prompt extends the reply, decodes the reply inside its next prefill (one
    batch, as a cold prefill would) and pays nothing here.
    """
    mode = llm.cache_settings.l1.repair_generated
    start = llm.aligned(llm.reply_start)
    wanted = mode == "always" or (mode == "auto" and llm.reply_repairable)
    if wanted and exact == start and gains_boundary(llm, exact):
        event.repaired_tokens = repair(llm, start)
        exact = llm.exact_tokens()
    llm.park(exact)


def prepare_next_turn(llm: SkippyLlama, stop: Callable[[], bool] | None = None) -> int:
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
    already prepared, caching off, or a streamed reply still being read).
    """
    if not llm.caching or llm.in_generate:
        return 0
    stopped = stop or (lambda: False)
    llm.recorder.flush()  # idle time: the capture costs no request anything
    if stopped():
        return 0
    exact = llm.live_exact()
    if llm.lone_decodes_exact and exact == llm.n_tokens > llm.reply_start:
        start = exact  # the reply is exact as generated: only what follows it is left
    # one token alone cannot be decoded as a batch: the next prefill takes it along
    elif (
        exact != llm.aligned(llm.reply_start)
        or not gains_boundary(llm, exact)
        or llm.n_tokens - exact < 2
    ):
        return 0
    else:
        start = llm.aligned(llm.reply_start)
    ahead = predicted_continuation(llm) if llm.reply_repairable else []
    if start == llm.n_tokens:
        llm.last_sampled = None  # decoded now: a second call predicts nothing more
        if not ahead:
            return 0
    repaired: list[int] = []
    if not llm.guard("prepare", None, lambda: repaired.append(repair(llm, start, ahead))):
        llm.drop_working()  # a half-repaired reply is neither the old cells nor exact
        return 0
    cache = llm.prefix_cache
    cache.count_prepared(repaired[0])  # before ``stopped`` is asked again: a server watches it
    parked = cache.counters.parked
    if parked and not stopped():
        # a failed checkpoint leaves the working sequence as it was: the next request parks
        llm.guard("park", None, lambda: llm.park(llm.exact_tokens()))
        if cache.counters.parked > parked:
            cache.count_parked_ahead()
    return repaired[0]


def predicted_continuation(llm: SkippyLlama) -> list[int]:
    """How a chat's next prompt continues the live reply: its last sampled token, which the
    reply's text holds unless it ended the generation, then the template's head (see
    ``chat_head.py``; found once per model). Empty where the template gives no head."""
    if llm.chat_head is None:
        llm.chat_head = template_head(llm)
    last = llm.last_sampled
    if not llm.chat_head or last is None:
        return []
    if llama_cpp.llama_vocab_is_eog(llm._model.vocab, last):
        return llm.chat_head  # the template writes its own end of turn
    return [last, *llm.chat_head]
