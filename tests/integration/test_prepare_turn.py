"""``SkippyLlama.prepare_next_turn``: a reply re-decoded between requests is reused by the next
turn, and the next turn still equals a cold prefill (SmolLM2)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from modelhelpers import TEXT, aligned, cold_logits, last_logits, short_of_a_boundary

from skippy_llama.config import Settings
from skippy_llama.costs import AlwaysRestore, CostModel
from skippy_llama.events import CacheEvent
from skippy_llama.runtime.baseline import ColdLlama
from skippy_llama.runtime.chat_head import template_head
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.workload import SYSTEM_PROMPT

pytestmark = pytest.mark.model

PROMPT = TEXT + "The keeper counted"
#: Each turn's question for chat 1 and chat 2 (different, so neither chat is the other's prefix).
QUESTIONS = (
    ("What is a lighthouse for?", "Why is the light red?"),
    ("Who keeps it?", "When was it built?"),
)
MORE = " Then, at the top, he"


def _skippy(path: Path, costs: CostModel | None = None, **l1: object) -> SkippyLlama:
    return SkippyLlama(
        str(path), n_ctx=2048, verbose=False, cache_settings=Settings(l1=l1), cost_model=costs
    )


def test_a_prepared_reply_is_reused_with_the_logits_of_a_cold_prefill(smollm2_path: Path) -> None:
    with_prep, without = _skippy(smollm2_path), _skippy(smollm2_path)
    cold = ColdLlama(str(smollm2_path), n_ctx=2048, verbose=False)
    try:
        assert with_prep.prepare_next_turn() == 0  # nothing decoded yet
        events, texts, logits = [], [], []
        # a reply that reaches past a canonical boundary (where the granule is over one token,
        # re-decoding a reply inside one granule gains nothing, and prepare does nothing)
        max_tokens = 12 + with_prep.granule
        if with_prep.lone_decodes_exact:
            pytest.skip(
                "lone decodes are exact here: replies are reused unprepared (test_lone_decode)"
            )
        for llm, prepare in ((with_prep, True), (without, False)):
            reply = llm.create_completion(PROMPT, max_tokens=max_tokens, temperature=0.0)
            n_generated = reply["usage"]["completion_tokens"]
            if prepare:
                prepared = llm.prepare_next_turn()
                # the evaluated reply tokens (the last sampled one is never decoded), from the
                # granule boundary at or before the reply
                assert 2 <= prepared <= n_generated - 1 + llm.granule, (prepared, n_generated)
                assert llm.prepare_next_turn() == 0  # already prepared
            follow = PROMPT + reply["choices"][0]["text"] + MORE
            # one token: the context's last logits are then the prompt's last token's
            texts.append(llm.create_completion(follow, max_tokens=1, temperature=0.0))
            events.append(llm.last_cache_event)
            logits.append(last_logits(llm))
        tokens = with_prep.tokenize(follow.encode())
        n_more = len(with_prep.tokenize(MORE.encode(), add_bos=False))
        n_first = len(with_prep.tokenize(PROMPT.encode()))
        want = cold_logits(cold, tokens)
        status = with_prep.cache_status()["counters"]
    finally:
        for each in (with_prep, without, cold):
            each.close()
    prepared_event, plain_event = events
    assert texts[0]["choices"][0]["text"] == texts[1]["choices"][0]["text"]
    # the last prompt token's logits equal a cold prefill's, bit for bit, with or without
    assert np.array_equal(logits[0], want) and np.array_equal(logits[1], want)
    assert prepared_event is not None and plain_event is not None
    assert prepared_event.tier == plain_event.tier == "l1"
    # prepared: the reply is reused; not prepared: it is prefilled again inside the prompt
    assert prepared_event.cached_tokens >= aligned(with_prep, len(tokens) - n_more - 2)
    assert plain_event.cached_tokens <= aligned(without, n_first)
    assert prepared_event.suffix_tokens < plain_event.suffix_tokens
    assert prepared_event.repaired_tokens == 0
    assert status["turns_prepared"] == 1 and status["tokens_prepared"] == prepared
    assert status["parked"] == status["parked_ahead"] == 0  # one chat: nothing to keep aside


def test_prepare_re_decodes_only_what_reaches_a_whole_granule(smollm2_path: Path) -> None:
    """With reuse on whole granules (flash attention on the CPU: the kernels depend on the batch
    split), re-decoding a reply that ends inside the granule it starts in makes no cell exact:
    prepare skips it, and a prepared reply is never re-decoded again."""
    llm = SkippyLlama(
        str(smollm2_path), n_ctx=2048, verbose=False, flash_attn=True, n_batch=64, n_ubatch=64
    )
    try:
        granule = llm.granule
        short = llm.create_completion(PROMPT, max_tokens=2, temperature=0.0)
        assert granule == 64 and short["usage"]["completion_tokens"] == 2
        start = len(llm.tokenize(PROMPT.encode()))
        inside = start // granule == (start + 1) // granule  # the evaluated reply token
        assert llm.prepare_next_turn() == 0 or not inside
        llm.create_completion(PROMPT, max_tokens=12 + granule, temperature=0.0)
        prepared = llm.prepare_next_turn()
        assert prepared >= granule
        assert llm.prepare_next_turn() == 0  # the tail after the last boundary stays as it is
        assert llm.cache_status()["counters"]["turns_prepared"] == 1 + int(not inside)
    finally:
        llm.close()


def test_a_prepared_chat_turn_also_reuses_the_templates_head(smollm2_path: Path) -> None:
    """After a chat reply, prepare decodes the template's glue before the next user message
    (ChatML: ``<|im_end|>\n<|im_start|>user\n``) with the reply (after its last sampled token
    when the reply was cut by ``max_tokens``), so the next turn prefills only from the new
    message on; its logits still equal a cold prefill's, bit for bit."""
    llm = _skippy(smollm2_path)
    cold = ColdLlama(str(smollm2_path), n_ctx=2048, verbose=False)
    try:
        head = template_head(llm)
        assert [llm._model.token_get_text(t) for t in head] == [
            "<|im_end|>", "Ċ", "<|im_start|>", "user", "Ċ"
        ]  # fmt: skip
        # the 12-token reply must cross a canonical boundary to be prepared (where the granule
        # is above 1, a reply inside one granule makes no cell exact: nothing is decoded)
        history = short_of_a_boundary(
            llm,
            lambda filler: [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": (filler and filler + " ") + QUESTIONS[0][0]},
            ],
            llm.granule,
            room=6,
        )
        reply = llm.create_chat_completion(messages=history, max_tokens=12, temperature=0)
        live = llm.n_tokens  # the prompt and the reply's evaluated tokens
        prepared = llm.prepare_next_turn()
        # the head, after the reply's last sampled token where that was not its end of turn
        ahead = llm.n_tokens - live
        assert ahead in (len(head), len(head) + 1)
        # where lone decodes are exact the reply is kept as generated: only the head is decoded
        assert prepared == ahead if llm.lone_decodes_exact else prepared > ahead
        predicted = llm.input_ids[live : live + ahead].tolist()
        assert predicted[-len(head) :] == head
        history += [
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": QUESTIONS[1][0]},
        ]
        llm.create_chat_completion(messages=history, max_tokens=1, temperature=0)
        event = llm.last_cache_event
        assert event is not None
        tokens = llm.input_ids[: event.prompt_tokens].tolist()
        got = last_logits(llm)
        want = cold_logits(cold, tokens)
    finally:
        llm.close()
        cold.close()
    # the reply and the head were reused: the prefill starts at the new message
    assert tokens[live : live + ahead] == predicted
    assert event.cached_tokens >= aligned(llm, live + ahead)
    assert np.array_equal(got, want)


