"""The cost model: what a prefill, a restore and a checkpoint take on this machine (pure).

Every gate of the restore planner (:mod:`skippy_llama.plan`) and L3's admission ask this one
model, so each rate has one estimator, fed at one point:

- ``prefill_seconds_per_token``: every prefill the runtime times (short ones are ignored: fixed
  per-call costs would dominate the rate);
- ``restore_rates``: seconds per byte of page restores, per tier name (``l2``, ``l3``,
  ``remote`` ...): each tier has its own rate, fed by the restores it served (a restore of pages
  from several tiers is booked to the deepest, whose reads dominate), so a slow network never
  makes the disk look slow;
- ``checkpoint_restore_seconds`` / ``park_seconds``: L1 device checkpoints, whose state calls
  have a fixed cost that does not shrink with the prefix on GPU builds (measured on an H200:
  ~60 ms for 64 or 4,096 tokens, one synchronized copy per layer's K and V);
- ``bus_seconds_per_byte``: what moving K/V bytes from host memory to where the cells live
  costs at best (host to device on a GPU build, a memory copy on the CPU), from the runtime's
  load-time probe (``runtime/bus.py``): the floor under every page restore.

- ``reuse_probability``: how often a prefix that left the live sequence (a prompt destroyed a
  page or more of it) came back in a later prompt, parked or not (``observe_departure`` /
  ``observe_return``, fed by ``PrefixCache.commit`` through :mod:`skippy_llama.departures`):
  a park is insurance, worth its cost only as often as the prefix returns.

Until a rate is measured its rule answers yes (restore, park): that is how it gets measured.
With the bus probed, a page tier not yet measured is planned at the bus's rate (a restore the
bus itself cannot make faster than the prefill is not tried), and the bus's rate is the prior of
that tier's moving average: a process's first restore, which alone pays one-time costs (fresh
buffers' page faults, opening the store, pinning), moves the average by ``alpha`` instead of
becoming it. Issue 45 measured the other way on an H100: a first L3 restore took 1.61× a cold
prefill, became L3's rate, and the planner then refused L3 for that prefix, so it was never
measured again.
The prior alone is a floor no restore reaches, so a process's *first* restore of a tier is planned
from the probe's other figures too (``observe_host``): a tier in storage or across the network
(``storage``) adds ``STORAGE_HOST_PASSES`` host passes at the probed host-copy rate (the read into
a buffer and the digest check), and every restore of more bytes than this process restored
before adds their first touch (page faults of fresh buffers, and their registration where they
are pinned) at the probed rate. So a first restore goes ahead only where even that costs less
than the prefill it spares (issue 45: an H100's first 2k-token L3 restore, planned at the bus's
rate alone, took 1.10x a cold prefill).
Replace the model to change the rules: :class:`AlwaysRestore` restores and parks whenever the
tiers can, whatever the measurements say (tests of which tier serves a prompt use it; an
operator can too).
"""

from __future__ import annotations

import math
import threading

#: Weight of a new observation in the moving averages; 0.2 follows a change within ~10 samples
#: without letting one noisy timing (a page-cache miss, a busy core) swing the decision.
DEFAULT_ALPHA = 0.2
#: Prefills shorter than this are not timed: fixed per-call costs would dominate the rate.
MIN_PREFILL_TOKENS = 16
#: Host passes over a restore's bytes that a tier in storage or across the network adds before
#: the bus moves them, planning its first restore: the read into a buffer and the digest check
#: (issue 45: an H100's first 2k-token L3 restore spent 11 ms fetching 46 MB, the bus 1 ms).
STORAGE_HOST_PASSES = 2
#: Each departure keeps this share of the earlier departures' and returns' weight in
#: ``reuse_probability``: about the last 10 departures decide it, so a workload that changes
#: (one-shots, then interleaved chats) is followed within a few requests.
REUSE_DECAY = 0.9


