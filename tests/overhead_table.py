#!/usr/bin/env python
"""Turn ``bench_overhead.py``'s pytest-benchmark JSON into the Markdown tables of the benchmark notes.

Each timed test of the JSON is one round of one mode (``extra_info`` has ``round``). A ratio to
plain ``Llama`` is taken per round, against plain's run of the *same* round (run back to back
with it, so slow drift of the machine's speed cancels), and summarized as the median over rounds
with min-max. Beside it, the older view: each request's fastest round, summed, over plain's. Wall
and process CPU time are both reported (the CPU view is the one stolen time on shared cores does
not inflate; see bench_overhead's docstring). JSON written before the rounds were interleaved
(no ``round`` key) is printed in its old table.

It lives in ``tests/`` beside ``overhead_workloads.py`` so that its test runs in CI without the
tests depending on ``benchmarks/``.

Streamed workloads (``chat_stream`` and the document workloads) also get the time to the first
token, summed over a round's requests and of its last request, paired with plain's the same
way; the requests after the first are summed apart (``later_table``: the first is a cold prefill
for every mode, and in the document workloads most of a round's time). ``--readme`` prints the rows of README's Performance table for the document workloads
(same document, next question; interleaved documents after a restart) instead.

Usage::

    .venv/bin/python tests/overhead_table.py benchmarks/results/overhead.json
    .venv/bin/python tests/overhead_table.py --readme benchmarks/results/overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

Info = dict[str, Any]
#: (workload, mode) -> round -> that test's extra_info, in the order the JSON first names them
Rounds = dict[tuple[str, str], dict[int, Info]]


def _ratio(value: Any) -> str:
    return f"{value:.2f}×" if isinstance(value, (int, float)) else "–"


def by_round(rows: list[Info]) -> Rounds:
    """The timed rows grouped by (workload, mode) and round."""
    rounds: Rounds = {}
    for info in rows:
        if "round" in info:
            rounds.setdefault((info["workload"], info["mode"]), {})[info["round"]] = info
    return rounds


def paired_ratios(
    rounds: Rounds, workload: str, mode: str, value: Callable[[Info], float]
) -> list[float]:
    """Per round that both ran: ``value`` of ``mode`` over ``value`` of plain in the same round."""
    plain = rounds.get((workload, "plain"), {})
    mine = rounds.get((workload, mode), {})
    return [value(mine[r]) / value(plain[r]) for r in sorted(mine) if r in plain]


def fastest_rounds(infos: list[Info], key: str = "request_s") -> list[float]:
    """Each request's fastest time over the rounds."""
    return [min(times) for times in zip(*(info[key] for info in infos), strict=True)]


def fastest_ratio(rounds: Rounds, workload: str, mode: str, last: bool = False) -> float | None:
    """Summed fastest rounds (or the last request's fastest round) of ``mode`` over plain's."""
    plain = list(rounds.get((workload, "plain"), {}).values())
    mine = list(rounds[(workload, mode)].values())
    if not plain:
        return None
    pick: Callable[[list[float]], float] = (lambda t: t[-1]) if last else sum
    return pick(fastest_rounds(mine)) / pick(fastest_rounds(plain))


def _spread(ratios: list[float]) -> str:
    """Median (min–max) of paired ratios; one round gives just its ratio."""
    if not ratios:
        return "–"
    median = f"**{statistics.median(ratios):.2f}×**"
    if len(ratios) == 1:
        return median
    return f"{median} ({min(ratios):.2f}–{max(ratios):.2f})"


def _paired(rounds: Rounds, workload: str, mode: str, key: str) -> str:
    """The paired-ratio cell of ``key`` (``–`` for plain itself)."""
    if mode == "plain":
        return "–"
    return _spread(paired_ratios(rounds, workload, mode, lambda info: float(info[key])))


def _fastest(rounds: Rounds, workload: str, mode: str, last: bool) -> str:
    """The fastest-rounds ratio cell (``–`` for plain itself)."""
    return "–" if mode == "plain" else _ratio(fastest_ratio(rounds, workload, mode, last=last))


