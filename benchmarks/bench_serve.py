#!/usr/bin/env python
"""The serving benchmark: ``skippy-llama serve`` against ``python -m llama_cpp.server``.

``users`` chat users x ``turns`` turns through the official ``openai`` client, streamed, greedy
(``--max-tokens``, default 32), turns interleaved round-robin (every user's turn 1, then every
turn 2, ...), one request at a time; each turn sends the whole history, the replies included.
``--think SECONDS`` leaves that gap after every reply (a user reading and typing; 0, the default:
back to back, so the server's idle work never runs). TTFT and request times never include it;
``wall_s`` does, ``request_sum_s`` does not. The system prompts (``--system``):

* ``own`` (default)  each user has their own ~600-token system prompt (no prefix shared between
                     users beyond the chat template's first tokens): what a new user would try;
* ``shared``         every user shares one system prompt (a ~170-token story plus instructions),
                     the workload of issue 11's runs (``bench_server.py`` before the two merged).

Contenders, each a server process the benchmark starts, one after the other (never two at once),
with no flags beyond the model, ``--n-ctx`` and the same thread count for all:

* ``llama_cpp``        ``python -m llama_cpp.server --cache false``: the reference outputs (it
                       still reuses the prefix it has live in its context);
* ``llama_cpp_cache``  ``python -m llama_cpp.server --cache true --cache_type ram`` (its 2 GiB
                       LlamaRAMCache);
* ``skippy``           ``skippy-llama serve`` with its defaults (``--memory-budget`` 2GiB);
* ``skippy_noidle``    (with ``--only``) the defaults plus ``--idle-repair-after 0``: no idle
                       work, so each chat's next turn decodes its previous reply in its prefill;
* ``skippy_tiers``     (with ``--only``) the defaults plus L2 (256 MiB) and a fixed 1 GiB L3 on a
                       fresh directory;
* ``skippy_prev``      (with ``--only``) the defaults before issue 34: resident prefixes of at
                       most ``n_ctx`` tokens in all (``SKIPPY_L1__BUDGET_TOKENS=n_ctx``, 16 slots).

Per contender: TTFT p50/p95 (client side: request sent -> first streamed chunk; both servers send
their first chat chunk with the first generated token), wall time of the whole workload, requests
summed, the server's peak RSS (``VmHWM`` before it stops), every reply's SHA-256 compared with
``llama_cpp``'s, and each ``skippy`` contender's TTFT p50 and requests against the best
``llama_cpp.server``. Each server first answers one warm-up request the workload does not use.
For skippy the server's own view of every request (tier, restore and TTFT in the server) is read
from ``/status.json`` before the server stops. Then ``--oneshot N`` prompts of ~600 tokens that
share nothing (completions, streamed) go to ``llama_cpp`` and ``skippy``: the cost of the cache
where nothing is reused.

The machines these ran on are shared: compare contenders within one run (ratios), not across
runs. Usage::

    .venv/bin/python benchmarks/bench_serve.py --out benchmarks/results/serve-b2b.json
    .venv/bin/python benchmarks/bench_serve.py --think 1.0 --out benchmarks/results/serve-think.json
    .venv/bin/python benchmarks/bench_serve.py --system shared --n-ctx 4096 --max-tokens 16 \
        --oneshot 0 --think 1.0 --only llama_cpp llama_cpp_cache skippy skippy_noidle \
        --out benchmarks/results/server-think.json
    .venv/bin/python benchmarks/bench_serve.py --users 2 --turns 2 --oneshot 2 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
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

SENTENCES = [s.strip() + "." for s in TEXT.split(".") if s.strip()]
TOPICS = ["the stairs", "the lens", "the clockwork", "the ships", "storms", "the logbook",
          "the whale", "his father", "the rock", "the wick", "the spray", "the boots"]  # fmt: skip
ASKS = ["Tell me about {t}.", "Why does {t} matter?", "What happened with {t} at night?",
        "Who else knew about {t}?", "Is {t} still there today?", "Summarize {t} in five words.",
        "What would a sailor say about {t}?", "How old is the story of {t}?"]  # fmt: skip
DEFAULTS = ("llama_cpp", "llama_cpp_cache", "skippy")
#: ``--system shared``: one system prompt for every user
SHARED_SYSTEM = (
    "You are the archivist of a small coastal museum. Answer visitors in one or two short "
    "sentences, using the story below.\n\n" + TEXT
)
TIER_FLAGS = ("--l2-budget", "256MiB", "--l3-mode", "fixed", "--l3-budget", "1GiB",
              "--l3-minimum-free", "1GiB")  # fmt: skip


def system_prompt(user: int, shared: bool = False, words: int = 450) -> str:
    """About 600 tokens of its own for each user: the story's sentences in a per-user order;
    ``shared``: the one system prompt every user shares."""
    if shared:
        return SHARED_SYSTEM
    rng = random.Random(user)
    head = (
        f"You are guide number {user + 1} of the lighthouse museum, in charge of "
        f"{TOPICS[user % len(TOPICS)]}. Answer in one or two short sentences. Notes:"
    )
    out = head.split()
    while len(out) < words:
        out += " ".join(rng.sample(SENTENCES, len(SENTENCES))).split()
    return " ".join(out[:words])


def oneshot_prompt(i: int) -> str:
    rng = random.Random(10_000 + i)
    body = " ".join(" ".join(rng.sample(SENTENCES, len(SENTENCES))) for _ in range(3))
    return f"Document {i + 1}. {body}\nQuestion: what does the keeper count?\nAnswer:"


def question(user: int, turn: int) -> str:
    return f"(visitor {user + 1}) " + ASKS[turn % len(ASKS)].format(t=TOPICS[user % len(TOPICS)])


def contenders(
    model: Path, n_ctx: int, threads: int, scratch: Path
) -> dict[str, tuple[list[str], dict[str, str]]]:
    py = sys.executable
    upstream = [py, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", str(n_ctx),
                "--n_threads", str(threads), "--n_threads_batch", str(threads),
                "--verbose", "false"]  # fmt: skip
    skippy = [py, "-m", "skippy_llama.cli.main", "serve", "--model", str(model), "--n-ctx",
              str(n_ctx), "--threads", str(threads), "--log-level", "warning"]  # fmt: skip
    return {
        "llama_cpp": ([*upstream, "--cache", "false"], {}),
        "llama_cpp_cache": ([*upstream, "--cache", "true", "--cache_type", "ram"], {}),
        "skippy": (skippy, {}),
        "skippy_noidle": ([*skippy, "--idle-repair-after", "0"], {}),
        "skippy_tiers": ([*skippy, *TIER_FLAGS, "--l3-dir", str(scratch / "l3")], {}),
        "skippy_prev": (
            skippy,
            {"SKIPPY_L1__BUDGET_TOKENS": str(n_ctx), "SKIPPY_L1__MAX_PREFIXES": "16"},
        ),
    }


def peak_rss(pid: int) -> int | None:
    """The process's peak resident set (VmHWM), bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _stream(client: Any, chat: bool, **kwargs: Any) -> tuple[float, float, str, Any]:
    """One streamed request: (ttft, total seconds, text, usage)."""
    sent = time.perf_counter()
    ttft, text, usage = None, "", None
    if chat:
        stream = client.chat.completions.create(
            model="m", stream=True, stream_options={"include_usage": True}, **kwargs
        )
    else:
        stream = client.completions.create(
            model="m", stream=True, stream_options={"include_usage": True}, **kwargs
        )
    for chunk in stream:
        if ttft is None:
            ttft = time.perf_counter() - sent
        if chunk.choices:
            part = chunk.choices[0]
            text += (part.delta.content or "") if chat else (part.text or "")
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
    total = time.perf_counter() - sent
    return ttft if ttft is not None else total, total, text, usage


