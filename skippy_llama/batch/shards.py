"""Prefix-affine scheduling of a batch over several workers (``batch --ray``), without Ray.

The items of a batch, in trie order (:mod:`.order`), are cut into **shards**: runs of
consecutive items that share a prefix worth keeping (a document, a system prompt). Running a
run of trie-ordered items on one worker prefills each item's tokens past the prefix it shares
with the item before it, so a worker that runs whole shards prefills what one process would,
plus one copy of the shared prefix wherever a shard starts. That makes a cut's price the prefix
its two sides share (``lcp`` below), and the cheap cuts are at the trie's shallow branchings.

:class:`AffineScheduler` hands the shards out from a queue, one item at a time: a worker keeps
taking the next item of its own shard, an idle worker takes the next shard, and when the queue
is empty an idle worker takes the tail of another worker's shard, split at a trie child, if that
ends the batch sooner by more than the prefix it prefills again. A worker that dies gives its unfinished items back (to the front of the
queue); the item it was running is counted against, and one that took ``max_suspect`` workers
with it is given up so the batch goes on.

:func:`round_robin_prefill` is what a pool that deals the same items round-robin would prefill,
for the summary; everything here is computed from token lists, no model and no second run.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

Key = Sequence[int]

#: Items that share fewer tokens than this are not kept together: prefilling such a prefix
#: again costs about as much as the call itself (a BOS and a word or two of a template).
MIN_SHARED_TOKENS = 16

#: A steal must cut the time left on the victim's shard by this share at least, and by more
#: than the shared prefix the thief prefills again (never more work added than time saved).
STEAL_GAIN = 0.25

#: A decoded token costs about as much time as this many prefilled ones on a CPU (SmolLM2,
#: 1-2 threads: ~300 prompt tokens/s against ~60 generated/s); it weighs ``max_tokens`` into the
#: cost of an item when shards are balanced.
DECODE_WEIGHT = 5


def lcp(a: Key, b: Key) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _step(keys: Sequence[Key], prev: int | None, index: int) -> int:
    """Tokens prefilled for ``keys[index]`` right after ``keys[prev]`` on the same worker
    (at least one: the last token is evaluated again for its logits)."""
    key = keys[index]
    shared = 0 if prev is None else lcp(keys[prev], key)
    return max(1, len(key) - shared) if key else 0


def chain_prefill(keys: Sequence[Key], run: Sequence[int], start: int | None = None) -> int:
    """Prompt tokens one worker prefills running ``run`` (indices of ``keys``) in that order,
    reusing the prompt before each, after ``start`` (None: a cold worker)."""
    total, prev = 0, start
    for index in run:
        total += _step(keys, prev, index)
        prev = index
    return total


def round_robin_prefill(keys: Sequence[Key], order: Sequence[int], workers: int) -> int:
    """Prompt tokens prefilled if ``order``'s items were dealt to ``workers`` workers round-robin
    in input order (index order), each worker running its share in trie order (``order``'s).

    That is the best a prefix-blind pool does: it keeps each worker's own reuse and loses only
    the reuse between items dealt to different workers.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    rank = {index: r for r, index in enumerate(order)}
    dealt: list[list[int]] = [[] for _ in range(workers)]
    for n, index in enumerate(sorted(order)):
        dealt[n % workers].append(index)
    return sum(chain_prefill(keys, sorted(share, key=rank.__getitem__)) for share in dealt)


@dataclass
class Shard:
    """Items of one prefix group, in run order (indices into the batch's keys)."""

    items: deque[int]
    cost: int = 0


def shard_cost(keys: Sequence[Key], items: Sequence[int], item_cost: int) -> int:
    """Time of a shard on a cold worker, in prefilled-token units (decode weighed in)."""
    return chain_prefill(keys, items) + item_cost * len(items)


def _best_split(keys: Sequence[Key], items: Sequence[int]) -> int | None:
    """Where to cut ``items`` in two: at the shallowest branching (the smallest prefix shared
    across the cut), the most even of those by item count; None for a single item."""
    if len(items) < 2:
        return None
    shared = [lcp(keys[items[p - 1]], keys[items[p]]) for p in range(1, len(items))]
    low = min(shared)
    middle = len(items) / 2
    return min(
        (p for p in range(1, len(items)) if shared[p - 1] == low), key=lambda p: abs(p - middle)
    )


def plan_shards(
    keys: Sequence[Key],
    order: Sequence[int],
    workers: int,
    *,
    item_cost: int = 0,
    min_shared: int = MIN_SHARED_TOKENS,
) -> list[Shard]:
    """Cut ``order`` (trie order) into shards, costliest first.

    A new shard starts wherever neighbours share fewer than ``min_shared`` tokens; then, while
    there are fewer shards than ``workers``, the costliest one is split at its shallowest trie
    branching (so the shared prefix is prefilled once more, by the other worker).
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    runs: list[list[int]] = []
    for index in order:
        if runs and lcp(keys[runs[-1][-1]], keys[index]) >= min_shared:
            runs[-1].append(index)
        else:
            runs.append([index])
    heap = [(-shard_cost(keys, run, item_cost), n, run) for n, run in enumerate(runs)]
    heapq.heapify(heap)
    serial = len(heap)
    while len(heap) < workers:
        _, _, run = heap[0]
        p = _best_split(keys, run)
        if p is None:
            break
        heapq.heappop(heap)
        for part in (run[:p], run[p:]):
            heapq.heappush(heap, (-shard_cost(keys, part, item_cost), serial, part))
            serial += 1
    # costliest first (longest-processing-time order); ties keep trie order
    return [
        Shard(deque(run), -cost) for cost, _, run in sorted(heap, key=lambda e: (e[0], e[2][0]))
    ]


@dataclass
class _Worker:
    shard: deque[int] = field(default_factory=deque)  # its shard's items not handed out yet
    last: int | None = None  # the item handed out last (its prompt is what the worker holds)
    before: int | None = None  # the item it ran before its first one in flight
    in_flight: list[int] = field(default_factory=list)


class AffineScheduler:
    """Hands out a batch's items to workers by shard; see the module docstring.

    Workers are any hashable names. Calls: :meth:`next_item` when a worker can take one more,
    :meth:`finished` when its result is back, :meth:`worker_lost` when it died.
    ``cost_by_worker`` is what each was handed, in prefilled-token units with decode weighed in
    (a replacement worker under a new name counts apart). ``prefill_by_plan`` sums, from the trie, what each worker prefilled for the items it was
    handed in the order it got them (the measured figure comes from the workers' caches).
    """

    def __init__(
        self,
        keys: Sequence[Key],
        shards: Sequence[Shard],
        *,
        item_cost: int = 0,
        max_suspect: int = 2,
    ) -> None:
        if max_suspect < 1:
            raise ValueError(f"max_suspect must be at least 1, got {max_suspect}")
        self.keys = keys
        self.item_cost = item_cost
        self.max_suspect = max_suspect
        self.queue: deque[deque[int]] = deque(deque(s.items) for s in shards if s.items)
        self.workers: dict[Hashable, _Worker] = {}
        self.suspect: dict[int, int] = {}
        self.remaining = sum(len(s) for s in self.queue)
        self.prefill_by_plan = 0
        self.cost_by_worker: dict[Hashable, int] = {}
        self.steals = 0
        self.requeued = 0

    def _worker(self, worker: Hashable) -> _Worker:
        return self.workers.setdefault(worker, _Worker())

    def _hand_out(self, state: _Worker, index: int, worker: Hashable) -> int:
        step = _step(self.keys, state.last, index)
        self.prefill_by_plan += step
        self.cost_by_worker[worker] = self.cost_by_worker.get(worker, 0) + step + self.item_cost
        state.last = index
        state.in_flight.append(index)
        return index

    def next_item(self, worker: Hashable) -> int | None:
        """The next item for ``worker`` (its own shard, the next shard, or a stolen tail), or
        None when there is nothing it should take now."""
        state = self._worker(worker)
        if not state.shard:
            if self.queue:
                state.shard = self.queue.popleft()
            elif not self._steal(worker, state):
                return None
        return self._hand_out(state, state.shard.popleft(), worker)

    def _left_cost(self, state: _Worker, items: Sequence[int]) -> int:
        """Time a worker still needs for its in-flight items plus ``items`` after them."""
        run = [*state.in_flight, *items]
        return chain_prefill(self.keys, run, state.before) + self.item_cost * len(run)

    def _steal(self, worker: Hashable, state: _Worker) -> bool:
        best: tuple[int, Hashable, int] | None = None  # (makespan after, victim, cut)
        for name, victim in self.workers.items():
            if name == worker or not victim.shard:
                continue
            # one pass over the victim's tail (prefix sums): a shard may hold thousands of items
            tail = list(victim.shard)
            steps = [
                _step(self.keys, tail[k - 1] if k else victim.last, tail[k])
                for k in range(len(tail))
            ]
            in_flight = self._left_cost(victim, [])
            total = sum(steps)
            now = in_flight + total + self.item_cost * len(tail)
            done = 0  # prefill of tail[:p] on the victim
            for p in range(len(tail)):
                left = in_flight + done + self.item_cost * p
                first = _step(self.keys, state.last, tail[p])
                right = first + total - done - steps[p] + self.item_cost * (len(tail) - p)
                after = max(left, right)
                # the cut makes the thief prefill again the prefix the victim had
                added = first - steps[p]
                if (
                    after <= (1 - STEAL_GAIN) * now
                    and now - after >= added
                    and (best is None or after < best[0])
                ):
                    best = (after, name, p)
                done += steps[p]
        if best is None:
            return False
        _, name, p = best
        victim = self.workers[name]
        tail = list(victim.shard)
        victim.shard = deque(tail[:p])
        state.shard = deque(tail[p:])
        self.steals += 1
        return True

    def finished(self, worker: Hashable, index: int) -> None:
        """``worker`` returned ``index``'s result."""
        state = self.workers[worker]
        state.in_flight.remove(index)
        state.before = index
        self.remaining -= 1

    def worker_lost(self, worker: Hashable) -> list[int]:
        """``worker`` died: its unfinished items go to the front of the queue, as one shard.

        The first of its in-flight items (the one it was running) is counted against; the items
        that reach ``max_suspect`` are returned (record them as failed: they are not retried).
        """
        state = self.workers.pop(worker)
        given_up: list[int] = []
        if state.in_flight:
            running = state.in_flight[0]
            self.suspect[running] = self.suspect.get(running, 0) + 1
            if self.suspect[running] >= self.max_suspect:
                given_up.append(running)
                self.remaining -= 1
        back = [i for i in (*state.in_flight, *state.shard) if i not in given_up]
        if back:
            self.queue.appendleft(deque(back))
            self.requeued += len(state.in_flight) - len(given_up)
        return given_up

    @property
    def schedule_speedup(self) -> float:
        """What the items handed out so far cost, in all, over what the busiest worker's cost:
        the speedup this schedule allows over one worker when workers do not compete for
        cores (time in prefilled-token units, decode weighed in by ``item_cost``)."""
        costs = self.cost_by_worker.values()
        return sum(costs) / max(costs) if costs else 1.0

    @property
    def done(self) -> bool:
        return self.remaining == 0