def _median(infos: list[Info], key: str) -> float:
    return statistics.median(float(info[key]) for info in infos)


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; empty without rows."""
    if not rows:
        return ""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


Cell = tuple[Rounds, str, str]  # the rounds, a workload, a mode


def _per_mode(rounds: Rounds, cells: Callable[[Cell, list[Info]], list[str]]) -> list[list[str]]:
    """One row per (workload, mode): the two names, then ``cells`` of its rounds."""
    return [[w, m, *cells((rounds, w, m), list(per.values()))] for (w, m), per in rounds.items()]


def _steps(events: dict[str, float] | None) -> str:
    """lookup / restore / prefill / record ms of summed ``last_cache_event`` steps; ``–``
    without (and no record step in JSON written before the event had one)."""
    if not events:
        return "–"
    steps = [events["lookup_ms"], events["restore_ms"], events["prefill_ms"]]
    steps += [events["record_ms"]] if "record_ms" in events else []
    return " / ".join(f"{ms:.0f}" for ms in steps)


def wall_table(rounds: Rounds) -> str:
    """Wall time: medians over rounds, paired ratios to plain and the fastest-round ratios."""

    def cells(cell: Cell, infos: list[Info]) -> list[str]:
        return [
            str(len(infos)),
            f"{_median(infos, 'total_s'):.2f} s",
            _paired(*cell, "total_s"),
            _fastest(*cell, last=False),
            f"{_median(infos, 'last_request_s'):.3f} s",
            _paired(*cell, "last_request_s"),
            _fastest(*cell, last=True),
            f"{max(i['close_s'] for i in infos):.3f} s",
        ]

    header = ["workload", "mode", "rounds", "total, median"]
    header += ["total ÷ plain, paired: median (min–max)", "total ÷ plain, fastest rounds"]
    header += ["last request, median", "last ÷ plain, paired: median (min–max)"]
    header += ["last ÷ plain, fastest rounds", "close(), max"]
    return _markdown(header, _per_mode(rounds, cells))


def _ttft_total(info: Info) -> float:
    return float(sum(info["ttft_s"]))


def _ttft_last(info: Info) -> float:
    return float(info["ttft_s"][-1])


def ttft_table(rounds: Rounds) -> str:
    """Time to the first token of the streamed workloads: summed over a round's requests and
    the last request's, medians over rounds and paired ratios to plain."""
    rows = []
    for (workload, mode), per_round in rounds.items():
        infos = list(per_round.values())
        if not all("ttft_s" in info for info in infos):
            continue
        cells = []
        for value in (_ttft_total, _ttft_last):
            ratios = paired_ratios(rounds, workload, mode, value)
            median = statistics.median(value(info) for info in infos)
            cells += [f"{median:.3f} s", "–" if mode == "plain" else _spread(ratios)]
        rows.append([workload, mode, *cells])
    header = ["workload", "mode", "TTFT summed, median", "TTFT ÷ plain, paired: median (min–max)"]
    header += ["last TTFT, median", "last TTFT ÷ plain, paired: median (min–max)"]
    return _markdown(header, rows)


def _later(key: str) -> Callable[[Info], float]:
    """The sum of a round's per-request ``key`` (``request_s``, ``request_cpu_s``, ``ttft_s``)
    after its first request."""
    return lambda info: float(sum(info[key][1:]))