def _stats(values: list[float]) -> dict[str, float]:
    p95 = statistics.quantiles(values, n=20)[18] if len(values) >= 2 else values[0]
    return {"p50_s": round(statistics.median(values), 4), "p95_s": round(p95, 4)}


def run_contender(
    name: str,
    argv: list[str],
    env: dict[str, str],
    args: argparse.Namespace,
    scratch: Path,
) -> dict[str, Any]:
    port = free_port()
    server = ServerProcess([*argv, "--port", str(port)], port, scratch / f"{name}.log", env=env)
    server.wait_ready()
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    greedy = {"max_tokens": args.max_tokens, "temperature": 0}
    rows: list[dict[str, Any]] = []
    oneshots: list[dict[str, Any]] = []
    served = counters = status = None
    try:
        client.chat.completions.create(  # warm-up, not measured
            model="m", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4,
            temperature=0,
        )  # fmt: skip
        shared = args.system == "shared"
        histories = [
            [{"role": "system", "content": system_prompt(u, shared)}] for u in range(args.users)
        ]
        load_before = os.getloadavg()
        started = time.perf_counter()
        for turn in range(args.turns):
            for user in range(args.users):
                history = histories[user]
                history.append({"role": "user", "content": question(user, turn)})
                ttft, total, text, usage = _stream(client, True, messages=history, **greedy)
                history.append({"role": "assistant", "content": text})
                rows.append({
                    "user": user, "turn": turn, "ttft_s": ttft, "request_s": total,
                    "sha256": _digest(text), "text": text,
                    "prompt_tokens": usage.prompt_tokens if usage else None,
                    "cached_tokens": getattr(getattr(usage, "prompt_tokens_details", None),
                                             "cached_tokens", None) if usage else None,
                })  # fmt: skip
                if args.think:
                    time.sleep(args.think)
        wall = time.perf_counter() - started
        load_after = os.getloadavg()
        if name.startswith("skippy"):
            with urllib.request.urlopen(server.base + "/status.json") as r:
                page = json.loads(r.read())
            served, counters = page["recent"][-len(rows) :], page["counters"]
            status = {"server": page["server"], "l1": page["l1"]}
        if args.oneshot and name in ("llama_cpp", "skippy"):
            for i in range(args.oneshot):
                ttft, total, text, _ = _stream(client, False, prompt=oneshot_prompt(i), **greedy)
                oneshots.append({"ttft_s": ttft, "request_s": total, "sha256": _digest(text)})
        rss = peak_rss(server.proc.pid)
    finally:
        code = server.stop()
    ttfts = [r["ttft_s"] for r in rows]
    result: dict[str, Any] = {
        "argv": argv,
        "env": env,
        "exit_code": code,
        "rows": rows,
        "wall_s": round(wall, 3),
        "request_sum_s": round(sum(r["request_s"] for r in rows), 3),
        "ttft": _stats(ttfts),
        "peak_rss_bytes": rss,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "server_side": served,
        "server_counters": counters,
        "server_status": status,
    }
    if oneshots:
        result["oneshot"] = {
            "rows": oneshots,
            "request_sum_s": round(sum(r["request_s"] for r in oneshots), 3),
            "ttft": _stats([r["ttft_s"] for r in oneshots]),
        }
    return result