def _two_chats(
    llm: SkippyLlama | ColdLlama, prepare: bool, stop: Callable[[], bool] | None = None
) -> tuple[list[str], list[object]]:
    """Two chats served turn by turn; ``prepare``: between requests, as a server does."""
    histories: list[list[Any]] = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(2)]
    texts: list[str] = []
    events: list[object] = []
    for turn in QUESTIONS:
        for history, question in zip(histories, turn, strict=True):
            history.append({"role": "user", "content": question})
            out = llm.create_chat_completion(messages=history, max_tokens=12, temperature=0)
            assert isinstance(out, dict)
            events.append(llm.last_cache_event)
            if prepare:
                assert isinstance(llm, SkippyLlama)
                llm.prepare_next_turn(stop)
            texts.append(str(out["choices"][0]["message"]["content"]))
            history.append({"role": "assistant", "content": texts[-1]})
    return texts, events


def _against_cold(
    llm: SkippyLlama, smollm2_path: Path, stop: Callable[[], bool] | None = None
) -> tuple[list[str], list[str], list[object], dict[str, int], int]:
    """``_two_chats`` on ``llm`` (prepared between turns, then closed) and on a cold model:
    (llm's replies, the cold replies, llm's events, llm's counters, llm's granule)."""
    cold = ColdLlama(str(smollm2_path), n_ctx=2048, verbose=False)
    try:
        got, events = _two_chats(llm, prepare=True, stop=stop)
        want, _ = _two_chats(cold, prepare=False)
        return got, want, events, llm.cache_status()["counters"], llm.granule
    finally:
        llm.close()
        cold.close()


