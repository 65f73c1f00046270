"""Prefix-affine sharding, the scheduler's queue, steals and retries, and the round-robin
estimate (``batch --ray``), on token lists: no Ray, no model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from skippy_llama.batch.order import prefix_order
from skippy_llama.batch.shards import (
    MIN_SHARED_TOKENS,
    AffineScheduler,
    chain_prefill,
    lcp,
    plan_shards,
    round_robin_prefill,
)

DOC = 300  # tokens of a document
Q = 12  # tokens of a question


def docs_by_questions(docs: int, questions: int, seed: int = 0) -> list[list[int]]:
    """Keys like the benchmark's: a 2-token common start, a document, a question; shuffled."""
    keys = [
        [1, 2, *range(1000 * (d + 1), 1000 * (d + 1) + DOC - 2), *[50 + q] * Q]
        for d in range(docs)
        for q in range(questions)
    ]
    random.Random(seed).shuffle(keys)
    return keys


def run_all(sched: AffineScheduler, workers: int) -> dict[int, list[int]]:
    """Drive the scheduler as the Ray driver does (two in flight per worker, the oldest
    finishing first, workers taking turns) and return each worker's items in run order."""
    ran: dict[int, list[int]] = {w: [] for w in range(workers)}
    flight: dict[int, list[int]] = {w: [] for w in range(workers)}
    while not sched.done:
        for w in range(workers):
            while len(flight[w]) < 2 and (index := sched.next_item(w)) is not None:
                flight[w].append(index)
        busy = [w for w in range(workers) if flight[w]]
        assert busy, "items left but nothing handed out"
        for w in busy:
            index = flight[w].pop(0)
            sched.finished(w, index)
            ran[w].append(index)
    return ran


def test_lcp_and_chain_prefill_count_what_each_item_adds() -> None:
    assert lcp([1, 2, 3], [1, 2, 4]) == 2 and lcp([], [1]) == 0 and lcp([1, 2], [1, 2]) == 2
    keys = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [9]]
    # 4 cold, then 1 past the shared [1,2,3], then a repeat still evaluates its last token, then 1
    assert chain_prefill(keys, [0, 1, 2, 3]) == 4 + 1 + 1 + 1
    assert chain_prefill(keys, [1], start=0) == 1


def test_documents_become_one_shard_each_and_cover_every_item_once() -> None:
    keys = docs_by_questions(8, 6)
    order = prefix_order(keys)
    shards = plan_shards(keys, order, workers=2)
    assert len(shards) == 8  # the shared 2-token start is below MIN_SHARED_TOKENS: not a shard
    assert sorted(i for s in shards for i in s.items) == list(range(48))
    for shard in shards:
        first = keys[shard.items[0]]
        assert all(lcp(first, keys[i]) >= DOC for i in shard.items)
        assert list(shard.items) == sorted(shard.items, key=order.index)  # trie order inside
    assert [s.cost for s in shards] == sorted((s.cost for s in shards), reverse=True)


def test_one_shared_system_prompt_is_split_at_a_trie_branching_for_idle_workers() -> None:
    system = list(range(500, 700))  # 200 tokens every item starts with
    keys = [[*system, 7, g, *[g * 10 + i] * 20] for g in range(3) for i in range(10)]
    order = prefix_order(keys)
    (whole,) = plan_shards(keys, order, workers=1)
    assert len(whole.items) == 30
    parts = plan_shards(keys, order, workers=2)
    assert sorted(len(s.items) for s in parts) == [10, 20]  # cut between branches g=0|1|2
    # the price of the cut: the prefix shared across it, prefilled once more
    assert sum(chain_prefill(keys, list(s.items)) for s in parts) == chain_prefill(
        keys, order
    ) + lcp(keys[order[9]], keys[order[10]])


def test_affine_run_prefills_what_one_process_does_and_round_robin_far_more() -> None:
    keys = docs_by_questions(8, 6)
    order = prefix_order(keys)
    one = chain_prefill(keys, order)
    sched = AffineScheduler(keys, plan_shards(keys, order, 2, item_cost=40), item_cost=40)
    ran = run_all(sched, 2)
    assert sorted(ran[0] + ran[1]) == list(range(48))
    assert sched.prefill_by_plan == sum(chain_prefill(keys, r) for r in ran.values())
    assert sched.prefill_by_plan <= 1.1 * one
    assert abs(len(ran[0]) - len(ran[1])) <= 6  # documents spread over both
    assert sched.schedule_speedup >= 1.7  # four documents each: the two end about together
    rr = round_robin_prefill(keys, order, 2)
    assert rr >= 1.5 * sched.prefill_by_plan
    assert round_robin_prefill(keys, order, 1) == one


