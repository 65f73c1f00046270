#!/usr/bin/env python
"""Turn ``bench_overhead.py``'s pytest-benchmark JSON into the Markdown tables of benchmarks/README.md.

Usage::

    .venv/bin/python benchmarks/overhead_table.py benchmarks/results/overhead.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _ratio(value: Any) -> str:
    return f"{value:.2f}×" if isinstance(value, (int, float)) else "–"


def overhead_table(rows: list[dict[str, Any]]) -> str:
    """Totals and last requests per workload and mode, with their ratios to plain ``Llama``."""
    lines = [
        "| workload | mode | total | ÷ plain | last request | ÷ plain | close() | "
        "lookup / restore / prefill (ms, summed) | repaired tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for info in rows:
        events = info.get("events")
        steps = (
            f"{events['lookup_ms']:.0f} / {events['restore_ms']:.0f} / {events['prefill_ms']:.0f}"
            if events
            else "–"
        )
        lines.append(
            f"| {info['workload']} | {info['mode']} | {info['total_s']:.2f} s "
            f"| {_ratio(info.get('ratio_total'))} | {info['last_request_s']:.3f} s "
            f"| {_ratio(info.get('ratio_last'))} | {info['close_s']:.3f} s | {steps} "
            f"| {int(events['repaired_tokens']) if events else '–'} |"
        )
    return "\n".join(lines)


def profile_table(rows: list[dict[str, Any]]) -> str:
    """The cProfile breakdown (inclusive seconds per group) of the profiled runs."""
    profiled = [info for info in rows if "profile" in info]
    if not profiled:
        return ""
    groups = list(profiled[0]["profile"]["groups_s"])
    lines = [
        "| workload | mode | profiled wall | " + " | ".join(groups) + " |",
        "|---|---|---|" + "---|" * len(groups),
    ]
    for info in profiled:
        prof = info["profile"]
        cells = " | ".join(f"{prof['groups_s'].get(g, 0.0):.2f} s" for g in groups)
        lines.append(
            f"| {info['workload']} | {info['mode']} | {prof['profiled_wall_s']:.2f} s | {cells} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="file written by --benchmark-json")
    args = parser.parse_args()
    data = json.loads(args.json.read_text())
    rows = [bench["extra_info"] for bench in data["benchmarks"] if bench.get("extra_info")]
    print(overhead_table(rows))
    profile = profile_table(rows)
    if profile:
        print()
        print(profile)


if __name__ == "__main__":
    main()
