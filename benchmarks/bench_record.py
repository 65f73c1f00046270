"""What an L3 record costs the request that makes it, and what it leaves to the writer.

After a request, SkippyLlama captures the prompt's new cells and queues them for L3. This times,
for one prompt of ``--tokens`` random tokens (L1 off, L3 on in a fresh directory, the built-in
model unless ``--model``):

- ``record_s``: the request path's part (``Recorder.after_request``: capture and queueing);
- ``close_s``: ``close()``, which waits for the writer (cutting pages, compressing, writing);
- ``cold_s``: the prompt's prefill, the yardstick (``record_s / cold_s``).

Each measurement is a fresh child process. ``--compare-with DIR`` also runs every round on the
``skippy_llama`` package found under DIR (a checkout of another commit, e.g. from
``git worktree add``), in alternating order, so two versions are compared side by side in one
run. Nothing here is a timed assertion.

Usage::

    git worktree add /tmp/before HEAD~1
    .venv/bin/python benchmarks/bench_record.py --tokens 4000 --rounds 3 \\
        --compare-with /tmp/before --out benchmarks/results/record.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

CHILD = """
import json, sys, tempfile, time
import numpy as np
import skippy_llama
from skippy_llama import SkippyLlama
from skippy_llama.config import Settings
from skippy_llama.models import resolve_model_path

model, n = (sys.argv[1] or None), int(sys.argv[2])
with tempfile.TemporaryDirectory() as tmp:
    settings = Settings(
        l1={"enabled": False},
        l3={"mode": "fixed", "budget": "8GiB", "directory": tmp, "minimum_free": "1GiB"},
    )
    llm = SkippyLlama(
        str(resolve_model_path(model)), n_ctx=n + 256, verbose=False, cache_settings=settings
    )
    tokens = [int(t) for t in np.random.default_rng(0).integers(100, llm.n_vocab() - 100, n)]
    spent = []
    real = llm.recorder.after_request

    def timed(event):
        started = time.perf_counter()
        real(event)
        spent.append(time.perf_counter() - started)

    llm.recorder.after_request = timed  # type: ignore[method-assign]
    started = time.perf_counter()
    llm.eval(tokens)  # records the prompt after its prefill (timed apart)
    cold = time.perf_counter() - started - spent[0]
    started = time.perf_counter()
    llm.close()
    close = time.perf_counter() - started
    print(json.dumps({
        "package": skippy_llama.__file__, "cold_s": cold, "record_s": spent[0], "close_s": close,
    }))
"""


def run_child(model: str | None, tokens: int, package_root: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    if package_root is not None:
        env["PYTHONPATH"] = str(package_root)
    env = {k: v for k, v in env.items() if not k.startswith("SKIPPY_")}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model or "", str(tokens)],
        capture_output=True,
        text=True,
        env=env,
        cwd=package_root or HERE.parent,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"child failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare-with", type=Path, default=None, metavar="DIR")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    versions: dict[str, Path | None] = {"this": None}
    if args.compare_with is not None:
        if not (args.compare_with / "skippy_llama" / "__init__.py").is_file():
            parser.error(f"--compare-with {args.compare_with}: no skippy_llama package there")
        versions["other"] = args.compare_with.resolve()
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in versions}
    names = list(versions)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            row = run_child(args.model, args.tokens, versions[name])
            rows[name].append(row)
            print(
                f"round {r + 1} {name}: cold {row['cold_s']:.3f} s, record "
                f"{row['record_s'] * 1e3:.1f} ms ({row['record_s'] / row['cold_s']:.4f} of cold), "
                f"close {row['close_s']:.3f} s",
                flush=True,
            )
    summary = {
        name: {
            key: statistics.median(row[key] for row in got)
            for key in ("cold_s", "record_s", "close_s")
        }
        for name, got in rows.items()
    }
    result = {
        "tokens": args.tokens,
        "model": args.model,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "compare_with": str(args.compare_with) if args.compare_with else None,
        "rounds": rows,
        "median": summary,
    }
    for name, med in summary.items():
        print(
            f"{name}: median record {med['record_s'] * 1e3:.1f} ms "
            f"({med['record_s'] / med['cold_s']:.4f} of cold), close {med['close_s']:.3f} s"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