def test_round_robin_deals_in_input_order_and_runs_each_share_in_trie_order() -> None:
    keys = [[5, 1], [1, 1], [5, 2], [1, 2]]
    order = prefix_order(keys)  # [1, 3, 0, 2]
    # worker 0 gets items 0, 2 (both start with 5), worker 1 items 1, 3 (both with 1)
    assert round_robin_prefill(keys, order, 2) == (2 + 1) + (2 + 1)
    with pytest.raises(ValueError, match="workers must be at least 1"):
        round_robin_prefill(keys, order, 0)


def test_idle_worker_splits_a_long_shard_at_the_end_but_not_a_short_one() -> None:
    system = list(range(500, 600))  # 100 shared tokens, then 40 questions of 60 tokens
    keys = [[*system, 9, i, *[i] * 58] for i in range(40)]
    order = prefix_order(keys)
    sched = AffineScheduler(keys, plan_shards(keys, order, 1), item_cost=0)
    assert sched.next_item("a") == order[0]  # "a" owns the only shard
    stolen = sched.next_item("b")  # "b" idles: takes the far half of "a"'s shard
    assert sched.steals == 1 and stolen is not None
    assert order.index(stolen) > 15
    # a document's last questions: the thief would end them 26 % sooner (465 units against
    # 630; each item weighs 15 question tokens + 40 for decoding), but prefill its 300 tokens
    # again to save 165: not taken
    keys = [[*range(1000, 1300), *[q] * 15] for q in range(6)]
    order = prefix_order(keys)
    sched = AffineScheduler(keys, plan_shards(keys, order, 1), item_cost=40)
    sched.next_item("a"), sched.next_item("a")
    assert sched.next_item("b") is None and sched.steals == 0
    # a document with few questions left is not worth its prefix again
    keys = [[*range(1000, 1300), q] for q in range(4)]
    order = prefix_order(keys)
    sched = AffineScheduler(keys, plan_shards(keys, order, 1), item_cost=0)
    sched.next_item("a")
    assert sched.next_item("b") is None and sched.steals == 0


def test_dead_worker_items_go_back_to_the_front_and_a_killer_item_is_given_up() -> None:
    keys = docs_by_questions(2, 3)
    order = prefix_order(keys)
    sched = AffineScheduler(keys, plan_shards(keys, order, 1), max_suspect=2)
    first = sched.next_item("a")
    second = sched.next_item("a")
    assert first is not None and second is not None
    assert sched.worker_lost("a") == []  # first strike for the item it was running
    assert sched.requeued == 2
    assert sched.next_item("b") == first  # its unfinished items, first of all, in order
    assert sched.next_item("b") == second
    assert sched.worker_lost("b") == [first]  # second strike: give it up
    left = []
    while (index := sched.next_item("c")) is not None:
        sched.finished("c", index)
        left.append(index)
    assert first not in left and second in left and sched.done
    assert sorted([first, *left]) == list(range(6))


def test_a_worker_with_nothing_in_flight_dies_without_blame() -> None:
    keys = [[1] * MIN_SHARED_TOKENS, [2] * MIN_SHARED_TOKENS]
    sched = AffineScheduler(keys, plan_shards(keys, [0, 1], 2))
    index = sched.next_item("a")
    assert index is not None
    sched.finished("a", index)
    assert sched.worker_lost("a") == [] and sched.suspect == {}
    with pytest.raises(ValueError, match="max_suspect"):
        AffineScheduler(keys, [], max_suspect=0)


def test_keep_order_rewrite_puts_out_in_input_order(tmp_path: Path) -> None:
    from skippy_llama.batch import load_items
    from skippy_llama.batch.ray_runner import rewrite_in_input_order

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in (3, 1, 2)))
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({"id": i, "text": f"t{i}"}) + "\n" for i in (1, 2, 3)))
    rewrite_in_input_order(out, load_items(inp))
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [3, 1, 2]
    assert not (tmp_path / "out.jsonl.reorder").exists()