def test_a_prepared_chat_is_parked_whole_when_another_chat_comes(smollm2_path: Path) -> None:
    """Interleaved chats with ``repair_generated=never`` (the server's default): a reply prepared
    before another user's turn is kept with its chat, so that chat's next turn reuses it, and
    the chat is checkpointed when prepared, not when the next request displaces it.

    The chats share their system prompt, so the tail another chat's turn destroys is shorter
    than a page: the default cost model prefills it again rather than park (``plan.py``); the
    parks are what this test is about, so they are forced (``AlwaysRestore``)."""
    llm = _skippy(smollm2_path, AlwaysRestore(), repair_generated="never")
    got, want, events, status, granule = _against_cold(llm, smollm2_path)
    assert got == want
    assert all(isinstance(e, CacheEvent) and e.repaired_tokens == 0 for e in events)
    # (where the granule is over one token, a reply inside one granule is not re-decoded)
    assert status["turns_prepared"] == 4 or (granule > 1 and status["turns_prepared"] <= 4)
    # chat A is checkpointed when chat B first displaces it, on that request; every later turn
    # was checkpointed when prepared, so the requests that displaced them paid no checkpoint
    # (on GPU builds a checkpoint may not pay for a short chat: then none is taken)
    assert status["parked"] - status["parked_ahead"] == min(status["parked"], 1)
    assert status["parked_ahead"] == 3 or granule > 1
    # each chat's second turn reuses its first turn's prompt and reply: only the new message
    # and the template around it are prefilled (on GPU builds reuse ends on whole granules,
    # which a 12-token reply may not complete)
    for first, second in zip(events[:2], events[2:], strict=True):
        assert isinstance(first, CacheEvent) and isinstance(second, CacheEvent)
        assert second.tier == "l1"
        assert second.cached_tokens > first.prompt_tokens or granule > 1


@pytest.mark.parametrize("steps", [0, 1])
def test_a_request_waiting_stops_the_preparation_between_steps(
    smollm2_path: Path, steps: int
) -> None:
    """``stop`` (a server: "a request is waiting") is asked between the steps: true at once,
    nothing is prepared; true after the re-decode, the chat is not checkpointed ahead (the
    request that displaces it does that). Outputs stay those of a cold run. Parks are forced,
    as in the test above."""
    asked: list[int] = []
    llm = _skippy(smollm2_path, AlwaysRestore(), repair_generated="never")

    def stop() -> bool:
        # 0: at once; 1: once a reply was re-decoded (the count moved since the last ask)
        asked.append(llm.prefix_cache.counters.turns_prepared)
        return steps == 0 or (len(asked) > 1 and asked[-1] != asked[-2])

    got, want, _, status, granule = _against_cold(llm, smollm2_path, stop)
    assert got == want
    assert status["parked_ahead"] == 0
    if steps == 0:
        assert status["turns_prepared"] == 0 and len(asked) == 4
    else:  # GPU builds may prepare nothing (a reply inside one granule is not re-decoded)
        # and checkpoint nothing (a short chat's checkpoint may not pay for itself there)
        assert granule > 1 or (status["turns_prepared"] > 0 and status["parked"] > 0)
