#!/usr/bin/env python
"""Issue 32 benchmark: ``skippy-llama batch --workers N`` (Ray, prefix-affine shards) against
one process.

The input: ``--docs`` documents (default 8, ~300 tokens each, ``bench_batch.document``) ×
``--questions`` questions (default 6), shuffled (``--seed``). Each contender is the real CLI in
its own process, one after the other, ``n_threads`` 1 per process or actor, greedy,
``max_tokens`` 8:

* ``single``  ``skippy-llama batch IN OUT --threads 1`` (one process, trie order);
* ``ray1``    ``... --workers 1 --cpus-per-worker 1 --threads 1`` (a local Ray, one actor);
* ``ray2``    ``... --workers 2 --cpus-per-worker 1 --threads 1`` (two actors).

Reported: prompt tokens prefilled (measured by the caches) and the trie's estimate for
round-robin assignment of the same items to 2 actors; items per second of the item loop
(``single``: the summary's ``elapsed_s``; Ray: ``loop_s``, from every actor ready to the last
result) and whether every output line equals ``single``'s. ``--repeat`` runs the Ray pair again
(the machine is shared: the spread shows the noise).

``--plain`` adds the overhead where nothing is reused: ``--docs`` prompts that share no prefix
(one question per document), plain ``llama_cpp.Llama.create_completion`` in a loop against
``skippy-llama batch`` (one process, same threads), item-loop time ratio.

Usage::

    .venv/bin/python benchmarks/bench_batch_ray.py --plain --out benchmarks/results/batch_ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batch import build_items

ROOT = Path(__file__).resolve().parent.parent


def plain_worker(inp: Path, out: Path, model: str, max_tokens: int) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(model, n_ctx=4096, n_threads=1, n_threads_batch=1, verbose=False)
    items = [json.loads(line) for line in inp.read_text().splitlines()]
    started = time.perf_counter()
    with out.open("w") as f:
        for item in items:
            result = llm.create_completion(item["prompt"], max_tokens=max_tokens, temperature=0.0)
            assert isinstance(result, dict)
            f.write(json.dumps({"id": item["id"], "text": result["choices"][0]["text"]}) + "\n")
    print(json.dumps({"elapsed_s": round(time.perf_counter() - started, 3)}))


def _cli(inp: Path, out: Path, model: str, max_tokens: int, *flags: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "skippy_llama.cli.main", "batch", str(inp), str(out),
            "--model", model, "--max-tokens", str(max_tokens), "--threads", "1", "--quiet",
            "--json", *flags]  # fmt: skip
    started = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{argv} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(res.stdout)
    summary["wall_s"] = round(time.perf_counter() - started, 3)
    return summary


def _lines(path: Path) -> list[str]:
    return sorted(path.read_text().splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="Ray pairs to run (default 1)")
    parser.add_argument("--plain", action="store_true", help="also the no-reuse overhead")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path)
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
    scratch = Path(tempfile.mkdtemp(prefix="bench-batch-ray-"))
    items = build_items(args.docs, args.questions)
    random.Random(args.seed).shuffle(items)
    inp = scratch / "in.jsonl"
    inp.write_text("".join(json.dumps(i) + "\n" for i in items))

    def log(msg: str) -> None:
        print(f"bench_batch_ray: {msg}", file=sys.stderr, flush=True)

    log("single …")
    single = _cli(inp, scratch / "single.jsonl", model, args.max_tokens)
    reference = _lines(scratch / "single.jsonl")
    single_prefill = single["prompt_tokens"] - single["cached_tokens"]
    runs: list[dict[str, Any]] = []
    for r in range(args.repeat):
        pair: dict[str, Any] = {}
        for name, workers in (("ray1", 1), ("ray2", 2)):
            log(f"{name} (round {r + 1}) …")
            out = scratch / f"{name}-{r}.jsonl"
            s = _cli(inp, out, model, args.max_tokens, "--workers", str(workers),
                     "--cpus-per-worker", "1")  # fmt: skip
            pair[name] = {
                "loop_s": s["loop_s"],
                "elapsed_s": s["elapsed_s"],
                "wall_s": s["wall_s"],
                "items_per_s": round(len(items) / s["loop_s"], 3),
                "prefilled_tokens": s["prefilled_tokens"],
                "plan_prefill": s["plan_prefill"],
                "round_robin_prefill": s["round_robin_prefill"],
                "one_process_prefill": s["one_process_prefill"],
                "shards": s["shards"],
                "schedule_speedup": s["schedule_speedup"],
                "busy_s": s["busy_s"],
                "parallelism": round(s["busy_s"] / s["loop_s"], 3),
                "steals": s["steals"],
                "items_per_actor": s["items_per_actor"],
                "identical_to_single": _lines(out) == reference,
            }
        pair["throughput_2_vs_1"] = round(pair["ray1"]["loop_s"] / pair["ray2"]["loop_s"], 3)
        runs.append(pair)
    ray2 = runs[0]["ray2"]
    figures: dict[str, Any] = {
        "single_prefilled_tokens": single_prefill,
        "single_items_per_s": round(len(items) / single["elapsed_s"], 3),
        "ray2_prefilled_tokens": ray2["prefilled_tokens"],
        "prefill_ray2_vs_single": round(ray2["prefilled_tokens"] / single_prefill, 3),
        "round_robin_estimate_2": ray2["round_robin_prefill"],
        "round_robin_vs_single": round(ray2["round_robin_prefill"] / single_prefill, 3),
        "round_robin_vs_ray2": round(ray2["round_robin_prefill"] / ray2["prefilled_tokens"], 3),
        "throughput_2_vs_1": [p["throughput_2_vs_1"] for p in runs],
        "schedule_speedup_2": ray2["schedule_speedup"],
        "parallelism_2": [p["ray2"]["parallelism"] for p in runs],
        "ray1_vs_single_loop": round(runs[0]["ray1"]["loop_s"] / single["elapsed_s"], 3),
        "all_identical": all(p[n]["identical_to_single"] for p in runs for n in ("ray1", "ray2")),
    }
    plain: dict[str, Any] | None = None
    if args.plain:
        unique = build_items(args.docs, 1)
        uinp = scratch / "unique.jsonl"
        uinp.write_text("".join(json.dumps(i) + "\n" for i in unique))
        log("plain (no reuse) …")
        res = subprocess.run(
            [sys.executable, __file__, "--plain-worker", str(uinp), str(scratch / "plain.jsonl"),
             "--model", model, "--max-tokens", str(args.max_tokens)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        plain_s = json.loads(res.stdout)["elapsed_s"]
        log("skippy single (no reuse) …")
        s = _cli(uinp, scratch / "unique-skippy.jsonl", model, args.max_tokens)
        want = {r["id"]: r["text"] for r in map(json.loads, _lines(scratch / "plain.jsonl"))}
        got = {r["id"]: r["text"] for r in map(json.loads, _lines(scratch / "unique-skippy.jsonl"))}
        plain = {
            "items": len(unique),
            "plain_loop_s": plain_s,
            "skippy_loop_s": s["elapsed_s"],
            "skippy_vs_plain": round(s["elapsed_s"] / plain_s, 3),
            "cached_tokens": s["cached_tokens"],
            "identical": got == want,
        }
        figures["no_reuse_skippy_vs_plain"] = plain["skippy_vs_plain"]
    report = {
        "command": " ".join([".venv/bin/python", "benchmarks/bench_batch_ray.py", *(argv or sys.argv[1:])]),
        "git": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "items": len(items), "docs": args.docs, "questions": args.questions,
        "max_tokens": args.max_tokens, "seed": args.seed,
        "figures": figures, "single": single, "runs": runs, "no_reuse": plain,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