def later_table(rounds: Rounds) -> str:
    """The requests after the first (wall, process CPU and, where streamed, time to the first
    token), summed per round: medians over rounds and paired ratios to plain.

    In the document workloads the first request is a cold prefill of the whole document, ~90 %
    of a round's time, the same work for every mode; what reusing the document costs or saves
    is in the requests after it (the next questions), which the totals hide.
    """
    rows = []
    for (workload, mode), per_round in rounds.items():
        infos = list(per_round.values())
        if any(len(info.get("request_s", [])) < 2 for info in infos):
            continue
        cells = []
        for key in ("request_s", "request_cpu_s", "ttft_s"):
            if not all(key in info for info in infos):
                cells += ["–", "–"]
                continue
            value = _later(key)
            ratios = paired_ratios(rounds, workload, mode, value)
            median = statistics.median(value(info) for info in infos)
            cells += [f"{median:.3f} s", "–" if mode == "plain" else _spread(ratios)]
        rows.append([workload, mode, *cells])
    header = ["workload", "mode", "after the first, median", "÷ plain, paired: median (min–max)"]
    header += ["CPU after the first, median", "CPU ÷ plain, paired: median (min–max)"]
    header += ["TTFT after the first, median", "TTFT ÷ plain, paired: median (min–max)"]
    return _markdown(header, rows)


#: README's rows: (workload, what the row measures)
README_ROWS = (
    ("doc_questions", "same document, next question as completions"),
    ("doc_chat", "same document, next question as chats"),
    ("doc_restart", "interleaved documents after a restart (L3 warm from a first process)"),
)
#: the modes of a README row, in order, as the row names them
README_MODES = (("skippy", "defaults"), ("skippy_l3", "L3 on"))


def _median_ratio(rounds: Rounds, workload: str, mode: str, value: Callable[[Info], float]) -> str:
    ratios = paired_ratios(rounds, workload, mode, value)
    return f"{statistics.median(ratios):.2f}×" if ratios else "–"


def _pair(
    rounds: Rounds, workload: str, mode: str, ttft: Callable[[Info], float], total: str
) -> str:
    """``TTFT ratio / total ratio`` (medians of paired ratios) of ``mode`` on ``workload``."""
    ttft_ratio = _median_ratio(rounds, workload, mode, ttft)
    return f"{ttft_ratio} / {_median_ratio(rounds, workload, mode, lambda i: float(i[total]))}"


#: workloads whose README row also gives the spread of a round's TTFT over the rounds
RESTART_WORKLOADS = ("doc_restart",)


def _ttft_spread(rounds: Rounds, workload: str, mode: str = "plain") -> str:
    """The slowest round's summed TTFT over the fastest's."""
    totals = [_ttft_total(info) for info in rounds[(workload, mode)].values()]
    return f"{max(totals) / min(totals):.2f}×"


def readme_rows(rounds: Rounds, result: str) -> list[str]:
    """README Performance rows of the document workloads found in ``rounds``: per mode the
    median paired ratio to plain of TTFT and total (summed over each round's requests), then
    the same of the last request; ``result`` is the JSON's path for the link."""
    rows = []
    modes = [(m, name) for m, name in README_MODES if any(k[1] == m for k in rounds)]
    for workload, what in README_ROWS:
        found = [(m, name) for m, name in modes if (workload, m) in rounds]
        if not found or (workload, "plain") not in rounds:
            continue

        every = "; ".join(_pair(rounds, workload, m, _ttft_total, "total_s") for m, _ in found)
        last = "; ".join(_pair(rounds, workload, m, _ttft_last, "last_request_s") for m, _ in found)
        names = " / ".join(name for _, name in found)
        rounds_n = len(rounds[(workload, "plain")])
        spread = ""
        if workload in RESTART_WORKLOADS and rounds_n > 1:
            # issue 42's target: how far apart a mode's runs are, beside plain's own
            mine = "; ".join(_ttft_spread(rounds, workload, m) for m, _ in found)
            spread = f", TTFT spread over rounds {mine} (plain {_ttft_spread(rounds, workload)})"
        rows.append(
            f"| {what}: TTFT / total vs plain `Llama` ({names}), median of {rounds_n} "
            f"round{'s' if rounds_n != 1 else ''} "
            f"| **{every}**, last requests {last}{spread}, replies equal "
            f"| [`bench_overhead.py`](benchmarks/bench_overhead.py) ([result]({result})) |"
        )
    return rows


