"""L1 stream copies and L2/L3 restores in one context never mix their bytes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from modelhelpers import TEXT, aligned

from skippy_llama.config import Settings
from skippy_llama.costs import AlwaysRestore
from skippy_llama.runtime.llama import DEFER_RECORD_TOKENS, SkippyLlama
from skippy_llama.tiers.l3.tier import DiskTier
from skippy_llama.tiers.records import PrefixRecord

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
        assert llm.last_cache_event is not None and llm.last_cache_event.tier == "l1"
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


def _held_writer(llm: SkippyLlama) -> tuple[threading.Event, DiskTier]:
    """Hold ``llm``'s L3 writer inside the first record it takes until the event is set."""
    disk = llm.prefix_cache.disk
    assert disk is not None
    gate = threading.Event()
    real_write = disk._writer._write
    first: list[PrefixRecord] = []

    def held(rec: PrefixRecord) -> None:
        if not first:
            first.append(rec)
            gate.wait(600)  # set by the test; the bound only keeps a failing test finite
        real_write(rec)

    disk._writer._write = held
    return gate, disk


@pytest.mark.parametrize(
    ("race", "defer"), [("waiting", False), ("waiting", True), ("writing", False)]
)
def test_a_prefix_in_flight_to_l3_is_a_hit_with_cold_outputs(
    tmp_path: Path, smollm2_path: Path, race: str, defer: bool
) -> None:
    """Issue 42: documents A, B, B, A with the prefix of A out of L1 (L1 off) while its L3
    record has not been written: A is served from L3, from the record's capture while it waits
    (``waiting``; also when records wait on the sequence as on GPU builds, ``defer``) or once
    the write the lookup raced ends (``writing``), with the outputs of a cold prefill."""
    from llama_cpp import Llama

    doc_a = TEXT + " Question: how many steps are there?"
    doc_b = "Ships and harbours: " + TEXT[::-1][:700] + " Question: what is reversed?"
    other = "A short note on lanterns and the sea, " * 8
    prompts = [doc_a, doc_b, doc_b, doc_a]
    plain = Llama(str(smollm2_path), n_ctx=1024, verbose=False)
    try:
        cold: list[Any] = []
        for prompt in prompts:
            plain.reset()
            cold.append(plain.create_completion(prompt, max_tokens=8, temperature=0.0))
    finally:
        plain.close()

    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path), "minimum_free": "1GiB"}
    settings = Settings(l3=l3, l2={"budget": "256MiB"}, l1={"enabled": False})
    llm = SkippyLlama(
        str(smollm2_path),
        n_ctx=1024,
        verbose=False,
        cache_settings=settings,
        cost_model=AlwaysRestore(),  # a GPU build's costs may serve these short prompts cold
    )
    llm.defer_record_tokens = DEFER_RECORD_TOKENS if defer else 0
    gate, disk = _held_writer(llm)
    writer = disk._writer
    if race == "writing":
        # A's record is the one held; the lookup of the second A lets it go once it waits
        real_wait = writer.wait_written

        def wait_written(keys: Any, timeout: float = 5.0) -> bool:
            if writer._writing(keys):
                threading.Timer(0.2, gate.set).start()
            return real_wait(keys, timeout)

        writer.wait_written = wait_written  # type: ignore[method-assign]
    try:
        if race == "waiting":
            # the writer is held inside another record, so A's waits in the queue behind it
            # (a waiting record of it is made when A takes the sequence)
            llm.create_completion(other, max_tokens=2, temperature=0.0)
        replies, tiers = [], []
        for prompt in prompts:
            replies.append(llm.create_completion(prompt, max_tokens=8, temperature=0.0))
            event = llm.last_cache_event
            assert event is not None
            tiers.append((event.tier, event.fallbacks))
        read = disk.status().process_activity
        held = gate.is_set()
        gate.set()
        assert llm.flush_cache(30)
    finally:
        gate.set()
        llm.close()
    assert tiers[3] == ("l3", [])
    if race == "waiting":
        assert not held and read.pages_read_in_flight > 0  # made from the waiting record
    else:
        assert held and read.pages_read_in_flight == 0  # read from the store once written
    for got, want in zip(replies, cold, strict=True):
        assert got["choices"][0]["text"] == want["choices"][0]["text"]

    # and the record the lookup raced was written as usual: a new process finds A in L3
    again = SkippyLlama(
        str(smollm2_path),
        n_ctx=1024,
        verbose=False,
        cache_settings=settings,
        cost_model=AlwaysRestore(),
    )
    try:
        reply = again.create_completion(doc_a, max_tokens=8, temperature=0.0)
        event = again.last_cache_event
    finally:
        again.close()
    assert event is not None and event.tier == "l3"
    assert reply["choices"][0]["text"] == cold[0]["choices"][0]["text"]
