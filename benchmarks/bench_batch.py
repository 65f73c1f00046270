#!/usr/bin/env python
"""Issue 11 benchmark: ``skippy-llama batch`` against a plain llama-cpp-python loop.

The input: ``--docs`` documents (default 5, ~300 tokens each, deterministic synthetic English)
× ``--questions`` questions (default 10) = 50 prompts ``DOCUMENT + question``, in the order a
queue would deliver them: the documents interleaved (doc 1 q 1, doc 2 q 1, …, doc 1 q 2, …).

Contenders, each in its own process, one after the other, 2 threads, ``n_ctx`` 4096, greedy,
``max_tokens`` 8:

* ``plain``      ``llama_cpp.Llama.create_completion`` over the items in input order (it reuses the
                 prefix it has live in its context, as llama-cpp-python always does);
* ``batch``      ``skippy-llama batch IN OUT`` (token-trie order, default settings: L1 only);
* ``keep_order`` ``skippy-llama batch --keep-order IN OUT`` (input order).

Reported: the time of the item loop (``plain``: measured around the loop; skippy: the summary's
``elapsed_s``, which also excludes model loading, tokenizing and ordering are inside it) and the
whole process's wall time, their ratios to ``plain``, the reused share, and whether every output
equals ``plain``'s.

Usage::

    .venv/bin/python benchmarks/bench_batch.py --out benchmarks/results/batch.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORDS = {
    "adj": [
        "quiet",
        "old",
        "northern",
        "narrow",
        "copper",
        "bright",
        "heavy",
        "distant",
        "wooden",
        "salty",
    ],
    "noun": [
        "keeper",
        "harbour",
        "engine",
        "ledger",
        "bridge",
        "lantern",
        "crane",
        "vessel",
        "signal",
        "market",
    ],
    "verb": ["repairs", "watches", "records", "measures", "guards", "opens", "follows", "inspects"],
    "place": ["pier", "station", "gate", "tower", "quay", "warehouse", "canal", "square"],
}


def document(seed: int, sentences: int = 24) -> str:
    rng = random.Random(seed)
    w = {k: (lambda v=v: rng.choice(v)) for k, v in WORDS.items()}
    return " ".join(
        f"The {w['adj']()} {w['noun']()} {w['verb']()} the {w['noun']()} near the {w['place']()}."
        for _ in range(sentences)
    )


def build_items(docs: int, questions: int) -> list[dict[str, Any]]:
    texts = [f"Report {d + 1}.\n" + document(d) for d in range(docs)]
    asks = [
        f"Question {q + 1}: what does the {WORDS['noun'][q % 10]} do?" for q in range(questions)
    ]
    return [
        {"id": f"d{d}-q{q}", "prompt": f"{texts[d]}\n{asks[q]}\nAnswer:"}
        for q in range(questions)
        for d in range(docs)
    ]


def plain_worker(inp: Path, out: Path, model: str, max_tokens: int) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(model, n_ctx=4096, n_threads=2, n_threads_batch=2, verbose=False)
    items = [json.loads(line) for line in inp.read_text().splitlines()]
    started = time.perf_counter()
    with out.open("w") as f:
        for item in items:
            result = llm.create_completion(item["prompt"], max_tokens=max_tokens, temperature=0.0)
            assert isinstance(result, dict)
            f.write(json.dumps({"id": item["id"], "text": result["choices"][0]["text"]}) + "\n")
    elapsed = time.perf_counter() - started
    print(json.dumps({"elapsed_s": round(elapsed, 3)}))


def _timed(argv: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{argv} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return time.perf_counter() - started, res


def _texts(path: Path) -> dict[str, str]:
    return {r["id"]: r["text"] for r in map(json.loads, path.read_text().splitlines())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=5)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, required=False)
    parser.add_argument("--plain-worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from skippy_llama.models import default_model_path

    model = args.model or str(default_model_path())
    if args.plain_worker:
        inp, out = args.plain_worker
        plain_worker(inp, out, model, args.max_tokens)
        return 0
    if args.out is None:
        parser.error("--out is required")
    scratch = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    inp = scratch / "in.jsonl"
    items = build_items(args.docs, args.questions)
    inp.write_text("".join(json.dumps(i) + "\n" for i in items))
    py = sys.executable
    runs: dict[str, Any] = {}

    print("bench_batch: plain …", file=sys.stderr, flush=True)
    wall, res = _timed([py, __file__, "--plain-worker", str(inp), str(scratch / "plain.jsonl"),
                        "--model", model, "--max-tokens", str(args.max_tokens)])  # fmt: skip
    runs["plain"] = {"wall_s": round(wall, 3), **json.loads(res.stdout)}
    reference = _texts(scratch / "plain.jsonl")
    for name, flags in (("batch", []), ("keep_order", ["--keep-order"])):
        print(f"bench_batch: {name} …", file=sys.stderr, flush=True)
        out = scratch / f"{name}.jsonl"
        wall, res = _timed([py, "-m", "skippy_llama.cli.main", "batch", str(inp), str(out),
                            "--model", model, "--max-tokens", str(args.max_tokens),
                            "--threads", "2", "--quiet", "--json", *flags])  # fmt: skip
        summary = json.loads(res.stdout)
        texts = _texts(out)
        runs[name] = {
            "wall_s": round(wall, 3),
            "elapsed_s": summary["elapsed_s"],
            "reused_share": summary["reused_share"],
            "est_cold_s": summary["est_cold_s"],
            "prompt_tokens": summary["prompt_tokens"],
            "identical_to_plain": f"{sum(texts[k] == v for k, v in reference.items())}/{len(reference)}",
        }
    plain = runs["plain"]
    for name in ("batch", "keep_order"):
        runs[name]["loop_vs_plain"] = round(runs[name]["elapsed_s"] / plain["elapsed_s"], 3)
        runs[name]["wall_vs_plain"] = round(runs[name]["wall_s"] / plain["wall_s"], 3)
    runs["batch"]["loop_vs_keep_order"] = round(
        runs["batch"]["elapsed_s"] / runs["keep_order"]["elapsed_s"], 3
    )
    report = {
        "command": " ".join([".venv/bin/python", "benchmarks/bench_batch.py", *(argv or sys.argv[1:])]),
        "git": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip(),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "items": len(items), "docs": args.docs, "questions": args.questions,
        "max_tokens": args.max_tokens, "runs": runs,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
