#!/usr/bin/env python
"""Issue 11 benchmark: ``skippy-llama serve`` against ``python -m llama_cpp.server``.

8 simulated chat users × 6 turns, interleaved round-robin (user 1 turn 1, user 2 turn 1, …),
through the official ``openai`` client with streaming, one request at a time. Every user shares
one system prompt (a ~170-token story plus instructions) and asks their own questions; each turn
sends the whole history, the replies included.

Contenders, each in its own server process, one after the other (never two at once), with the
same model, ``n_ctx`` 4096 and 2 threads:

* ``llama_cpp``        ``python -m llama_cpp.server`` without a cache (it still reuses the prefix it
                       has live in its context);
* ``llama_cpp_cache``  ``python -m llama_cpp.server --cache true`` (LlamaRAMCache, 2 GiB);
* ``skippy``           ``skippy-llama serve`` with default settings (L1: a server keeps 16
                       resident prefixes, before ``9fac420`` the library's 4; a reply left is
                       parked without its own cells, ``l1.repair_generated=never``, and since
                       ``a2cc3dc`` re-decoded for its chat's next turn once the server has been
                       idle for 0.2 s, ``--idle-repair-after``);
* ``skippy_tiers``     ``skippy-llama serve --l2-budget 256MiB --l3-mode fixed --l3-budget 1GiB``
                       on a fresh directory;
* ``skippy_noidle``    ``skippy-llama serve --idle-repair-after 0``: no idle work, so each chat's
                       next turn decodes its previous reply inside its own prefill (the
                       default before ``a2cc3dc``; older runs called it ``skippy_norepair``).

``--think SECONDS`` leaves that gap after every reply before the next request (a user reading
and typing; 0, the default, sends the next request at once, so idle work never runs). TTFT and
request times never include it; ``wall_s`` does, ``request_sum_s`` does not.

For skippy the server's own view of every request (tier, restore and TTFT in the server) is
read from ``/status.json`` before the server stops.

TTFT is measured in the client: from sending the request to the first streamed chunk (both servers
send their first chat chunk with the first generated token). Each server first answers one
warm-up request that the workload does not use. Greedy decoding: the outputs must be identical.

Usage::

    .venv/bin/python benchmarks/bench_server.py --out benchmarks/results/server.json
    .venv/bin/python benchmarks/bench_server.py --users 2 --turns 2 --out /tmp/s.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from modelhelpers import TEXT  # noqa: E402
from serverproc import ServerProcess, free_port  # noqa: E402

from skippy_llama.models import default_model_path  # noqa: E402

SYSTEM = (
    "You are the archivist of a small coastal museum. Answer visitors in one or two short "
    "sentences, using the story below.\n\n" + TEXT
)
TOPICS = ["the stairs", "the lens", "the clockwork", "the ships", "storms", "the logbook",
          "the whale", "his father"]  # fmt: skip
ASKS = ["Tell me about {t}.", "Why does {t} matter?", "What happened with {t} at night?",
        "Who else knew about {t}?", "Is {t} still there today?", "Summarize {t} in five words."]  # fmt: skip


def conversation(user: int, turns: int) -> list[str]:
    topic = TOPICS[user % len(TOPICS)]
    return [f"(visitor {user + 1}) " + ASKS[t % len(ASKS)].format(t=topic) for t in range(turns)]


TIER_FLAGS = ("--l2-budget", "256MiB", "--l3-mode", "fixed", "--l3-budget", "1GiB",
              "--l3-minimum-free", "1GiB")  # fmt: skip


def contenders(model: Path, scratch: Path) -> dict[str, list[str]]:
    py = sys.executable
    upstream = [py, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", "4096",
                "--n_threads", "2", "--n_threads_batch", "2", "--verbose", "false"]  # fmt: skip
    skippy = [py, "-m", "skippy_llama.cli.main", "serve", "--model", str(model), "--n-ctx",
              "4096", "--threads", "2", "--log-level", "warning"]  # fmt: skip
    return {
        "llama_cpp": [*upstream, "--cache", "false"],
        "llama_cpp_cache": [*upstream, "--cache", "true"],
        "skippy": skippy,
        "skippy_tiers": [*skippy, *TIER_FLAGS, "--l3-dir", str(scratch / "l3")],
        "skippy_noidle": [*skippy, "--idle-repair-after", "0"],
    }


def run_contender(
    name: str,
    argv: list[str],
    users: int,
    turns: int,
    max_tokens: int,
    scratch: Path,
    think: float = 0.0,
) -> dict[str, Any]:
    port = free_port()
    server = ServerProcess([*argv, "--port", str(port)], port, scratch / f"{name}.log")
    server.wait_ready()
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    rows: list[dict[str, Any]] = []
    try:
        client.chat.completions.create(  # warm-up, not measured
            model="m", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4,
            temperature=0,
        )  # fmt: skip
        histories = [[{"role": "system", "content": SYSTEM}] for _ in range(users)]
        questions = [conversation(u, turns) for u in range(users)]
        started = time.perf_counter()
        for turn in range(turns):
            for user in range(users):
                history = histories[user]
                history.append({"role": "user", "content": questions[user][turn]})
                sent = time.perf_counter()
                ttft, text, usage = None, "", None
                stream = client.chat.completions.create(
                    model="m", messages=history, max_tokens=max_tokens, temperature=0,
                    stream=True, stream_options={"include_usage": True},
                )  # fmt: skip
                for chunk in stream:
                    if ttft is None:
                        ttft = time.perf_counter() - sent
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    if chunk.usage is not None:
                        usage = chunk.usage
                total = time.perf_counter() - sent
                history.append({"role": "assistant", "content": text})
                cached = usage.prompt_tokens_details.cached_tokens if usage else None
                rows.append({"user": user, "turn": turn, "ttft_s": ttft, "request_s": total,
                             "text": text, "cached_tokens": cached,
                             "prompt_tokens": usage.prompt_tokens if usage else None})  # fmt: skip
                if think:
                    time.sleep(think)
        wall = time.perf_counter() - started
        served = counters = None
        if name.startswith("skippy"):
            with urllib.request.urlopen(server.base + "/status.json") as r:
                page = json.loads(r.read())
            served, counters = page["recent"][-len(rows) :], page["counters"]
    finally:
        code = server.stop()
    ttfts = [r["ttft_s"] for r in rows]
    return {
        "argv": argv,
        "exit_code": code,
        "server_side": served,
        "server_counters": counters,
        "rows": rows,
        "wall_s": round(wall, 3),
        "request_sum_s": round(sum(r["request_s"] for r in rows), 3),
        "think_s": think,
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p95_s": round(statistics.quantiles(ttfts, n=20)[18], 4),
        "ttft_sum_s": round(sum(ttfts), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=None, help="run only these contenders")
    parser.add_argument(
        "--think", type=float, default=0.0, help="seconds between a reply and the next request"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    model = args.model or default_model_path()
    scratch = Path(tempfile.mkdtemp(prefix="bench-server-"))
    report: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "benchmarks/bench_server.py", *(argv or sys.argv[1:])]),
        "git": _git_state(),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "users": args.users, "turns": args.turns, "max_tokens": args.max_tokens,
        "think_s": args.think,
        "model": str(model), "contenders": {},
    }  # fmt: skip
    try:
        for name, cmd in contenders(model, scratch).items():
            if args.only and name not in args.only:
                continue
            print(f"bench_server: {name} …", file=sys.stderr, flush=True)
            report["contenders"][name] = run_contender(
                name, cmd, args.users, args.turns, args.max_tokens, scratch, args.think
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report["summary"] = summarize(report["contenders"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))
    return 0


def summarize(runs: dict[str, Any]) -> dict[str, Any]:
    ref = runs.get("llama_cpp")
    out: dict[str, Any] = {}
    for name, run in runs.items():
        keys = ("ttft_p50_s", "ttft_p95_s", "ttft_sum_s", "wall_s", "request_sum_s")
        row = {k: run[k] for k in keys if k in run}
        if ref is not None:
            same = sum(
                a["text"] == b["text"] for a, b in zip(run["rows"], ref["rows"], strict=True)
            )
            row["identical_outputs"] = f"{same}/{len(ref['rows'])}"
        if run.get("server_side"):
            served = run["server_side"]
            row["server_ttft_p50_s"] = round(
                statistics.median(r["ttft_ms"] for r in served) / 1e3, 4
            )
            row["server_restore_p50_s"] = round(
                statistics.median(r["restore_ms"] for r in served) / 1e3, 4
            )
            row["server_park_p50_s"] = round(
                statistics.median(r.get("park_ms", 0.0) for r in served) / 1e3, 4
            )
            row["tiers"] = {
                t: sum(r["tier"] == t for r in served) for t in ("l1", "l2", "l3", "cold")
            }
            row["suffix_tokens_p50"] = statistics.median(
                r["prompt_tokens"] - r["cached_tokens"] for r in served
            )
            counters = run.get("server_counters") or {}
            row["turns_prepared"] = counters.get("turns_prepared")
            row["parked_ahead"] = counters.get("parked_ahead")
        cached = [r["cached_tokens"] for r in run["rows"] if r["cached_tokens"] is not None]
        if cached:
            prompt = sum(r["prompt_tokens"] for r in run["rows"])
            row["cached_share"] = round(sum(cached) / prompt, 3)
        out[name] = row
    upstream = [runs[n]["ttft_p50_s"] for n in ("llama_cpp", "llama_cpp_cache") if n in runs]
    if upstream:
        best = min(upstream)
        fastest = min(
            runs[n]["request_sum_s"] for n in ("llama_cpp", "llama_cpp_cache") if n in runs
        )
        for name in ("skippy", "skippy_tiers", "skippy_noidle"):
            if name in runs:
                out[name]["ttft_p50_vs_best_llama_cpp"] = round(runs[name]["ttft_p50_s"] / best, 3)
                out[name]["requests_vs_best_llama_cpp"] = round(
                    runs[name]["request_sum_s"] / fastest, 3
                )
    return out


def _git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "skippy_llama_dirty": bool(git("status", "--porcelain", "--", "skippy_llama")),
    }


if __name__ == "__main__":
    sys.exit(main())
