"""Replay an L3 trace under a byte budget against any policy (pure: no model, no diskcache).

The simulator keeps what the store keeps that matters to a policy: pages in prefix chains with
their size, tokens, creation and last-use time (the event index), hits, and how many recorded
prefixes run through each page. For each lookup it serves the longest stored prefix of the prompt's
page chain (and counts what that saves); for each record it asks the policy to admit the pages
the store lacks, in chain order (a refused page ends the record: the pages after it could never be
reached), then evicts by the policy's priority, lowest first, to the store's low watermark once
the budget is exceeded. Evicting a page takes the pages stored after it along (they are
unreachable); ties go deepest first.

Seconds saved by a hit are ``tokens x prefill rate - bytes x restore rate``, with the rates the
trace measured last (every policy is charged the same rates). A hit the live store would not
have restored (by the rates it had measured at that lookup, the restore costs more than the
prefill it saves: GPU builds) is served cold, as live. The replay counts page-aligned matches
only: the live store also reuses the head of a page where a prompt branches off inside it, so a
replay may find up to one page fewer per lookup than the live run did.

Restore points (recurrent and hybrid models, issue 46): a record's ``snapshot_bytes`` are stored
with its last page (its size grows by them, they count as bytes written and leave with the page),
and a ``points`` lookup is served only up to the deepest page found that carries a snapshot. A
point whose prefix ends inside a page (a prompt end) is keyed by a partial page no longer lookup
shares, so the replay finds only points at page boundaries (those taken every N tokens of a long
prefill): it undercounts what restore points at prompt ends save.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...sizes import format_size, human_size
from .policies import LIVE_POLICIES, make_policy
from .policy_api import LOW_WATERMARK, PageStats, Policy, chain_lengths
from .trace import LookupEvent, RecordEvent, TraceEvent

#: Rates used when a trace carries none (SmolLM2-135M on 2 CPU cores, DESIGN.md §3): a cold
#: prefill of ~230 tokens/s; a restore of ~23 kB/token state at ~1 GB/s (read, assemble, set).
DEFAULT_PREFILL_S_PER_TOKEN = 1 / 230
DEFAULT_RESTORE_S_PER_BYTE = 1e-9
POLICY_CHOICES: tuple[str, ...] = (*LIVE_POLICIES, "optimal")


@dataclass(frozen=True)
class SimResult:
    """What one replay of a trace under one budget and policy achieved."""

    policy: str
    budget: int
    lookups: int
    hit_lookups: int
    prompt_tokens: int
    saved_tokens: int
    saved_s: float
    bytes_written: int
    pages_written: int
    pages_evicted: int
    pages_refused: int
    live_hit_tokens: int
    #: of ``bytes_written``, restore-point snapshots
    snapshot_bytes_written: int = 0

    @property
    def hit_ratio(self) -> float:
        """Lookups that reused at least one page."""
        return self.hit_lookups / self.lookups if self.lookups else 0.0

    @property
    def token_hit_ratio(self) -> float:
        """Prompt tokens served from the store."""
        return self.saved_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_ratio"] = self.hit_ratio
        out["token_hit_ratio"] = self.token_hit_ratio
        return out


@dataclass
class _Page:
    key: str
    size: int
    n_tokens: int
    depth: int
    parent: str | None
    created: float
    last_used: float
    hits: int = 0
    snapshot: int = 0  # bytes of a restore point's snapshot kept with this page (in ``size``)
    ends: int = 0  # recorded prefixes whose path runs through this page (the store's owners)
    is_end: bool = False
    children: set[str] = field(default_factory=set)


def trace_rates(events: Iterable[TraceEvent]) -> tuple[float, float]:
    """The last prefill and restore rates a trace measured (defaults where it has none)."""
    prefill: float | None = None
    restore: float | None = None
    for event in events:
        if isinstance(event, LookupEvent):
            prefill = event.prefill_s_per_token or prefill
            restore = event.restore_s_per_byte or restore
    return (prefill or DEFAULT_PREFILL_S_PER_TOKEN, restore or DEFAULT_RESTORE_S_PER_BYTE)


class OptimalPolicy:
    """Offline Belady with sizes: evict the page used again furthest in the future first, and
    never admit a page that is not used again. It reads the whole trace up front, so it is the
    yardstick to compare against, not a policy a store can run. ``now`` is the event index.

    It plays by the store's rules (this simulator: prefix chains, a refused page ends the record,
    the same budget, low watermark and rates), but it is Belady, not the true optimum: it writes
    every page used again, and a write that overflows the budget costs a pass down to the low
    watermark, so a policy that bypasses such a write can save more (a three-page trace in
    ``tests/unit/test_simulate.py``; up to 3 % on the synthetic workloads, ``policies.py``).
    """

    name = "optimal"

    def __init__(self, events: Sequence[TraceEvent]) -> None:
        uses: dict[str, list[int]] = {}
        for index, event in enumerate(events):
            if isinstance(event, LookupEvent):
                for key in event.keys:
                    uses.setdefault(key, []).append(index)
        self._uses = uses

    def next_use(self, key: str, now: float) -> float:
        """Index of the next lookup after ``now`` that contains page ``key`` (inf: none)."""
        seen = self._uses.get(key)
        if not seen:
            return math.inf
        i = bisect.bisect_right(seen, now)
        return float(seen[i]) if i < len(seen) else math.inf

    def admit(self, page: PageStats, now: float) -> bool:
        return self.next_use(page.key.decode(), now) < math.inf

    def priority(self, page: PageStats, now: float) -> float:
        # size breaks ties between pages next used at the same lookup (the tail goes first)
        return -self.next_use(page.key.decode(), now) - page.size * 1e-12

    def evicted(self, page: PageStats, now: float) -> None:
        return None


def _restore_pays(event: LookupEvent, tokens: int, restored: int) -> bool:
    """The live store's rule (``CostModel.pages_pay``, which the planner asks) with the rates
    it had measured at this lookup: a restore dearer than the prefill it saves is not made.
    Until both rates are measured, restores go ahead, as they do live."""
    prefill, restore = event.prefill_s_per_token, event.restore_s_per_byte
    if prefill is None or restore is None:
        return True
    return restored * restore < tokens * prefill


class Simulator:
    """A simulated L3 store driven by trace events (see the module docstring)."""

    def __init__(
        self,
        budget: int,
        policy: Policy,
        *,
        rates: tuple[float, float] = (DEFAULT_PREFILL_S_PER_TOKEN, DEFAULT_RESTORE_S_PER_BYTE),
        low_watermark: float = LOW_WATERMARK,
    ) -> None:
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}")
        self.budget = budget
        self.policy = policy
        self.prefill_rate, self.restore_rate = rates
        self.low_watermark = low_watermark
        self.pages: dict[str, _Page] = {}
        self.used = 0
        self.now = 0.0
        self._lookups = self._hit_lookups = self._prompt = self._saved_tokens = 0
        self._saved_s = 0.0
        self._written = self._pages_written = self._evicted = self._refused = 0
        self._live_hits = 0
        self._snapshots_written = 0

    def _stats(self, page: _Page, chain_pages: int = 1) -> PageStats:
        return PageStats(
            key=page.key.encode(),
            size=page.size,
            n_tokens=page.n_tokens,
            created=page.created,
            last_used=page.last_used,
            hits=page.hits,
            sharers=max(page.ends, 1),
            chain_pages=chain_pages,
            prefill_s=page.n_tokens * self.prefill_rate,
            restore_s=page.size * self.restore_rate,
        )

    def step(self, event: TraceEvent) -> int:
        """Apply one event; for a lookup, return the tokens served (0 for a record)."""
        if isinstance(event, LookupEvent):
            served = self._lookup(event)
        else:
            self._record(event)
            served = 0
        self.now += 1.0
        return served

    def _lookup(self, event: LookupEvent) -> int:
        self._lookups += 1
        self._prompt += sum(event.tokens)
        self._live_hits += event.hit_tokens
        found: list[_Page] = []
        for key in event.keys:
            page = self.pages.get(key)
            if page is None:
                break
            found.append(page)
        if event.points:  # served only where a restore point was stored
            while found and not found[-1].snapshot:
                found.pop()
        tokens = sum(page.n_tokens for page in found)
        restored = sum(page.size for page in found)
        if not _restore_pays(event, tokens, restored):
            return 0  # the live store prefills such a prompt cold, touching no page
        for page in found:
            page.hits += 1
            page.last_used = self.now
        if tokens:
            self._hit_lookups += 1
            self._saved_tokens += tokens
            self._saved_s += tokens * self.prefill_rate - restored * self.restore_rate
        return tokens

    def _record(self, event: RecordEvent) -> None:
        last: _Page | None = None
        parent: str | None = None
        for depth, (key, n_tokens, size) in enumerate(
            zip(event.keys, event.tokens, event.bytes, strict=True)
        ):
            page = self.pages.get(key)
            if page is None:
                page = _Page(key, size, n_tokens, depth, parent, self.now, self.now)
                if not self.policy.admit(self._stats(page, len(event.keys)), self.now):
                    self._refused += 1
                    break
                self.pages[key] = page
                if parent is not None:
                    self.pages[parent].children.add(key)
                self.used += size
                self._written += size
                self._pages_written += 1
            else:
                page.last_used = max(page.last_used, self.now)  # a re-record is not a hit
            last, parent = page, key
        if last is not None and not last.is_end:
            last.is_end = True
            self._add_ends(last.key, 1)
        whole = last is not None and last.key == event.keys[-1]
        if event.snapshot_bytes and whole and last is not None and not last.snapshot:
            last.snapshot = event.snapshot_bytes
            last.size += event.snapshot_bytes
            self.used += event.snapshot_bytes
            self._written += event.snapshot_bytes
            self._snapshots_written += event.snapshot_bytes
        if self.used > self.budget:
            self._evict_to(int(self.budget * self.low_watermark))

    def _add_ends(self, key: str | None, n: int) -> None:
        while key is not None:
            page = self.pages[key]
            page.ends += n
            key = page.parent

    def _evict_to(self, target: int) -> None:
        chains = chain_lengths({p.key: (p.parent, p.depth) for p in self.pages.values()})
        order = sorted(
            self.pages.values(),
            key=lambda p: (
                self.policy.priority(self._stats(p, chains[p.key]), self.now),
                -p.depth,
                p.key,
            ),
        )
        for page in order:
            if self.used <= target:
                break
            if page.key in self.pages:
                self._remove_subtree(page)

    def _remove_subtree(self, top: _Page) -> None:
        stack, doomed = [top], []
        while stack:
            page = stack.pop()
            doomed.append(page)
            stack.extend(self.pages[k] for k in page.children)
        if top.parent is not None:
            self.pages[top.parent].children.discard(top.key)
            self._add_ends(top.parent, -top.ends)
        for page in reversed(doomed):  # deepest first, as the store's cut-back would
            del self.pages[page.key]
            self.used -= page.size
            self._evicted += 1
            self.policy.evicted(self._stats(page), self.now)

    def result(self) -> SimResult:
        """Totals so far."""
        return SimResult(
            policy=self.policy.name,
            budget=self.budget,
            lookups=self._lookups,
            hit_lookups=self._hit_lookups,
            prompt_tokens=self._prompt,
            saved_tokens=self._saved_tokens,
            saved_s=self._saved_s,
            bytes_written=self._written,
            snapshot_bytes_written=self._snapshots_written,
            pages_written=self._pages_written,
            pages_evicted=self._evicted,
            pages_refused=self._refused,
            live_hit_tokens=self._live_hits,
        )


def policy_for(name: str, budget: int, events: Sequence[TraceEvent]) -> Policy:
    """A fresh policy by name; ``optimal`` reads ``events`` (the future)."""
    if name == "optimal":
        return OptimalPolicy(events)
    return make_policy(name, budget)


def simulate(
    events: Sequence[TraceEvent],
    budget: int,
    policy: str | Policy,
    *,
    low_watermark: float = LOW_WATERMARK,
) -> SimResult:
    """Replay ``events`` under ``budget`` bytes with ``policy`` (a name or a policy object)."""
    chosen = policy_for(policy, budget, events) if isinstance(policy, str) else policy
    sim = Simulator(budget, chosen, rates=trace_rates(events), low_watermark=low_watermark)
    for event in events:
        sim.step(event)
    return sim.result()


def sweep(
    events: Sequence[TraceEvent], budgets: Sequence[int], policies: Sequence[str]
) -> list[SimResult]:
    """Every policy under every budget (budget-major order)."""
    return [simulate(events, b, name) for b in budgets for name in policies]


def format_table(results: Sequence[SimResult], *, baseline: str = "lru") -> str:
    """A fixed-width table: one row per budget and policy, saved seconds also relative to
    ``baseline`` under the same budget."""
    base = {r.budget: r.saved_s for r in results if r.policy == baseline}
    snapshots = any(r.snapshot_bytes_written for r in results)  # restore points: a column
    header = (
        f"{'budget':>10} {'policy':>8} {'saved s':>10} {'x ' + baseline:>8} "
        f"{'saved tok':>10} {'hit %':>6} {'tok hit %':>9} {'written':>10} {'evicted':>8}"
        + (f" {'snapshots':>10}" if snapshots else "")
    )
    lines = [header, "-" * len(header)]
    for r in results:
        ref = base.get(r.budget)
        ratio = f"{r.saved_s / ref:.2f}" if ref else "-"
        lines.append(
            f"{format_size(r.budget):>10} {r.policy:>8} {r.saved_s:>10.2f} {ratio:>8} "
            f"{r.saved_tokens:>10} {100 * r.hit_ratio:>6.1f} {100 * r.token_hit_ratio:>9.1f} "
            f"{human_size(r.bytes_written):>10} {r.pages_evicted:>8}"
            + (f" {human_size(r.snapshot_bytes_written):>10}" if snapshots else "")
        )
    return "\n".join(lines)


def plot(results: Sequence[SimResult], path: Path | str, *, title: str = "") -> Path:
    """Saved prefill seconds against budget, one line per policy, as a PNG.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'skippy-llama[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "plotting needs matplotlib: pip install 'skippy-llama[plot]' (or leave out --plot)"
        ) from exc
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in dict.fromkeys(r.policy for r in results):
        rows = sorted((r.budget, r.saved_s) for r in results if r.policy == name)
        ax.plot([b / 2**20 for b, _ in rows], [s for _, s in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    budgets = sorted({r.budget for r in results})
    ax.set_xticks([b / 2**20 for b in budgets], [format_size(b) for b in budgets])
    ax.minorticks_off()
    ax.set_xlabel("L3 budget")
    ax.set_ylabel("saved prefill seconds")
    ax.set_title(title or "L3 replay: saved prefill seconds vs budget")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