class CostModel:
    """Exponentially weighted moving averages of this machine's prefill and restore costs.

    Thread-safe: the L3 writer reads it while the request thread feeds it.
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.prefill_seconds_per_token: float | None = None
        #: seconds per restored byte, by the name of the (deepest) tier that served the pages:
        #: host RAM is several times faster than a disk on a GPU build and a network slower, so
        #: one shared rate would refuse RAM hits that beat a prefill, or blame the disk for the
        #: network (L3 keeps its own across restarts: ``tiers/l3/learned.py``)
        self.restore_rates: dict[str, float] = {}
        #: one L1 device-checkpoint restore, and one park (checkpoint) of a prefix
        self.checkpoint_restore_seconds: float | None = None
        self.park_seconds: float | None = None
        #: seconds per byte the bus takes at best (see the module docstring; None: not probed)
        self.bus_seconds_per_byte: float | None = None
        #: seconds per byte of a host-to-host copy at best, and of committing (faulting in, and
        #: pinning where buffers are pinned) host memory touched for the first time, from the
        #: same probe (None: not probed); see the module docstring
        self.host_seconds_per_byte: float | None = None
        self.first_touch_seconds_per_byte: float | None = None
        #: the most bytes one restore of this process moved: buffers that large are committed
        self.touched_bytes = 0
        #: restores stream through buffers committed at load (:meth:`commit_streams`)
        self.streams_committed = False
        #: decayed counts of departures from the live sequence and of their returns
        self.departures = 0.0
        self.returns = 0.0
        self._lock = threading.Lock()

    def _ewma(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.alpha * (sample - old)

    @staticmethod
    def _valid(seconds: float) -> bool:
        return seconds >= 0 and math.isfinite(seconds)

    # -- observations ---------------------------------------------------------------------

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` prompt tokens took ``seconds`` (short ones are ignored)."""
        if tokens < MIN_PREFILL_TOKENS or not self._valid(seconds):
            return
        with self._lock:
            self.prefill_seconds_per_token = self._ewma(
                self.prefill_seconds_per_token, seconds / tokens
            )

    def observe_restore(self, n_bytes: int, seconds: float, *, tier: str) -> None:
        """A restore (read + assemble + set_data) of ``n_bytes`` of pages took ``seconds``;
        ``tier``: the name of the deepest tier that served them (only its rate changes)."""
        if n_bytes <= 0 or not self._valid(seconds):
            return
        with self._lock:
            # a tier's first restore starts from the bus's rate (see the module docstring)
            old = self.restore_rates.get(tier, self.bus_seconds_per_byte)
            self.restore_rates[tier] = self._ewma(old, seconds / n_bytes)
            self.touched_bytes = max(self.touched_bytes, n_bytes)

    def observe_bus(self, n_bytes: int, seconds: float) -> None:
        """The load-time probe moved ``n_bytes`` host to device (or host to host on the CPU)
        in ``seconds`` at best; replaces an earlier probe's rate (nonsense is ignored)."""
        if n_bytes <= 0 or seconds <= 0 or not self._valid(seconds):
            return
        with self._lock:
            self.bus_seconds_per_byte = seconds / n_bytes

    def observe_host(self, n_bytes: int, seconds: float, first_touch_seconds: float) -> None:
        """The load-time probe copied ``n_bytes`` host to host in ``seconds`` at best, and
        committing ``n_bytes`` of fresh host memory took ``first_touch_seconds`` (its page
        faults, and its registration where buffers are pinned); nonsense is ignored."""
        if n_bytes <= 0 or seconds <= 0 or not self._valid(seconds):
            return
        with self._lock:
            self.host_seconds_per_byte = seconds / n_bytes
            if self._valid(first_touch_seconds):
                self.first_touch_seconds_per_byte = first_touch_seconds / n_bytes

    def observe_checkpoint_restore(self, seconds: float) -> None:
        """Restoring one L1 checkpoint into the working sequence took ``seconds``."""
        if self._valid(seconds):
            with self._lock:
                self.checkpoint_restore_seconds = self._ewma(
                    self.checkpoint_restore_seconds, seconds
                )

    def observe_park(self, seconds: float) -> None:
        """Checkpointing one prefix took ``seconds``."""
        if self._valid(seconds):
            with self._lock:
                self.park_seconds = self._ewma(self.park_seconds, seconds)

    def observe_departure(self) -> None:
        """A prompt destroyed a page or more of the live sequence (parked or not)."""
        with self._lock:
            self.departures = self.departures * REUSE_DECAY + 1.0
            self.returns *= REUSE_DECAY

    def observe_return(self) -> None:
        """A prompt came back to a prefix that had departed (each departure returns once)."""
        with self._lock:
            self.returns = min(self.returns + 1.0, self.departures)

    # -- estimates ------------------------------------------------------------------------

    @property
    def reuse_probability(self) -> float:
        """How likely a prefix that leaves the live sequence is to come back: 1.0 until a
        departure is seen (so parks are taken, and measured), then (returns + 1) /
        (departures + 1) over the recent departures (``REUSE_DECAY``). Nine one-shot prompts in
        a row bring it to 0.17; two chats taking turns keep it near 1."""
        with self._lock:
            return min(1.0, (self.returns + 1.0) / (self.departures + 1.0))

    @property
    def measured(self) -> bool:
        """True once a prefill and a restore (from any tier) have been observed."""
        return self.prefill_seconds_per_token is not None and bool(self.restore_rates)

    def restore_rate(self, tier: str) -> float | None:
        """Seconds per byte of restores ``tier`` served, or None before one was measured."""
        return self.restore_rates.get(tier)

    def cold_cost(self, tokens: int) -> float | None:
        """Estimated seconds to prefill ``tokens`` from scratch, or None before any measurement."""
        rate = self.prefill_seconds_per_token
        return None if rate is None else rate * tokens

    def restore_cost(self, n_bytes: int, *, tier: str, storage: bool = False) -> float | None:
        """Estimated seconds to restore ``n_bytes`` of pages whose deepest source is ``tier``
        (``storage``: it reads storage or the network), once this process's buffers are
        committed (what admission and eviction weigh): at ``tier``'s measured rate, else at
        the probed bus's (plus ``STORAGE_HOST_PASSES`` host copies for storage), else None."""
        rate = self.restore_rate(tier)
        if rate is None:
            rate = self.bus_seconds_per_byte
            host = self.host_seconds_per_byte
            if rate is not None and storage and host is not None:
                rate += STORAGE_HOST_PASSES * host
        return None if rate is None else rate * n_bytes

    def planned_restore_cost(
        self, n_bytes: int, *, tier: str, storage: bool = False
    ) -> float | None:
        """What the next restore of ``n_bytes`` is expected to take (the planner's estimate):
        :meth:`restore_cost` plus the first touch of the bytes beyond any earlier restore of
        this process (:meth:`first_touch_cost`); None when unknown."""
        cost = self.restore_cost(n_bytes, tier=tier, storage=storage)
        return None if cost is None else cost + self.first_touch_cost(n_bytes)

    def first_touch_cost(self, n_bytes: int) -> float:
        """Seconds a restore of ``n_bytes`` pays once for host memory not touched before in
        this process (0 once a restore that large was made, or unprobed): counted as if all of
        its bytes beyond the largest earlier restore landed in fresh memory."""
        rate = self.first_touch_seconds_per_byte
        if rate is None or self.streams_committed:
            return 0.0
        return rate * max(0, n_bytes - self.touched_bytes)

    def commit_streams(self) -> None:
        """Restores stream through host buffers committed at load (the KV seam's per-layer page
        copies: read buffers and staging arenas prepared by ``KVSeam.warm_reads``, L2's
        prefaulted arena), so none lands in fresh memory and no first touch is planned. Priced
        as if all of a restore's bytes were fresh, an H100's first restores at 2k-32k tokens
        with flash attention on were planned at 1.8-2.5x their measured time (0.8 s of first
        touch for 700 MB from a 4 MiB probe) and every one went cold."""
        with self._lock:
            self.streams_committed = True

    # -- the rules the planner asks -------------------------------------------------------

    def pages_pay(
        self, moved_bytes: int, saved_tokens: int, *, tier: str, storage: bool = False
    ) -> bool:
        """Whether restoring ``moved_bytes`` of pages (deepest source ``tier``; ``storage``:
        it reads storage or the network) beats prefilling the ``saved_tokens`` the restore
        spares (True until both are measured; an unmeasured tier is estimated from the probed
        bus, and a first restore pays its first touch: :meth:`planned_restore_cost`)."""
        restore = self.planned_restore_cost(moved_bytes, tier=tier, storage=storage)
        cold = self.cold_cost(saved_tokens)
        return restore is None or cold is None or restore < cold

    def checkpoint_pays(self, saved_tokens: int) -> bool:
        """Whether a checkpoint restore that spares prefilling ``saved_tokens`` beats it."""
        rate, restore = self.prefill_seconds_per_token, self.checkpoint_restore_seconds
        if rate is None or restore is None:
            return True
        return restore < rate * saved_tokens

    def recall_cost(
        self, n_tokens: int, *, recorded_tokens: int = 0, recorded_bytes: int = 0, tier: str = ""
    ) -> float | None:
        """Estimated seconds to bring back ``n_tokens`` lost tokens without a park: prefilling
        them, or, for the first ``recorded_tokens`` of them (``recorded_bytes`` of pages a
        record-taking ``tier`` holds), restoring those pages and prefilling the rest, whichever
        is cheaper; None before a prefill was measured."""
        cold = self.cold_cost(n_tokens)
        if cold is None or recorded_tokens <= 0 or not tier:
            return cold
        recorded_tokens = min(recorded_tokens, n_tokens)
        pages = self.restore_cost(recorded_bytes, tier=tier)
        rest = self.cold_cost(n_tokens - recorded_tokens)
        if pages is None or rest is None:
            return cold
        return min(cold, pages + rest)

    def park_gain(
        self,
        n_tokens: int,
        *,
        reuse: float = 1.0,
        recorded_tokens: int = 0,
        recorded_bytes: int = 0,
        tier: str = "",
    ) -> tuple[float, float] | None:
        """A park of a prefix whose ``n_tokens`` a prompt destroys: its expected saving (the
        chance ``reuse`` that the prefix returns × what bringing the tokens back without it
        would cost more than a checkpoint restore, :meth:`recall_cost`) and its own cost, in
        seconds; None until prefill, park and checkpoint restore are all measured."""
        restore, park = self.checkpoint_restore_seconds, self.park_seconds
        recall = self.recall_cost(
            n_tokens, recorded_tokens=recorded_tokens, recorded_bytes=recorded_bytes, tier=tier
        )
        if recall is None or restore is None or park is None:
            return None
        return max(0.0, reuse) * (recall - restore), park

    def park_pays(
        self,
        n_tokens: int,
        *,
        unmeasured_min: int = 0,
        reuse: float = 1.0,
        recorded_tokens: int = 0,
        recorded_bytes: int = 0,
        tier: str = "",
    ) -> bool:
        """Whether a park that spares bringing ``n_tokens`` back is worth its cost: its
        expected saving exceeds the park's measured time (:meth:`park_gain`; with the defaults,
        whether prefilling ``n_tokens`` costs more than the park and a checkpoint restore).
        Until all three are measured, whether ``n_tokens`` is at least ``unmeasured_min``.

        Issue 45: with flash attention off an H100 spent 60-80 ms parking the transposed V of
        every one-shot 2k-token prompt (1.71x plain Llama), for prompts that never returned and
        whose pages L3 held anyway."""
        gain = self.park_gain(
            n_tokens,
            reuse=reuse,
            recorded_tokens=recorded_tokens,
            recorded_bytes=recorded_bytes,
            tier=tier,
        )
        if gain is None:
            return n_tokens >= unmeasured_min
        saving, cost = gain
        return saving > cost


class AlwaysRestore(CostModel):
    """A cost model whose rules always answer yes: every hit is restored and every prefix
    parked that the tiers can hold. It still measures, so admission and status see the rates."""

    def pages_pay(
        self, moved_bytes: int, saved_tokens: int, *, tier: str, storage: bool = False
    ) -> bool:
        return True

    def checkpoint_pays(self, saved_tokens: int) -> bool:
        return True

    def park_pays(
        self,
        n_tokens: int,
        *,
        unmeasured_min: int = 0,
        reuse: float = 1.0,
        recorded_tokens: int = 0,
        recorded_bytes: int = 0,
        tier: str = "",
    ) -> bool:
        return True
