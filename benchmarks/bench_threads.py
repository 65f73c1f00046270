#!/usr/bin/env python
"""Why ``skippy-llama serve`` runs every model call on one thread (``server/worker.py``).

llama-cpp-python's CPU wheels link libgomp: each llama.cpp graph runs as an OpenMP parallel
region, and every thread that starts one gets its own team of worker threads. This times the
same prefill (a ``--suffix``-token batch after a ``--prefix``-token prompt, the shape of a chat
turn served from L1) with plain ``llama_cpp.Llama`` in a fresh process per mode:

* ``main``:    the model loaded and every decode run on the main thread (one team);
* ``worker``:  the model loaded and the prompt decoded on the main thread, then every timed
               prefill on one other thread (two teams: llama_cpp.server's pattern, whose
               calls run on anyio worker threads);
* ``one_worker``: everything, the first decode included, on that other thread (one team:
               what ``ModelThread`` does);
* ``alternate``: as ``worker``, but the timed prefills alternate between two other threads
               (three teams; anyio hands each call to whichever worker is idle).

Modes alternate ``--rounds`` times so slow stretches of a shared machine hit each of them.

Usage::

    .venv/bin/python benchmarks/bench_threads.py --out benchmarks/results/threads.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("main", "worker", "one_worker", "alternate")


def child(mode: str, prefix: int, suffix: int, repeats: int, threads: int) -> dict[str, Any]:
    import llama_cpp

    from skippy_llama.models import default_model_path

    pool, other = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    on_worker = mode == "one_worker"

    def load() -> llama_cpp.Llama:
        return llama_cpp.Llama(
            str(default_model_path()), n_ctx=4096, n_threads=threads, verbose=False
        )

    llm = pool.submit(load).result() if on_worker else load()
    words = "The keeper climbed the stairs each night to wind the clockwork of the lens. "
    tokens = llm.tokenize((words * 40).encode())[: prefix + suffix]
    if len(tokens) < prefix + suffix:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than {prefix + suffix}")
    memory = llama_cpp.llama_get_memory(llm._ctx.ctx)

    def first() -> None:
        llm.reset()  # type: ignore[no-untyped-call]
        llm.eval(tokens[:prefix])

    def prefill() -> float:
        llama_cpp.llama_memory_seq_rm(memory, 0, prefix, -1)
        llm.n_tokens = prefix
        started = time.perf_counter()
        llm.eval(tokens[prefix:])
        return time.perf_counter() - started

    pool.submit(first).result() if on_worker else first()
    times = []
    for i in range(repeats):
        time.sleep(0.05)
        if mode == "main":
            times.append(prefill())
        else:
            runner = other if mode == "alternate" and i % 2 else pool
            times.append(runner.submit(prefill).result())
    pool.shutdown()
    other.shutdown()
    return {"mode": mode, "median_s": statistics.median(times[2:]), "times_s": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per mode")
    parser.add_argument("--repeats", type=int, default=20, help="timed prefills per process")
    parser.add_argument("--prefix", type=int, default=300, help="tokens already in the context")
    parser.add_argument("--suffix", type=int, default=25, help="tokens per timed prefill")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        out = child(args.child, args.prefix, args.suffix, args.repeats, args.threads)
        print(json.dumps(out))
        return 0
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    for round_ in range(args.rounds):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--out", "-", "--child", mode]
            cmd += ["--repeats", str(args.repeats), "--prefix", str(args.prefix)]
            cmd += ["--suffix", str(args.suffix), "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[mode].append(result["median_s"])
            print(f"round {round_ + 1}: {mode:<11} {result['median_s'] * 1e3:7.1f} ms", flush=True)
    summary = {m: round(statistics.median(v) * 1e3, 1) for m, v in runs.items()}
    report = {
        "command": " ".join([".venv/bin/python", "benchmarks/bench_threads.py", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "threads": args.threads,
        "per_round_median_s": runs,
        "median_ms": summary,
        "worker_vs_main": round(summary["worker"] / summary["main"], 3),
        "one_worker_vs_main": round(summary["one_worker"] / summary["main"], 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["median_ms"]), "worker/main", report["worker_vs_main"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
