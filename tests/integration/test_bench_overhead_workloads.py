"""The overhead benchmark: its workload builders make prompts of the sizes it claims (real
tokenizer), its rounds interleave the modes, and its table pairs each mode with plain's round.

The workloads and the table live in ``tests/`` (``overhead_workloads.py``, ``overhead_table.py``);
``benchmarks/bench_overhead.py`` imports them from there, so this test needs nothing from
``benchmarks/``."""

from __future__ import annotations

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


def _row(round_index: int, mode: str, request_s: list[float], cpu_s: float) -> dict[str, Any]:
    return {
        "workload": "chat",
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
