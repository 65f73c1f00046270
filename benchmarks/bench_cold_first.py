"""Is a cold request slower with SkippyLlama? The first request of the document workloads
(a ~1,300-token document and a question, nothing cached), on a fresh model object of each mode
(``plain``, ``skippy`` defaults, ``skippy_l3``: bench_overhead's ``make_model``, 1 thread),
the modes rotated each round; wall and process CPU time of that one request.

Why: in ``bench_overhead.py``'s document and ``continue`` workloads the first request is a cold
prefill and most of a round's time, so its noise on a shared 2-core machine (the same request
took 10.3-13.5 s within minutes) decides their totals. Here it is measured alone, in more rounds.

Usage::

    PYTHONPATH=$PWD LLCPP_FORCE_NGL=0 .venv/bin/python benchmarks/bench_cold_first.py \
        --rounds 8 --out benchmarks/results/cold-first-s49.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("SKIPPY_BENCH_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import bench_overhead as bench
from overhead_workloads import document, question_prompt

MODES = ("plain", "skippy", "skippy_l3")


def cold_request(mode: str) -> tuple[float, float]:
    """Wall and CPU seconds of the first document question on a fresh ``mode`` model."""
    with tempfile.TemporaryDirectory(prefix="skippy-cold-first-") as tmp:
        llm = bench.make_model(mode, Path(tmp))
        try:
            prompt = question_prompt(document(bench._tokenizer(llm), 0), 0)
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in llm.create_completion(prompt, max_tokens=16, temperature=0.0, stream=True):
                pass
            return time.perf_counter() - wall, time.process_time() - cpu
        finally:
            llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds (every mode once each)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            runs[mode].append(cold_request(mode))
        print(r, {m: round(v[-1][0], 2) for m, v in runs.items()}, flush=True)
    summary = {}
    for mode in MODES[1:]:
        ratios = [a[0] / p[0] for a, p in zip(runs[mode], runs["plain"], strict=True)]
        summary[mode] = {
            "paired_wall_ratio_median": round(statistics.median(ratios), 3),
            "paired_wall_ratios": [round(x, 3) for x in ratios],
            "fastest_wall_ratio": round(
                min(a for a, _ in runs[mode]) / min(p for p, _ in runs["plain"]), 3
            ),
        }
    out = {"load": os.getloadavg(), "runs": runs, "summary": summary}
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
