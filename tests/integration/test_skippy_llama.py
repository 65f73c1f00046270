"""SkippyLlama as a drop-in Llama: same greedy outputs, far fewer prefilled tokens (SmolLM2)."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest
from modelhelpers import TEXT, CountingLlama, aligned, short_of_a_boundary

from skippy_llama.config import Settings
from skippy_llama.costs import CostModel
from skippy_llama.events import CacheEvent
from skippy_llama.runtime.baseline import ColdLlama
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.workload import SYSTEM_PROMPT

pytestmark = pytest.mark.model

USERS = {
    "a": ["What is a lighthouse for?", "Who keeps it?", "Is it lonely?", "Thanks, bye."],
    "b": ["Tell me about tides.", "Why two a day?", "What is a spring tide?", "Thanks!"],
    "c": ["How is bread made?", "What does yeast do?", "And sourdough?", "Great."],
    "d": ["Why is the sky blue?", "And sunsets red?", "What about Mars?", "Cool."],
}


def _interleaved(llm: object, max_tokens: int = 24) -> list[str]:
    histories: dict[str, list[dict[str, str]]] = {k: [] for k in USERS}
    outputs = []
    for turn in range(4):
        for name, turns in USERS.items():
            history = histories[name]
            history.append({"role": "user", "content": turns[turn]})
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, *history]
            out = llm.create_chat_completion(  # type: ignore[attr-defined]
                messages=messages, max_tokens=max_tokens, temperature=0.0
            )
            text = out["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": text})
            outputs.append(text)
    return outputs


def test_interleaved_chats_match_plain_llama_with_a_fraction_of_the_prefill(
    smollm2_path: Path,
    always_restore: CostModel,  # on a GPU, L1 may serve a short prompt cold where that is faster
) -> None:
    skippy = SkippyLlama(
        str(smollm2_path),
        n_ctx=2048,
        verbose=False,
        cache_settings=Settings(),
        cost_model=always_restore,
    )
    # where reuse ends on canonical batch boundaries, only a reply that crosses one past the
    # shared system prompt is repaired: at 24 tokens none does with a 64-token granule (turn 2's
    # prompts end 2 short of a boundary, but their exact part ends at the shared prefix), so
    # replies may run a granule longer there
    max_tokens = 24 if skippy.granule == 1 else 24 + skippy.granule
    plain = CountingLlama(str(smollm2_path), n_ctx=2048, verbose=False)
    try:
        plain_out = _interleaved(plain, max_tokens)
        plain_prefill = sum(plain.prefilled)
    finally:
        plain.close()
    # the reference is a cold prefill of every prompt: plain Llama reuses its own live cells,
    # generated ones included, which equals cold only where bits do not depend on the batch
    # split (CPU, flash attention off: there the two agree, as checked here)
    cold = ColdLlama(str(smollm2_path), n_ctx=2048, verbose=False)
    try:
        expected = _interleaved(cold, max_tokens)
    finally:
        cold.close()

    events: list[CacheEvent] = []
    original = skippy.create_chat_completion

    def recording(**kwargs: object) -> object:
        out = original(**kwargs)
        event = skippy.last_cache_event
        assert event is not None
        events.append(event)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == event.cached_tokens
        return out

    skippy.create_chat_completion = recording  # type: ignore[method-assign]
    try:
        got = _interleaved(skippy, max_tokens)
    finally:
        skippy.close()
    assert got == expected
    if skippy.granule == 1:
        assert plain_out == expected
    skippy_prefill = sum(e.suffix_tokens for e in events)
    assert len(plain.prefilled) == len(events) == 16
    # where reuse ends on canonical batch boundaries, each request may prefill up to a granule more
    slack = (skippy.granule - 1) * len(events)
    assert skippy_prefill <= 0.4 * plain_prefill + slack, (skippy_prefill, plain_prefill)
    # every later turn of a conversation is served from a resident prefix
    assert all(e.tier == "l1" and e.cached_tokens > 0 for e in events[4:])
    # chat replies are repaired by default (l1.repair_generated "auto") when the next request
    # leaves their chat, so the chat's next turn extends them; interleaving makes every request
    # after the first leave the previous chat (where batches are split canonically, only the
    # cells up to the previous prompt's last granule boundary are kept, and a prompt shorter
    # than one granule keeps none: nothing to repair then; where lone decodes are exact, a
    # reply's cells already are what a cold prefill computes: nothing to repair either)
    if skippy.lone_decodes_exact:
        assert all(e.repaired_tokens == 0 for e in events)
    elif skippy.granule == 1:
        assert all(e.repaired_tokens > 0 for e in events[1:])
    else:
        assert any(e.repaired_tokens > 0 for e in events[1:])
    assert events[0].repaired_tokens == 0


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_continued_completion_matches_plain_llama_with_or_without_repair(
    smollm2_path: Path, mode: str
) -> None:
    prompt = TEXT + "The keeper counted"
    skippy = SkippyLlama(
        str(smollm2_path),
        n_ctx=2048,
        verbose=False,
        cache_settings=Settings(l1={"repair_generated": mode}),
    )
    try:
        reply = skippy.create_completion(prompt, max_tokens=12, temperature=0.0)
        first = skippy.last_cache_event
        assert reply["usage"]["completion_tokens"] > 2  # a reply to continue
        follow = prompt + reply["choices"][0]["text"] + " Then, at the top, he"
        got = skippy.create_completion(follow, max_tokens=12, temperature=0.0)
        second = skippy.last_cache_event
        n_prompt = len(skippy.tokenize(prompt.encode()))
    finally:
        skippy.close()
    plain = llama_cpp.Llama(str(smollm2_path), n_ctx=2048, verbose=False)
    try:
        want = plain.create_completion(follow, max_tokens=12, temperature=0.0)
    finally:
        plain.close()
    assert isinstance(want, dict)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert first is not None and second is not None and second.tier == "l1"
    # a prompt that extends the reply decodes the reply within its own prefill (one batch, as a
    # cold prefill would), or reuses it where lone decodes are exact: nothing is repaired
    assert first.repaired_tokens == second.repaired_tokens == 0
    n_reply = reply["usage"]["completion_tokens"] if skippy.lone_decodes_exact else 0
    assert aligned(skippy, n_prompt - 1) <= second.cached_tokens <= n_prompt + n_reply


def test_a_reply_left_for_another_prompt_is_repaired_and_reused(smollm2_path: Path) -> None:
    """``always``: a raw reply is repaired when the next prompt leaves it, then reused exactly."""
    skippy = SkippyLlama(
        str(smollm2_path),
        n_ctx=2048,
        verbose=False,
        cache_settings=Settings(l1={"repair_generated": "always"}),
    )
    try:
        # the 12-token reply must cross a granule boundary to be repaired (any reply does where
        # the granule is 1; a reply inside one granule is not: see SkippyLlama._gains_boundary)
        prompt = short_of_a_boundary(
            skippy,
            lambda filler: TEXT + (filler and filler + " ") + "The keeper counted",
            skippy.granule,
            room=6,
        )
        reply = skippy.create_completion(prompt, max_tokens=12, temperature=0.0)
        n_generated = reply["usage"]["completion_tokens"]
        skippy.create_completion("Something else entirely. " * 4, max_tokens=4, temperature=0.0)
        other = skippy.last_cache_event
        follow = prompt + reply["choices"][0]["text"] + " Then, at the top, he"
        got = skippy.create_completion(follow, max_tokens=12, temperature=0.0)
        back = skippy.last_cache_event
        n_prompt = len(skippy.tokenize(prompt.encode()))
    finally:
        skippy.close()
    plain = llama_cpp.Llama(str(smollm2_path), n_ctx=2048, verbose=False)
    try:
        want = plain.create_completion(follow, max_tokens=12, temperature=0.0)
    finally:
        plain.close()
    assert isinstance(want, dict)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert other is not None and back is not None
    # the repair starts at the granule boundary at or before the reply (none is needed where
    # lone decodes are exact: the reply is parked as generated)
    if skippy.lone_decodes_exact:
        assert other.repaired_tokens == 0
    else:
        assert 0 < other.repaired_tokens <= n_generated + skippy.granule
    assert back.tier == "l1"
    assert back.cached_tokens >= aligned(skippy, n_prompt + n_generated - 3)


def test_completion_reports_cached_tokens_and_event(smollm2_path: Path) -> None:
    llm = SkippyLlama(str(smollm2_path), n_ctx=2048, verbose=False, cache_settings=Settings())
    try:
        first = llm.create_completion(TEXT + "Question one:", max_tokens=4, temperature=0.0)
        cold = llm.last_cache_event
        llm.create_completion("Something else entirely.", max_tokens=4, temperature=0.0)
        second = llm.create_completion(TEXT + "Question two:", max_tokens=4, temperature=0.0)
        warm = llm.last_cache_event
    finally:
        llm.close()
    assert cold is not None and cold.tier == "cold" and cold.cached_tokens == 0
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm is not None and warm.tier == "l1"
    assert warm.cached_tokens >= aligned(llm, 151)  # the shared text, found resident
    assert warm.suffix_tokens == warm.prompt_tokens - warm.cached_tokens
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == warm.cached_tokens
    assert warm.ttft_ms > 0 and warm.lookup_ms >= 0


def test_generate_and_eval_use_the_cache(smollm2_path: Path, always_restore: CostModel) -> None:
    llm = SkippyLlama(
        str(smollm2_path),
        n_ctx=2048,
        verbose=False,
        cache_settings=Settings(),
        cost_model=always_restore,
    )
    plain = CountingLlama(str(smollm2_path), n_ctx=2048, verbose=False)
    try:
        tokens = llm.tokenize(TEXT.encode())
        llm.eval(tokens)  # a standalone prefill is parked too
        other = llm.tokenize(b"Unrelated words here.")
        next(llm.generate(other, temp=0.0))
        gen = llm.generate(tokens + other[1:], temp=0.0)
        got = [next(gen) for _ in range(5)]
        gen.close()
        event = llm.last_cache_event
        plain_gen = plain.generate(tokens + other[1:], temp=0.0)
        want = [next(plain_gen) for _ in range(5)]
        plain_gen.close()
        llm.reset()
        llm.eval(tokens[:-3])
        eval_event = llm.last_cache_event
    finally:
        llm.close()
        plain.close()
    assert got == want
    assert event is not None and event.tier == "l1"
    assert event.cached_tokens >= aligned(llm, len(tokens) - 2)
    assert eval_event is not None and eval_event.tier == "l1"
    assert eval_event.cached_tokens == aligned(llm, len(tokens) - 5)


def test_disabled_l1_is_plain_llama(smollm2_path: Path) -> None:
    settings = Settings(l1={"enabled": False})
    llm = SkippyLlama(str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=settings)
    try:
        llm.create_completion(TEXT, max_tokens=2, temperature=0.0)
        llm.create_completion("Other.", max_tokens=2, temperature=0.0)
        llm.create_completion(TEXT, max_tokens=2, temperature=0.0)
        event = llm.last_cache_event
        assert llm.n_ctx() == 1024
    finally:
        llm.close()
    assert event is not None and event.tier == "cold"