def summarize(runs: dict[str, Any]) -> dict[str, Any]:
    ref = runs.get("llama_cpp")
    peer = runs.get("llama_cpp_cache")
    out: dict[str, Any] = {}
    for name, run in runs.items():
        row: dict[str, Any] = {
            "ttft_p50_s": run["ttft"]["p50_s"],
            "ttft_p95_s": run["ttft"]["p95_s"],
            "wall_s": run["wall_s"],
            "peak_rss_mib": round(run["peak_rss_bytes"] / 2**20) if run["peak_rss_bytes"] else None,
        }
        if ref is not None:
            same = sum(
                a["sha256"] == b["sha256"] for a, b in zip(run["rows"], ref["rows"], strict=True)
            )
            row["outputs_equal_to_llama_cpp"] = f"{same}/{len(ref['rows'])}"
        if peer is not None and name != "llama_cpp_cache":
            row["ttft_p50_vs_cache"] = round(run["ttft"]["p50_s"] / peer["ttft"]["p50_s"], 3)
            row["wall_vs_cache"] = round(run["wall_s"] / peer["wall_s"], 3)
            if run["peak_rss_bytes"] and peer["peak_rss_bytes"]:
                row["rss_vs_cache"] = round(run["peak_rss_bytes"] / peer["peak_rss_bytes"], 3)
        cached = [r["cached_tokens"] for r in run["rows"] if r["cached_tokens"] is not None]
        if cached:
            prompt = sum(r["prompt_tokens"] or 0 for r in run["rows"])
            row["cached_share"] = round(sum(cached) / prompt, 3) if prompt else None
        served = run.get("server_side")
        if served:
            row["tiers"] = {
                t: sum(r["tier"] == t for r in served) for t in ("l1", "l2", "l3", "cold")
            }
            row["suffix_tokens_p50"] = statistics.median(
                r["prompt_tokens"] - r["cached_tokens"] for r in served
            )
            row["server_ttft_p50_s"] = round(
                statistics.median(r["ttft_ms"] for r in served) / 1e3, 4
            )
            row["server_park_p50_ms"] = round(statistics.median(r["park_ms"] for r in served), 2)
            row["server_restore_p50_ms"] = round(
                statistics.median(r["restore_ms"] for r in served), 2
            )
            counters = run.get("server_counters") or {}
            row["turns_prepared"] = counters.get("turns_prepared")
            row["parked_ahead"] = counters.get("parked_ahead")
        out[name] = row
    upstream = [n for n in ("llama_cpp", "llama_cpp_cache") if n in runs]
    if upstream:
        best = min(runs[n]["ttft"]["p50_s"] for n in upstream)
        fastest = min(runs[n]["request_sum_s"] for n in upstream)
        for name, run in runs.items():
            if name.startswith("skippy"):
                out[name]["ttft_p50_vs_best_llama_cpp"] = round(run["ttft"]["p50_s"] / best, 3)
                out[name]["requests_vs_best_llama_cpp"] = round(run["request_sum_s"] / fastest, 3)
    if ref is not None and "oneshot" in ref:
        for name in ("skippy",):
            if name in runs and "oneshot" in runs[name]:
                mine, base = runs[name]["oneshot"], ref["oneshot"]
                out[name]["oneshot_requests_vs_llama_cpp"] = round(
                    mine["request_sum_s"] / base["request_sum_s"], 3
                )
                out[name]["oneshot_ttft_p50_vs_llama_cpp"] = round(
                    mine["ttft"]["p50_s"] / base["ttft"]["p50_s"], 3
                )
                same = sum(
                    a["sha256"] == b["sha256"]
                    for a, b in zip(mine["rows"], base["rows"], strict=True)
                )
                out[name]["oneshot_outputs_equal"] = f"{same}/{len(base['rows'])}"
    return out


