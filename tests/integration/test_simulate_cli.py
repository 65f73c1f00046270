"""``skippy-llama kv-cache simulate`` in subprocesses: tables, JSON, plot, bad input; and a trace
turned on by ``SKIPPY_TRACE`` in a real ``skippy-llama run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_llama.tiers.l3 import synthetic
from skippy_llama.tiers.l3.trace import read_trace, write_trace

MiB = 1 << 20


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SKIPPY_")}
    return subprocess.run(
        [sys.executable, "-m", "skippy_llama.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**base, **(env or {})},
    )


@pytest.fixture
def skewed(tmp_path: Path) -> Path:
    path = tmp_path / "skewed.jsonl"
    write_trace(path, synthetic.workload_events("skewed", synthetic.Shape(requests=120)))
    return path


def test_simulate_table_sweeps_one_budget(skewed: Path) -> None:
    done = cli("kv-cache", "simulate", str(skewed), "--budget", "64MiB")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"trace {skewed}: 120 lookups, 120 records"
    rows = [line.split() for line in lines[3:]]
    # 1/4, 1/2, 1, 2 and 4 times the budget, each with lru, reuse and optimal
    assert [r[1] for r in rows[:3]] == ["lru", "reuse", "optimal"]
    assert {r[0] for r in rows[:3]} == {"16MiB"}
    assert {r[0] for r in rows} == {"16MiB", "32MiB", "64MiB", "128MiB", "256MiB"}
    assert len(rows) == 15
    for budget in ("32MiB", "64MiB"):
        saved = {r[1]: float(r[2]) for r in rows if r[0] == budget}
        assert saved["optimal"] >= saved["reuse"] > saved["lru"]


def test_simulate_json_policies_and_plot(skewed: Path, tmp_path: Path) -> None:
    png = tmp_path / "plot.png"
    done = cli(
        "kv-cache",
        "simulate",
        str(skewed),
        "--budget",
        "32MiB",
        "--budget",
        "128MiB",
        "--policy",
        "shipped",
        "--policy",
        "lru",
        "--plot",
        str(png),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    got = [(r["budget"], r["policy"]) for r in report["results"]]
    budgets, policies = [32 * MiB, 128 * MiB], ["shipped", "lru"]
    assert got == [(b, p) for b in budgets for p in policies]
    first = report["results"][0]
    assert first["lookups"] == 120 and 0 <= first["hit_ratio"] <= 1
    assert first["saved_tokens"] > 0 and first["bytes_written"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "64MB"], "invalid --budget '64MB'"),
        (["--budget", "0MiB"], "greater than zero"),
        (["--budget", "64MiB", "--plot", "out.svg"], "must name a .png file"),
    ],
)
def test_simulate_rejects_bad_flags(skewed: Path, args: list[str], message: str) -> None:
    done = cli("kv-cache", "simulate", str(skewed), *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_simulate_rejects_bad_traces(tmp_path: Path) -> None:
    missing = cli("kv-cache", "simulate", str(tmp_path / "none.jsonl"), "--budget", "64MiB")
    assert missing.returncode == 2 and "cannot read trace" in missing.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    done = cli("kv-cache", "simulate", str(empty), "--budget", "64MiB")
    assert done.returncode == 2 and "holds no events" in done.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"v":1,"ev":"lookup","t":0,"keys":["ab"],"tokens":[1],"prompt_tokens":2}\n{')
    done = cli("kv-cache", "simulate", str(bad), "--budget", "64MiB")
    assert done.returncode == 2 and "bad.jsonl:2:" in done.stderr, done.stderr
    unknown = cli("kv-cache", "simulate", str(bad), "--budget", "64MiB", "--policy", "fifo")
    assert unknown.returncode == 2 and "invalid choice: 'fifo'" in unknown.stderr


def test_simulate_help_explains() -> None:
    done = cli("kv-cache", "simulate", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "optimal" in text and "SKIPPY_TRACE" in text and "--budget SIZE" in text


def test_l3_budget_below_floor_rejected_at_start_up(tmp_path: Path) -> None:
    done = cli(
        "kv-cache",
        "status",
        "--l3-mode",
        "fixed",
        "--l3-budget",
        "16MiB",
        "--l3-dir",
        str(tmp_path / "l3"),
    )
    assert done.returncode == 2
    assert "l3.budget" in done.stderr and "64MiB floor" in done.stderr


@pytest.mark.model
def test_skippy_trace_env_records_a_run_that_simulate_replays(
    smollm2_path: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "run.jsonl"
    doc = "The lighthouse keeper climbed the spiral stairs every evening at dusk. " * 12
    prompts = tmp_path / "prompts.jsonl"
    # questions of ~80 tokens: past a granule of n_ubatch 64 (GPU runs), each prompt's reusable
    # prefix reaches beyond the shared document, so the next prompt does not continue the last
    # record, which therefore cannot wait (defer_record_tokens) and is traced with its request
    questions = {q: f"Question {q}. " + f"Answer {q} " * 40 for q in "AB"}
    prompts.write_text(
        "".join(json.dumps({"prompt": doc + questions[q], "max_tokens": 2}) + "\n" for q in "ABAB")
    )
    done = cli(
        "run",
        "--prompts",
        str(prompts),
        "--no-baseline",
        "--n-ctx",
        "1024",
        "--l3-mode",
        "fixed",
        "--l3-budget",
        "256MiB",
        "--l3-dir",
        str(tmp_path / "l3"),
        "--l3-minimum-free",
        "1GiB",
        env={"SKIPPY_TRACE": str(trace), "SKIPPY_L1__ENABLED": "false"},
    )
    assert done.returncode == 0, done.stderr
    events = list(read_trace(trace))
    assert [type(e).__name__ for e in events] == ["LookupEvent", "RecordEvent"] * 4
    assert "lighthouse" not in trace.read_text()
    replay = cli("kv-cache", "simulate", str(trace), "--budget", "256MiB", "--json")
    assert replay.returncode == 0, replay.stderr
    results = json.loads(replay.stdout)["results"]
    at_budget = [r for r in results if r["budget"] == 256 * MiB]
    assert {r["policy"] for r in at_budget} == {"lru", "reuse", "optimal"}
    assert all(r["saved_tokens"] > 0 for r in at_budget)