def cpu_table(rounds: Rounds) -> str:
    """Process CPU time: medians over rounds and paired ratios to plain; CPU ÷ wall shows how
    many cores the process kept busy (it falls when other work takes the cores)."""

    def cells(cell: Cell, infos: list[Info]) -> list[str]:
        return [
            f"{_median(infos, 'cpu_s'):.2f} s",
            _paired(*cell, "cpu_s"),
            f"{_median(infos, 'last_request_cpu_s'):.3f} s",
            _paired(*cell, "last_request_cpu_s"),
            f"{statistics.median(i['cpu_s'] / i['total_s'] for i in infos):.2f}",
            f"{max(i['close_cpu_s'] for i in infos):.3f} s",
        ]

    header = ["workload", "mode", "CPU total, median", "CPU ÷ plain, paired: median (min–max)"]
    header += ["CPU last request, median", "CPU last ÷ plain, paired: median (min–max)"]
    header += ["CPU ÷ wall, median", "close() CPU, max"]
    return _markdown(header, _per_mode(rounds, cells))


def steps_table(rounds: Rounds) -> str:
    """The cache's own steps from ``last_cache_event``, summed over a round's requests (median
    over rounds); plain ``Llama`` has none."""
    rows = []
    for (workload, mode), per_round in rounds.items():
        events = [info["events"] for info in per_round.values() if "events" in info]
        if events:
            steps = {k: statistics.median(e[k] for e in events) for k in events[0]}
            tokens = [f"{steps['repaired_tokens']:.0f}", f"{steps['cached_tokens']:.0f}"]
            rows.append([workload, mode, _steps(steps), *tokens])
    header = ["workload", "mode", "lookup / restore / prefill / record (ms, summed)"]
    return _markdown([*header, "repaired tokens", "cached tokens"], rows)


def legacy_table(rows: list[Info]) -> str:
    """The table of JSON written before the rounds were interleaved (one row per mode, ratios
    computed by the benchmark on each request's fastest round)."""
    cells = []
    for info in rows:
        if "total_s" not in info:
            continue
        events = info.get("events")
        cells.append(
            [
                info["workload"],
                info["mode"],
                f"{info['total_s']:.2f} s",
                _ratio(info.get("ratio_total")),
                f"{info['last_request_s']:.3f} s",
                _ratio(info.get("ratio_last")),
                f"{info['close_s']:.3f} s",
                _steps(events),
                str(int(events["repaired_tokens"])) if events else "–",
            ]
        )
    header = ["workload", "mode", "total", "÷ plain", "last request", "÷ plain", "close()"]
    return _markdown([*header, "lookup / restore / prefill (ms, summed)", "repaired tokens"], cells)


def profile_table(rows: list[Info]) -> str:
    """The cProfile breakdown (inclusive seconds per group) of the profiled runs."""
    profiled = [info for info in rows if "profile" in info]
    if not profiled:
        return ""
    groups = list(profiled[0]["profile"]["groups_s"])
    cells = [
        [info["workload"], info["mode"], f"{info['profile']['profiled_wall_s']:.2f} s"]
        + [f"{info['profile']['groups_s'].get(g, 0.0):.2f} s" for g in groups]
        for info in profiled
    ]
    return _markdown(["workload", "mode", "profiled wall", *groups], cells)


def tables(rows: list[Info]) -> list[str]:
    """Every table the rows give, in print order (empty ones left out)."""
    rounds = by_round(rows)
    if rounds:
        found = [wall_table(rounds), ttft_table(rounds), later_table(rounds), cpu_table(rounds)]
        found.append(steps_table(rounds))
    else:
        found = [legacy_table(rows)]
    return [table for table in [*found, profile_table(rows)] if table]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="file written by --benchmark-json")
    parser.add_argument(
        "--readme", action="store_true", help="print README's rows of the document workloads"
    )
    args = parser.parse_args()
    data = json.loads(args.json.read_text())
    rows = [bench["extra_info"] for bench in data["benchmarks"] if bench.get("extra_info")]
    if args.readme:
        print("\n".join(readme_rows(by_round(rows), str(args.json))))
    else:
        print("\n\n".join(tables(rows)))


if __name__ == "__main__":
    main()
