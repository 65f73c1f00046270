"""L1 stream copies and L2/L3 restores in one context never mix their bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from modelhelpers import TEXT, aligned

from skippy_llama.config import Settings
from skippy_llama.costs import AlwaysRestore
from skippy_llama.runtime.llama import SkippyLlama

pytestmark = pytest.mark.model


def test_a_parked_prefix_survives_a_following_l3_restore(
    tmp_path: Path, smollm2_path: Path
) -> None:
    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path), "minimum_free": "1GiB"}
    other = "Ships and harbours: " + TEXT[::-1][:900]
    first = TEXT + " So the keeper wrote:"
    # fill L3 with `other` from a separate instance, and take a cold reference for `first`
    filler = SkippyLlama(
        str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings(l3=l3)
    )
    try:
        filler.create_completion(other, max_tokens=2, temperature=0.0)
        filler.reset()
        cold = filler.create_completion(first + " again", max_tokens=8, temperature=0.0)
    finally:
        filler.close()

    # restores forced: a GPU build's measured costs may serve this short prompt cold
    llm = SkippyLlama(
        str(smollm2_path),
        n_ctx=1024,
        verbose=False,
        cache_settings=Settings(l3=l3),
        cost_model=AlwaysRestore(),
    )
    try:
        llm.create_completion(first, max_tokens=4, temperature=0.0)  # parked in a resident stream
        llm.create_completion(other, max_tokens=2, temperature=0.0)  # restored from L3
        event = llm.last_cache_event
        assert event is not None and event.tier == "l3"
        warm = llm.create_completion(first + " again", max_tokens=8, temperature=0.0)
        assert llm.last_cache_event.tier == "l1"
    finally:
        llm.close()
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]


def test_siblings_find_the_exact_branch_point_in_l3(tmp_path: Path, smollm2_path: Path) -> None:
    """Questions over one document reuse all of it after a restart, not only whole pages."""
    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path), "minimum_free": "1GiB"}
    questions = ["Who climbs the stairs?", "What does he polish?", "What did he hear?"]
    first = SkippyLlama(
        str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings(l3=l3)
    )
    try:
        doc_tokens = len(first.tokenize((TEXT + "\nQuestion:").encode()))
        for question in questions[:2]:
            first.create_completion(f"{TEXT}\nQuestion: {question}", max_tokens=2, temperature=0.0)
    finally:
        first.close()
    assert doc_tokens % 128 != 0  # the branch point falls inside a page

    # a new instance with L1 off must take the shared document from L3, to the token
    settings = Settings(l3=l3, l1={"enabled": False})
    second = SkippyLlama(str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=settings)
    try:
        second.create_completion(f"{TEXT}\nQuestion: {questions[2]}", max_tokens=2, temperature=0.0)
        event = second.last_cache_event
    finally:
        second.close()
    assert event is not None and event.tier == "l3"
    assert event.cached_tokens >= aligned(second, doc_tokens - 1)  # a token may merge there


def test_a_repeated_prompt_gets_cold_logits_from_every_tier(
    tmp_path: Path, smollm2_path: Path
) -> None:
    """An exact repeat still decodes two tokens: a lone token takes other kernels in llama.cpp."""
    from llama_cpp import Llama
    from modelhelpers import last_logits

    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path), "minimum_free": "1GiB"}
    plain = Llama(str(smollm2_path), n_ctx=1024, verbose=False)
    try:
        tokens = plain.tokenize((TEXT * 3).encode())[:600]
        plain.eval(tokens)
        cold = last_logits(plain)
    finally:
        plain.close()

    def first_token_logits(llm: SkippyLlama) -> tuple[str, int, object]:
        gen = llm.generate(tokens, temp=0.0)
        next(gen)
        logits = last_logits(llm)
        gen.close()
        event = llm.last_cache_event
        assert event is not None
        return event.tier, event.cached_tokens, logits

    first = SkippyLlama(
        str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings(l3=l3)
    )
    try:
        tier0, _, logits0 = first_token_logits(first)
        tier1, cached1, logits1 = first_token_logits(first)  # the live sequence
    finally:
        first.close()
    again = SkippyLlama(
        str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings(l3=l3)
    )
    try:
        tier2, cached2, logits2 = first_token_logits(again)  # from disk
    finally:
        again.close()
    assert (tier0, tier1, tier2) == ("cold", "l1", "l3")
    assert cached1 == cached2 == aligned(again, len(tokens) - 2)
    for logits in (logits0, logits1, logits2):
        assert (logits == cold).all()