def _git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "skippy_llama_dirty": bool(git("status", "--porcelain", "--", "skippy_llama")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--think", type=float, default=0.0, help="seconds after every reply")
    parser.add_argument(
        "--system", choices=("own", "shared"), default="own", help="system prompt per user or one"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--oneshot", type=int, default=8, help="one-shot prompts (0: none)")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=list(DEFAULTS), help="contenders to run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    model = args.model or default_model_path()
    report: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "benchmarks/bench_serve.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "git": _git_state(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "note": "shared machine: compare contenders within this run only"},
        "users": args.users, "turns": args.turns, "think_s": args.think, "system": args.system,
        "max_tokens": args.max_tokens, "n_ctx": args.n_ctx, "threads": args.threads,
        "oneshot": args.oneshot, "model": str(model), "contenders": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as scratch:
        table = contenders(model, args.n_ctx, args.threads, Path(scratch))
        unknown = set(args.only) - set(table)
        if unknown:
            parser.error(f"unknown contenders {sorted(unknown)}; choose from {sorted(table)}")
        for name in args.only:
            cmd, env = table[name]
            print(f"bench_serve: {name} ...", file=sys.stderr, flush=True)
            report["contenders"][name] = run_contender(name, cmd, env, args, Path(scratch))
    report["summary"] = summarize(report["contenders"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
