"""Is there a per-question overhead on the same document when each mode keeps one model object?

``bench_overhead.py`` builds a fresh model object per round, so its per-round ratios carry each
object's memory layout and the machine's drift (a last request's ratio ranged 0.60-1.48 over 7
rounds in session 50). Here each mode (``bench_overhead.make_model``: plain ``Llama``,
SkippyLlama defaults, L3 on) builds one object, asks question 0 of the ``doc_questions``
document (cold, untimed), then every round times 8 new questions on each object, the modes'
order alternating per round. The JSON keeps every round's total and the paired ratios to plain.

Usage::

    PYTHONPATH=$PWD/tests/force_ngl LLCPP_FORCE_NGL=0 LLCPP_FORCE_THREADS=1 \
        .venv/bin/python benchmarks/experiments/probe_next_question.py --rounds 8 \
        --out benchmarks/results/next-question-s50.json
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import bench_overhead as bench
from overhead_workloads import document, question_prompt

MODES = ("plain", "skippy", "skippy_l3")
QUESTIONS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="skippy-next-question-") as tmp:
        models = {m: bench.make_model(m, Path(tmp) / m) for m in MODES}
        doc = document(bench._tokenizer(models["plain"]), 0)

        def ask(mode: str, index: int) -> None:
            prompt = question_prompt(doc, index)
            for _ in models[mode].create_completion(
                prompt, max_tokens=16, temperature=0.0, stream=True
            ):
                pass

        for mode in MODES:
            ask(mode, 0)
        totals: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                started = time.perf_counter()
                for q in range(QUESTIONS):
                    ask(mode, 1 + QUESTIONS * r + q)
                totals[mode].append(time.perf_counter() - started)
            print(r, {m: round(v[-1], 3) for m, v in totals.items()}, flush=True)
        for llm in models.values():
            llm.close()
    summary = {
        mode: {
            "paired_ratio_median": round(
                statistics.median(
                    a / b for a, b in zip(totals[mode], totals["plain"], strict=True)
                ),
                4,
            ),
            "paired_ratios": [
                round(a / b, 4) for a, b in zip(totals[mode], totals["plain"], strict=True)
            ],
        }
        for mode in MODES[1:]
    }
    out = {"questions": QUESTIONS, "load": os.getloadavg(), "totals_s": totals, "summary": summary}
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
