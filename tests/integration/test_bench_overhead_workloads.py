"""The overhead benchmark: its workload builders make prompts of the sizes it claims (real
tokenizer), its rounds interleave the modes, and its table pairs each mode with plain's round.

The workloads and the table live in ``tests/`` (``overhead_workloads.py``, ``overhead_table.py``);
``benchmarks/bench_overhead.py`` imports them from there, so this test needs nothing from
``benchmarks/``."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import ModuleType
from typing import Any

import llama_cpp
import overhead_table
import overhead_workloads
import pytest


def _bench() -> ModuleType:
    return overhead_workloads


@pytest.mark.model
def test_workloads_have_the_stated_sizes_and_no_shared_prefix(smollm2_path: Path) -> None:
    bench = _bench()
    vocab = llama_cpp.Llama(str(smollm2_path), vocab_only=True, verbose=False)

    def tokenize(text: str) -> list[int]:
        return list(vocab.tokenize(text.encode(), add_bos=False, special=False))

    sizes = bench.SIZES
    messages = bench.chat_messages(tokenize, sizes.chat_turns)
    assert len(messages) == sizes.chat_turns
    for message in messages:
        assert sizes.user_tokens <= len(tokenize(message)) <= sizes.user_tokens + 40
    # the whole chat (user messages and replies) grows past 3,000 tokens at the full size
    if not bench.QUICK:
        assert (
            sum(len(tokenize(m)) for m in messages) + sizes.chat_turns * sizes.reply_tokens > 3000
        )

    docs = [tokenize(d) for d in bench.documents(tokenize)]
    assert len(docs) == sizes.documents
    assert all(sizes.document_tokens <= len(d) <= sizes.document_tokens + 40 for d in docs)
    firsts = {d[0] for d in docs}
    assert len(firsts) == len(docs), "one-shot documents must not share a prefix"

    parts = bench.continuation_parts(tokenize)
    assert len(parts) == 1 + sizes.continuations
    assert len(tokenize(parts[0])) >= sizes.long_prompt_tokens
    assert all(len(tokenize(p)) <= sizes.continuation_tokens + 40 for p in parts[1:])


@pytest.mark.model
def test_document_workloads_change_only_the_last_tokens_of_a_long_prompt(
    smollm2_path: Path,
) -> None:
    """Same document, next question: ~1,300 tokens of document, then prompts that differ from
    the previous one only in their last ~14 tokens; the restart order asks documents A, B, B,
    A ... with questions the first process never asked."""
    bench = _bench()
    vocab = llama_cpp.Llama(str(smollm2_path), vocab_only=True, verbose=False)

    def tokenize(text: str) -> list[int]:
        return list(vocab.tokenize(text.encode(), add_bos=False, special=False))

    sizes = bench.SIZES
    assert sizes.doc_questions >= 4
    doc = bench.document(tokenize, 0)
    assert sizes.doc_tokens <= len(tokenize(doc)) <= sizes.doc_tokens + 40
    prompts = [tokenize(bench.question_prompt(doc, q)) for q in range(sizes.doc_questions)]
    assert len(set(map(tuple, prompts))) == len(prompts)
    for before, after in itertools.pairwise(prompts):
        shared = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
        assert 10 <= len(after) - shared <= 20, len(after) - shared
    chats = [bench.question_messages(doc, q) for q in range(sizes.doc_questions)]
    assert {c[0]["content"] for c in chats} == {doc}  # the document is the system prompt
    assert len({c[1]["content"] for c in chats}) == len(chats)

    requests = bench.restart_requests()
    assert [chr(ord("A") + d) for d, _ in requests] == list(sizes.restart_order)
    assert sizes.restart_order.startswith("ABBA")
    assert len(set(requests)) == len(requests)  # every request a new question
    first = set(bench.restart_warmup())
    assert {d for d, _ in first} == {d for d, _ in requests} == set(range(sizes.restart_docs))
    assert not first & set(requests)  # the new process asks what the first did not
    assert set(bench.RESTART_WORKLOADS) <= set(bench.WORKLOADS)


def test_rounds_run_every_mode_back_to_back_in_a_rotated_order() -> None:
    bench = _bench()
    cases = bench.CASES
    assert len(cases) == len(bench.WORKLOADS) * bench.ROUNDS * len(bench.MODES)
    for w, workload in enumerate(bench.WORKLOADS):
        for r in range(bench.ROUNDS):
            start = (w * bench.ROUNDS + r) * len(bench.MODES)
            block = cases[start : start + len(bench.MODES)]
            assert {(c[0], c[1]) for c in block} == {(workload, r)}
            assert sorted(c[2] for c in block) == sorted(bench.MODES)
    assert [bench.round_order(r)[0] for r in range(len(bench.MODES))] == list(bench.MODES)


def _row(
    round_index: int, mode: str, request_s: list[float], cpu_s: float, workload: str = "chat"
) -> dict[str, Any]:
    return {
        "workload": workload,
        "round": round_index,
        "mode": mode,
        "total_s": sum(request_s),
        "cpu_s": cpu_s,
        "last_request_s": request_s[-1],
        "last_request_cpu_s": cpu_s / 2,
        "request_s": request_s,
        "close_s": 0.01,
        "close_cpu_s": 0.01,
    }


def test_table_pairs_each_round_with_plains_same_round() -> None:
    table = overhead_table
    # the machine slows by half in round 1: each mode is 1.1x plain within its round
    rows = [
        _row(0, "plain", [1.0, 1.0], 4.0),
        _row(0, "skippy", [1.1, 1.1], 4.4),
        _row(1, "skippy", [1.65, 1.65], 4.8),
        _row(1, "plain", [1.5, 1.5], 4.0),
    ]
    rounds = table.by_round(rows)
    ratios = table.paired_ratios(rounds, "chat", "skippy", lambda i: i["total_s"])
    assert ratios == pytest.approx([1.1, 1.1])
    cpu = table.paired_ratios(rounds, "chat", "skippy", lambda i: i["cpu_s"])
    assert cpu == pytest.approx([1.1, 1.2])
    # the fastest rounds: skippy's round 0 over plain's round 0
    assert table.fastest_ratio(rounds, "chat", "skippy") == pytest.approx(1.1)
    wall = table.wall_table(rounds)
    assert "| chat | skippy | 2 | 2.75 s | **1.10×** (1.10–1.10) | 1.10× |" in wall
    assert "| chat | skippy | 4.60 s | **1.15×** (1.10–1.20) |" in table.cpu_table(rounds)


def test_ttft_and_readme_rows_pair_each_round_with_plains() -> None:
    table = overhead_table
    rows = []
    for r, slow in ((0, 1.0), (1, 2.0)):  # the machine halves its speed in round 1
        for mode, ratio in (("plain", 1.0), ("skippy", 1.04), ("skippy_l3", 0.5)):
            row = _row(r, mode, [slow * ratio, slow * ratio], 1.0, workload="doc_questions")
            row["ttft_s"] = [slow * ratio * 0.1, slow * ratio * 0.2]
            rows.append(row)
    rows.append(_row(0, "skippy", [1.0, 1.0], 1.0))  # not streamed: no TTFT row
    rows.append(_row(0, "plain", [1.0, 1.0], 1.0))
    rounds = table.by_round(rows)
    ttft = table.ttft_table(rounds)
    assert "| doc_questions | skippy | 0.468 s | **1.04×** (1.04–1.04) |" in ttft
    assert "| doc_questions | skippy_l3 | 0.225 s | **0.50×** (0.50–0.50) |" in ttft
    assert "| chat |" not in ttft
    (readme,) = table.readme_rows(rounds, "benchmarks/results/x.json")
    assert readme.startswith("| same document, next question as completions: TTFT / total vs ")
    assert "(defaults / L3 on), median of 2 rounds" in readme
    assert "**1.04× / 1.04×; 0.50× / 0.50×**, last requests 1.04× / 1.04×; 0.50× / 0.50×" in readme
    assert "([result](benchmarks/results/x.json))" in readme


def test_later_requests_are_paired_apart_from_the_first() -> None:
    """The requests after the first, summed per round and paired with plain's same round: the
    cold first request (the same for every mode) does not dilute what the next ones cost."""
    table = overhead_table
    rows = []
    for r, slow in ((0, 1.0), (1, 2.0)):
        for mode, cost in (("plain", 1.0), ("skippy", 1.2)):
            row = _row(r, mode, [10.0 * slow, cost * slow, cost * slow], 1.0, "doc_questions")
            row["request_cpu_s"] = [5.0, cost, cost]
            row["ttft_s"] = [9.0 * slow, cost * slow / 2, cost * slow / 2]
            rows.append(row)
    rows.append(_row(0, "plain", [1.0], 1.0, "oneshot"))  # a single request: no later ones
    later = table.later_table(table.by_round(rows))
    assert (
        "| doc_questions | skippy | 3.600 s | **1.20×** (1.20–1.20) | 2.400 s | **1.20×**" in later
    )
    assert "| 1.800 s | **1.20×** (1.20–1.20) |" in later
    assert "| doc_questions | plain | 3.000 s | – |" in later
    assert "oneshot" not in later


def test_restart_row_gives_each_modes_ttft_spread_over_rounds() -> None:
    """Issue 42's target for interleaved documents after a restart: the slowest round's TTFT
    over the fastest's, per mode, beside plain's own spread on the same machine."""
    table = overhead_table
    rows = []
    for r, (plain_ttft, skippy_ttft) in enumerate(((10.0, 0.5), (14.0, 0.6), (12.0, 0.75))):
        for mode, ttft in (("plain", plain_ttft), ("skippy_l3", skippy_ttft)):
            row = _row(r, mode, [ttft * 2, ttft * 2], 1.0, workload="doc_restart")
            row["ttft_s"] = [ttft / 2, ttft / 2]
            rows.append(row)
    (readme,) = table.readme_rows(table.by_round(rows), "r.json")
    assert readme.startswith("| interleaved documents after a restart")
    assert "TTFT spread over rounds 1.50× (plain 1.40×), replies equal" in readme
