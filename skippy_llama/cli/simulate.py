"""``skippy-llama kv-cache simulate TRACE --budget SIZE``: size L3 for your own traffic.

Replays a trace written with ``l3.trace_file`` / ``SKIPPY_TRACE`` under several budgets and
policies (no model, no store) and prints one table of saved prefill seconds, saved tokens, hit
ratios and bytes written, optionally as JSON and as a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..sizes import parse_size
from ..tiers.l3.policies import DEFAULT_POLICY
from ..tiers.l3.simulate import POLICY_CHOICES, format_table, plot, sweep
from ..tiers.l3.trace import TraceEvent, read_trace

#: With one --budget, the table also shows these multiples of it (sizing is about the curve).
SWEEP = (0.25, 0.5, 1.0, 2.0, 4.0)


def register(actions: Any) -> None:
    """Add ``simulate`` to the ``kv-cache`` actions."""
    parser = actions.add_parser(
        "simulate",
        help="replay an L3 trace under budgets and policies (no model needed)",
        description=(
            "Replay an L3 trace (written when l3.trace_file or SKIPPY_TRACE names a file) "
            "under byte budgets and policies, without a model or a store, and print saved "
            "prefill seconds, saved tokens, hit ratios and bytes written. With one --budget, "
            "the table also shows 1/4, 1/2, 2 and 4 times it; repeat --budget to choose the "
            "budgets yourself. 'optimal' is the offline optimum (Belady with sizes, it knows "
            "the future): the most any policy could save."
        ),
    )
    parser.add_argument("trace", metavar="TRACE", help="trace file (JSON lines)")
    parser.add_argument(
        "--budget",
        metavar="SIZE",
        action="append",
        required=True,
        help="L3 budget with an IEC suffix, e.g. 2GiB (repeatable)",
    )
    parser.add_argument(
        "--policy",
        action="append",
        choices=POLICY_CHOICES,
        help=f"policy to replay (repeatable; default: lru, {DEFAULT_POLICY} and optimal)",
    )
    parser.add_argument("--plot", metavar="PNG", help="also write saved seconds vs budget here")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(handler=cmd_simulate)


def _budgets(values: list[str]) -> list[int]:
    budgets = []
    for value in values:
        try:
            budgets.append(parse_size(value))
        except ValueError as exc:
            raise ConfigError(f"invalid --budget {value!r}: {exc} (example: 2GiB)") from None
    if len(budgets) == 1:
        budgets = [max(int(budgets[0] * f), 1) for f in SWEEP]
    return sorted(set(budgets))


def _events(path: str) -> list[TraceEvent]:
    try:
        events = list(read_trace(path))
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path!r}: {exc.strerror or exc}") from None
    if not events:
        raise ConfigError(
            f"trace {path!r} holds no events; record one with l3.trace_file or SKIPPY_TRACE"
        )
    return events


def cmd_simulate(args: argparse.Namespace) -> int:
    budgets = _budgets(args.budget)
    policies = list(dict.fromkeys(args.policy or ["lru", DEFAULT_POLICY, "optimal"]))
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ConfigError(f"--plot {args.plot!r} must name a .png file")
    events = _events(args.trace)
    results = sweep(events, budgets, policies)
    baseline = "lru" if "lru" in policies else policies[0]
    if args.json:
        print(json.dumps({"trace": args.trace, "results": [r.to_json() for r in results]}))
    else:
        lookups = results[0].lookups if results else 0
        print(f"trace {args.trace}: {lookups} lookups, {len(events) - lookups} records")
        print(format_table(results, baseline=baseline))
    if args.plot:
        try:
            written = plot(results, Path(args.plot), title=f"L3 replay of {Path(args.trace).name}")
        except ImportError as exc:
            print(f"skippy-llama: {exc}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"plot: {written}")
    return 0
