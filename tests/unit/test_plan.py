"""The restore planner with fake tiers and costs: every gate without a model or llama.cpp."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from fake_tiers import DictPages, DictStatus

from skippy_llama.costs import AlwaysRestore, CostModel
from skippy_llama.identity import chain_key, page_keys
from skippy_llama.plan import Planner, Prompt
from skippy_llama.tiers.base import (
    PageTier,
    ParkPlan,
    RemoteMatch,
    RemotePageTier,
    ResidentMatch,
    ResidentTier,
    common_prefix,
)

ROOT = b"r" * 16
PAGE = 64
BYTES_PER_TOKEN = 1000


def toks(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


@dataclass
class FakeResident:
    """L1 holding whole prefixes by slot."""

    prefixes: dict[int, np.ndarray] = field(default_factory=dict)
    name: str = "l1"
    touched: list[int] = field(default_factory=list)

    def match(self, root: bytes, tokens: np.ndarray, limit: int) -> ResidentMatch | None:
        best: ResidentMatch | None = None
        for slot, held in self.prefixes.items():
            n = common_prefix(held, tokens[:limit])
            if n and (best is None or n > best.n_tokens):
                best = ResidentMatch(slot, n, b"handle %d" % slot)
        return best

    def touch(self, seq_id: int) -> None:
        self.touched.append(seq_id)

    def plan_park(self, root: bytes, tokens: np.ndarray) -> ParkPlan | None:
        return ParkPlan(max(self.prefixes, default=0) + 1, len(tokens))

    def commit_park(self, plan: ParkPlan, root: bytes, tokens: np.ndarray, handle: bytes) -> None:
        self.prefixes[plan.seq_id] = tokens[: plan.n_tokens]

    def abandon_park(self, plan: ParkPlan) -> None:
        self.prefixes.pop(plan.seq_id, None)

    def status(self) -> DictStatus:
        return DictStatus(self.name)

    def clear(self) -> None:
        self.prefixes.clear()

    def close(self) -> None:
        pass


@dataclass
class FakePages(DictPages):
    """A page tier holding the aligned pages of the prefixes it was given (:meth:`hold`)."""

    root: bytes = ROOT
    page_tokens: int = PAGE


def planner(*tiers: Any, costs: CostModel | None = None) -> Planner:
    return Planner(ROOT, PAGE, tiers, costs or CostModel(), BYTES_PER_TOKEN)


def slow_gpu_costs() -> CostModel:
    """A GPU-like machine: prefill 10 µs a token, every restore far dearer."""
    costs = CostModel()
    costs.observe_prefill(1000, 0.01)
    costs.observe_checkpoint_restore(0.060)
    costs.observe_park(0.060)
    costs.observe_restore(10**6, 1.0, tier="l3")
    costs.observe_restore(10**6, 1.0, tier="l2")
    return costs


def test_the_fakes_implement_the_protocols() -> None:
    assert isinstance(FakeResident(), ResidentTier)
    assert isinstance(FakePages("l3"), PageTier)


def test_nothing_cached_is_a_cold_plan() -> None:
    plan = planner(FakeResident(), FakePages("l3")).plan(Prompt(toks(300), 298))
    assert (plan.tier, plan.n_tokens, plan.keep, plan.park, plan.pages) == ("cold", 0, 0, False, ())
    assert plan.searched == ("l3",)


def test_the_live_sequence_is_kept_up_to_where_the_prompt_leaves_it() -> None:
    prompt = Prompt(toks(300), 298, live=np.concatenate([toks(100), toks(80, 9000)]))
    plan = planner(FakeResident()).plan(prompt)
    assert (plan.tier, plan.n_tokens, plan.keep) == ("l1", 100, 100)
    assert plan.park  # the prompt destroys the live sequence's last 80 cells: keep them resident
    assert plan.park_skipped is None
    alone = planner().plan(prompt)  # without L1 there is nowhere to park, and nothing skipped
    assert not alone.park and alone.park_skipped is None


# -- the park decision (issue 42): park only what the prompt destroys, when keeping it pays


def doc_and_question(question: int, n_doc: int = 1293, n_question: int = 14) -> np.ndarray:
    """A shared document and a question after it (the question's tokens differ per call)."""
    return np.concatenate([toks(n_doc), toks(n_question, 10_000 + 100 * question)])


def test_a_short_destroyed_tail_is_not_parked_before_costs_are_measured() -> None:
    prompt = Prompt(doc_and_question(2), 1305, live=doc_and_question(1))
    plan = planner(FakeResident()).plan(prompt)
    assert (plan.tier, plan.keep) == ("l1", 1293)  # the document stays live
    assert not plan.park
    assert plan.park_skipped is not None and plan.park_skipped.startswith("14 tokens lost")


def test_a_destroyed_tail_of_a_page_or_more_is_parked_before_costs_are_measured() -> None:
    live = doc_and_question(1, n_question=PAGE)
    plan = planner(FakeResident()).plan(Prompt(doc_and_question(2), 1305, live=live))
    assert plan.park and plan.park_skipped is None
    short = doc_and_question(1, n_question=PAGE - 1)
    assert not planner(FakeResident()).plan(Prompt(doc_and_question(2), 1305, live=short)).park


def test_the_shared_part_never_counts_toward_a_park() -> None:
    # a live sequence that the prompt continues loses nothing, however long it is; the cells
    # past the granule boundary are cut but prefilled again by the prompt itself
    doc = toks(1293)
    longer = Prompt(toks(1400), 1398, live=doc, granule=64)
    plan = planner(FakeResident()).plan(longer)
    assert (plan.keep, plan.park, plan.park_skipped) == (1280, False, None)
    # a sliding-window cache dropped whole is prefilled again up to where the prompt leaves it
    window = Prompt(toks(1400), 1398, live=doc, live_cells=1300, sliding_window=True)
    dropped = planner(FakeResident()).plan(window)
    assert (dropped.keep, dropped.park, dropped.park_skipped) == (0, False, None)


def test_measured_costs_decide_the_park_by_the_destroyed_tokens_alone() -> None:
    cpu = CostModel()
    cpu.observe_prefill(1000, 0.06)  # 60 µs a token: SmolLM2-135M on 2 CPU cores
    cpu.observe_park(0.022)  # the 20-26 ms for a 1,293-token prefix
    cpu.observe_checkpoint_restore(0.010)
    p = planner(FakeResident(), costs=cpu)
    # 14 lost tokens (0.8 ms of prefill) never repay a 22 ms park and a 10 ms restore,
    # although the whole 1,307-token prefix (78 ms) would
    short = p.plan(Prompt(doc_and_question(2), 1305, live=doc_and_question(1)))
    assert not short.park and short.park_skipped is not None
    assert all(f"{ms} ms" in short.park_skipped for ms in ("0.8", "10.0", "22.0"))
    # 800 lost tokens (48 ms) do
    long_live = doc_and_question(1, n_question=800)
    assert p.plan(Prompt(doc_and_question(2), 1305, live=long_live)).park
    # a model that always parks keeps even the short tail
    always = planner(FakeResident(), costs=AlwaysRestore())
    assert always.plan(Prompt(doc_and_question(2), 1305, live=doc_and_question(1))).park


def test_a_deeper_tier_wins_and_each_page_comes_from_the_cheapest_tier_holding_it() -> None:
    tokens = toks(300)
    l2 = FakePages("l2", takes_records=False).hold(tokens[:128])
    l3 = FakePages("l3").hold(tokens[:256])
    plan = planner(FakeResident({1: tokens[:100]}), l2, l3).plan(Prompt(tokens, 298))
    assert (plan.tier, plan.n_tokens, plan.floor) == ("l3", 256, 100)
    assert [p.tier for p in plan.pages] == ["l2", "l2", "l3", "l3"]
    assert plan.page_tiers == ("l2", "l3") and plan.base_tokens == 0 and plan.seq_id is None


def test_an_append_plan_keeps_the_l1_prefix_and_reads_only_the_pages_past_it() -> None:
    tokens = toks(300)
    l3 = FakePages("l3").hold(tokens[:256])
    plan = planner(FakeResident({1: tokens[:130]}), l3).plan(Prompt(tokens, 298, can_append=True))
    assert (plan.tier, plan.n_tokens, plan.base_tokens, plan.seq_id) == ("l3", 256, 130, 1)
    # pages [0, 64) and [64, 128) lie wholly inside the L1 prefix: never read
    assert len(plan.pages) == 2 and plan.appended_tokens == 126


def test_every_plan_ends_on_a_granule() -> None:
    tokens = toks(300)
    prompt = Prompt(tokens, 298, live=tokens[:150], granule=64)
    plan = planner(FakeResident({1: tokens[:250]})).plan(prompt)
    assert (plan.n_tokens, plan.keep, plan.seq_id) == (192, 128, 1)
    l3 = FakePages("l3").hold(tokens[:300])
    assert planner(l3).plan(Prompt(tokens, 298, granule=64)).n_tokens == 256


def test_logits_all_reuses_only_cells_decoded_here_and_nothing_else() -> None:
    tokens = toks(300)
    prompt = Prompt(tokens, 298, live=tokens[:200], scored=120)
    plan = planner(FakeResident({1: tokens[:290]}), FakePages("l3").hold(tokens)).plan(prompt)
    assert (plan.tier, plan.n_tokens, plan.keep, plan.park) == ("l1", 120, 120, False)


def test_a_sliding_window_cache_is_never_cut_back() -> None:
    tokens = toks(300)
    cut = Prompt(tokens, 298, live=tokens[:100], live_cells=140, sliding_window=True)
    assert planner().plan(cut).n_tokens == 0
    whole = Prompt(tokens, 298, live=tokens[:100], live_cells=100, sliding_window=True)
    assert planner().plan(whole).n_tokens == 100


def test_the_cost_model_refuses_restores_that_lose_to_a_prefill() -> None:
    tokens = toks(300)
    l3 = FakePages("l3").hold(tokens[:256])
    resident = FakeResident({1: tokens[:200]})
    slow = planner(resident, l3, costs=slow_gpu_costs()).plan(Prompt(tokens, 298))
    assert (slow.tier, slow.n_tokens) == ("cold", 0)
    assert slow.skipped == ("l3", "l1")
    forced = planner(resident, l3, costs=AlwaysRestore()).plan(Prompt(tokens, 298))
    assert (forced.tier, forced.n_tokens, forced.skipped) == ("l3", 256, ())


def first_restore_costs() -> CostModel:
    """A GPU-like machine whose load-time probe ran (``runtime/bus.py``) but which restored
    nothing yet: prefill 10 ns a byte of K/V (10 µs a token), the bus 2 ns a byte, a host copy
    3 ns, committing fresh host memory (page faults, pinning) 4 ns."""
    costs = CostModel()
    costs.observe_prefill(1000, 0.010)
    costs.observe_bus(10**6, 0.002)
    costs.observe_host(10**6, 0.003, 0.004)
    return costs


def test_a_first_restore_from_storage_is_planned_with_its_reads_and_first_touch() -> None:
    """Issue 45: a process's first L3 restore must never be slower than cold. Planned at the
    bus's rate alone (2 ns a byte against the prefill's 10) it would always go ahead; with the
    two host passes of its reads (6 ns) and the first touch of the memory it lands in (4 ns)
    it costs more than the prefill it spares, so the plan is cold."""
    tokens = toks(300)
    l3 = FakePages("l3").hold(tokens[:256])
    costs = first_restore_costs()
    assert costs.restore_rate("l3") is None  # nothing measured: the bus-seeded estimate
    plan = planner(l3, costs=costs).plan(Prompt(tokens, 298))
    assert (plan.tier, plan.skipped) == ("cold", ("l3",))
    moved = 256 * BYTES_PER_TOKEN
    assert costs.planned_restore_cost(moved, tier="l3", storage=True) == pytest.approx(
        moved * 12e-9
    )
    assert costs.planned_restore_cost(moved, tier="l3") == pytest.approx(moved * 6e-9)
    # admission and eviction weigh restores once buffers are committed: no first touch
    assert costs.restore_cost(moved, tier="l3", storage=True) == pytest.approx(moved * 8e-9)


def test_a_first_restore_from_host_ram_pays_no_reads() -> None:
    """A tier in host RAM (L2's arena) adds no read passes: the bus and the first touch
    (6 ns a byte) beat the prefill (10 ns), so its first restore goes ahead."""
    tokens = toks(300)
    l2 = FakePages("l2", takes_records=False, in_memory=True).hold(tokens[:256])
    plan = planner(l2, costs=first_restore_costs()).plan(Prompt(tokens, 298))
    assert (plan.tier, plan.n_tokens) == ("l2", 256)
    assert plan.expected_s == pytest.approx(256 * BYTES_PER_TOKEN * 6e-9)


def test_first_touch_is_paid_once_per_process_up_to_the_largest_restore() -> None:
    """After a restore of as many bytes (from any tier), the buffers are committed: a first
    L3 restore is then planned at the bus and its reads alone (8 ns < 10 ns) and goes ahead;
    a larger one still counts the first touch of what it adds."""
    tokens = toks(300)
    l3 = FakePages("l3").hold(tokens[:256])
    costs = first_restore_costs()
    moved = 256 * BYTES_PER_TOKEN
    costs.observe_restore(moved, moved * 6e-9, tier="l2")
    plan = planner(l3, costs=costs).plan(Prompt(tokens, 298))
    assert (plan.tier, plan.n_tokens) == ("l3", 256)
    assert plan.expected_s == pytest.approx(moved * 8e-9)
    assert costs.first_touch_cost(2 * moved) == pytest.approx(moved * 4e-9)


def test_restores_streamed_through_committed_buffers_plan_no_first_touch() -> None:
    """Where restores stream through buffers committed at load (the seam's page copies), the
    first L3 restore is planned at the bus and its reads alone (8 ns < 10 ns) and goes ahead;
    the same costs without it stay cold (the first test above)."""
    tokens = toks(300)
    l3 = FakePages("l3").hold(tokens[:256])
    costs = first_restore_costs()
    costs.commit_streams()
    moved = 256 * BYTES_PER_TOKEN
    assert costs.first_touch_cost(moved) == 0.0
    plan = planner(l3, costs=costs).plan(Prompt(tokens, 298))
    assert (plan.tier, plan.n_tokens) == ("l3", 256)
    assert plan.expected_s == pytest.approx(moved * 8e-9)


def test_an_unprobed_first_restore_is_tried() -> None:
    """Without a probe nothing is known of a restore: it is tried, which measures it."""
    tokens = toks(300)
    costs = CostModel()
    costs.observe_prefill(1000, 0.010)
    costs.observe_host(10**6, 0.003, 0.004)  # no bus rate: the host figures alone price nothing
    plan = planner(FakePages("l3").hold(tokens[:256]), costs=costs).plan(Prompt(tokens, 298))
    assert plan.tier == "l3" and plan.expected_s is None


def test_a_cheap_checkpoint_restore_is_planned_with_its_estimates() -> None:
    costs = CostModel()
    costs.observe_prefill(1000, 1.0)  # 1 ms a token: a CPU
    costs.observe_checkpoint_restore(0.005)
    plan = planner(FakeResident({2: toks(200)}), costs=costs).plan(Prompt(toks(300), 298))
    assert (plan.tier, plan.seq_id, plan.n_tokens) == ("l1", 2, 200)
    assert plan.expected_s == 0.005 and plan.cold_s == 0.2


def test_excluding_a_failed_tier_gives_the_next_shallower_plan() -> None:
    tokens = toks(300)
    tiers = (FakeResident({1: tokens[:100]}), FakePages("l3").hold(tokens[:256]))
    p = planner(*tiers)
    assert p.plan(Prompt(tokens, 298)).tier == "l3"
    after = p.plan(Prompt(tokens, 298), exclude=frozenset({"l3"}))
    assert (after.tier, after.seq_id, after.n_tokens) == ("l1", 1, 100)
    assert p.plan(Prompt(tokens, 298), exclude=frozenset({"l1", "l3"})).tier == "cold"


def test_a_plan_carries_the_handle_of_the_checkpoint_it_restores() -> None:
    """The seam restores a checkpoint from the plan alone, without asking L1."""
    tokens = toks(300)
    resident = FakeResident({1: tokens[:130]})
    whole = planner(resident, costs=AlwaysRestore()).plan(Prompt(tokens, 298))
    assert (whole.seq_id, whole.handle) == (1, b"handle 1")
    l3 = FakePages("l3").hold(tokens[:256])
    append = planner(resident, l3).plan(Prompt(tokens, 298, can_append=True))
    assert (append.seq_id, append.handle, append.base_tokens) == (1, b"handle 1", 130)
    rebuilt = planner(resident, l3).plan(Prompt(tokens, 298))
    assert (rebuilt.tier, rebuilt.seq_id, rebuilt.handle) == ("l3", None, b"")


def test_a_short_note_says_how_far_a_fetch_got() -> None:
    tokens = toks(300)
    plan = planner(FakePages("l3").hold(tokens[:256])).plan(Prompt(tokens, 298))
    assert plan.short_note(3) == (
        "l3: served 192 of 256 tokens; a page was missing or failed verification"
    )


def test_a_tier_that_is_not_serving_is_not_asked() -> None:
    tokens = toks(300)
    l3 = FakePages("l3", serving=False).hold(tokens)
    assert planner(l3).plan(Prompt(tokens, 298)).tier == "cold"


def test_a_branch_inside_a_page_is_found_through_children() -> None:
    tokens = toks(300)
    stored = np.concatenate([tokens[:100], toks(28, 5000)])  # one page, branching at 100

    class Branching(FakePages):
        def children(self, parent: bytes, *, queued: bool = False) -> list[tuple[bytes, bytes]]:
            if parent != ROOT:
                return []
            return [(chain_key(ROOT, stored[:PAGE]), stored[:PAGE].astype("<i4").tobytes())]

    plan = planner(Branching("l3")).plan(Prompt(np.concatenate([tokens[:60], toks(5, 7)]), 60))
    assert (plan.tier, plan.n_tokens, [p.used for p in plan.pages]) == ("l3", 60, [60])


def test_an_append_plan_keeps_a_short_last_page_past_the_l1_prefix() -> None:
    tokens = toks(300)

    class Tail(FakePages):
        """Aligned pages of 256 tokens and a 14-token tail page after them."""

        def children(self, parent: bytes, *, queued: bool = False) -> list[tuple[bytes, bytes]]:
            last = page_keys(ROOT, tokens[:256], PAGE)[-1]
            if parent != last:
                return []
            return [(chain_key(last, tokens[256:270]), tokens[256:270].astype("<i4").tobytes())]

    l3 = Tail("l3").hold(tokens[:256])
    plan = planner(FakeResident({1: tokens[:150]}), l3).plan(Prompt(tokens, 298, can_append=True))
    assert (plan.n_tokens, plan.base_tokens) == (270, 150)
    assert [p.used for p in plan.pages] == [64, 64, 14]  # [128, 192), [192, 256), the tail


@dataclass
class FakeRemote(FakePages):
    """A remote tier: never walked page by page, asked once for its match; ``tails`` are the
    pages indexed after a node (parent -> [(key, tokens)])."""

    asked: int = 0
    tails: dict[bytes, list[tuple[bytes, bytes]]] = field(default_factory=dict)

    def holds(self, key: bytes, *, queued: bool = False) -> bool:
        return False

    def tail(self, tokens: np.ndarray) -> FakeRemote:
        """Hold ``tokens`` as a record does: aligned pages, then the rest as one short page."""
        self.hold(tokens)
        whole = len(tokens) - len(tokens) % PAGE
        parent = page_keys(ROOT, tokens[:whole], PAGE)[-1] if whole else ROOT
        rest = tokens[whole:]
        self.tails.setdefault(parent, []).append(
            (chain_key(parent, rest), rest.astype("<i4").tobytes())
        )
        return self

    def match_path(self, keys: Sequence[bytes]) -> RemoteMatch:
        self.asked += 1
        depth = 0
        for key in keys:
            if key not in self.pages:
                break
            depth += 1
        parent = keys[depth - 1] if depth else ROOT
        return RemoteMatch(depth, tuple(self.tails.get(parent, [])) if depth else ())


def test_a_remote_tier_is_asked_once_and_serves_the_pages_local_tiers_lack() -> None:
    tokens = toks(300)
    l3 = FakePages("l3").hold(tokens[:64])
    remote = FakeRemote("remote").hold(tokens[:256])
    assert isinstance(remote, RemotePageTier) and not isinstance(l3, RemotePageTier)
    plan = planner(l3, remote).plan(Prompt(tokens, 298))
    assert remote.asked == 1
    assert (plan.tier, plan.n_tokens) == ("remote", 256)
    assert [p.tier for p in plan.pages] == ["l3", "remote", "remote", "remote"]


def test_a_remote_tail_page_is_used_as_far_as_the_prompt_matches_it() -> None:
    tokens = toks(300)
    remote = FakeRemote("remote").tail(tokens[:280])  # 4 whole pages and a 24-token tail
    plan = planner(remote).plan(Prompt(tokens, 299))
    assert (plan.tier, plan.n_tokens) == ("remote", 280)
    assert [p.used for p in plan.pages] == [64, 64, 64, 64, 24]
    # a prompt that branches off inside the tail uses the tail's shared tokens only
    other = np.concatenate([tokens[:270], toks(30) + 5000])
    branched = planner(remote).plan(Prompt(other, 299))
    assert (branched.n_tokens, branched.pages[-1].used) == (270, 14)
    # a tail indexed after another node is never taken
    elsewhere = FakeRemote("remote").tail(toks(280) + 7000)
    elsewhere.hold(tokens[:256])
    assert planner(elsewhere).plan(Prompt(tokens, 299)).n_tokens == 256


def test_a_remote_tier_is_not_asked_when_local_tiers_cover_every_whole_page() -> None:
    tokens = toks(300)
    remote = FakeRemote("remote").hold(tokens[:256])
    plan = planner(FakePages("l3").hold(tokens[:256]), remote).plan(Prompt(tokens, 298))
    assert (plan.tier, plan.n_tokens, remote.asked) == ("l3", 256, 0)
    # nor when a shallower tier already offers as much as its whole pages could
    live = planner(remote).plan(Prompt(tokens, 298, live=tokens[:290]))
    assert (live.tier, live.n_tokens, remote.asked) == ("l1", 290, 0)


# -- the park rule where nothing is reused (issue 45 item 4)


def h100_fa_off() -> CostModel:
    """Issue 45's H100 with flash attention off: 2k tokens prefill in 160 ms, a park or a
    checkpoint restore of them takes 60-80 ms (the transposed V)."""
    costs = CostModel()
    costs.observe_prefill(2048, 0.160)
    costs.observe_park(0.070)
    costs.observe_checkpoint_restore(0.062)
    return costs


def test_one_shot_prompts_stop_paying_for_parks_that_never_serve() -> None:
    costs = h100_fa_off()
    p = planner(FakeResident(), costs=costs)
    shots = [toks(2048, 10_000 * i) for i in range(4)]
    # the first departure is parked: nothing says yet that prefixes never return
    assert p.plan(Prompt(shots[1], 2046, live=shots[0])).park
    costs.observe_departure()
    skipped = p.plan(Prompt(shots[2], 2046, live=shots[1]))
    assert not skipped.park and skipped.park_skipped is not None
    assert "reuse chance of 0.50" in skipped.park_skipped
    # two chats taking turns come back every time: parks pay again
    for _ in range(10):
        costs.observe_return()
        costs.observe_departure()
    assert p.plan(Prompt(shots[3], 2046, live=shots[2])).park


def test_a_live_sequence_its_record_handed_to_l3_is_not_parked_where_l3_is_quicker() -> None:
    costs = h100_fa_off()
    costs.observe_restore(2048 * BYTES_PER_TOKEN, 0.020, tier="l3")
    l3 = FakePages("l3")
    live, shot = toks(2064), toks(2048, 50_000)  # a prompt of 2,048 tokens and its reply
    recorded = Prompt(shot, 2046, live=live, live_recorded=2046)
    plan = planner(FakeResident(), l3, costs=costs).plan(recorded)
    assert not plan.park and plan.park_skipped is not None
    assert "(2046 from l3)" in plan.park_skipped
    # not recorded (L3 off, or the record was dropped): bringing it back is a prefill
    assert planner(FakeResident(), l3, costs=costs).plan(Prompt(shot, 2046, live=live)).park
    # a tier that does not take records (L2 mirrors L3) holds no record of the live sequence
    l2 = FakePages("l2", takes_records=False)
    assert planner(FakeResident(), l2, costs=costs).plan(recorded).park
