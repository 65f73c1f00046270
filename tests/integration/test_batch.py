"""``skippy-llama batch`` in real subprocesses on the real model: order, output, errors, resume."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from modelhelpers import TEXT

pytestmark = pytest.mark.model

DOCS = {
    "light": TEXT,
    "mill": TEXT.replace("lighthouse", "windmill").replace("Ships", "Carts"),
    "bell": TEXT.replace("lighthouse", "bell tower").replace("wick", "rope"),
}
QUESTIONS = ["Who climbs the stairs?", "How many steps are there?", "What is written down?"]


def _items() -> list[dict[str, Any]]:
    # documents interleaved in the input, as a queue of questions would arrive
    items: list[dict[str, Any]] = [
        {"id": f"{doc}-{q}", "prompt": f"{text}\nQuestion: {question}\nAnswer:"}
        for q, question in enumerate(QUESTIONS)
        for doc, text in DOCS.items()
    ]
    items.append({"id": "chat", "messages": [{"role": "user", "content": "Name a color."}]})
    return items


def _write_input(path: Path, items: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
    return path


def _cmd(inp: Path, out: Path, *flags: str, model: Path) -> list[str]:
    return [sys.executable, "-m", "skippy_llama.cli.main", "batch", str(inp), str(out),
            "--model", str(model), "--max-tokens", "8", "--threads", "2", *flags]  # fmt: skip


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prefix_order_runs_each_document_together_and_keep_order_agrees(
    smollm2_path: Path, tmp_path: Path
) -> None:
    inp = _write_input(tmp_path / "in.jsonl", _items())
    res = _run(*_cmd(inp, tmp_path / "a.jsonl", "--json", model=smollm2_path))
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    ordered = _records(tmp_path / "a.jsonl")
    docs = [r["id"].split("-")[0] for r in ordered if r["id"] != "chat"]
    switches = sum(a != b for a, b in itertools.pairwise(docs))
    assert switches == len(DOCS) - 1, docs  # each document's questions ran back to back
    assert "reuse" in res.stderr and "ETA" in res.stderr
    kept = _run(*_cmd(inp, tmp_path / "k.jsonl", "--json", "--keep-order", model=smollm2_path))
    assert kept.returncode == 0, kept.stderr
    in_order = _records(tmp_path / "k.jsonl")
    assert [r["id"] for r in in_order] == [i["id"] for i in _items()]
    # same answers whatever the order (cached == cold), more reuse in prefix order
    assert sorted(ordered, key=lambda r: r["id"]) == sorted(in_order, key=lambda r: r["id"])
    assert all("text" in r and r["prompt_tokens"] > 0 for r in ordered)
    keep_summary = json.loads(kept.stdout)
    # (where reuse ends on canonical batch boundaries, GPU builds, the two orders can tie)
    if llama_cpp.llama_supports_gpu_offload():
        assert summary["cached_tokens"] >= keep_summary["cached_tokens"]
    else:
        assert summary["cached_tokens"] > keep_summary["cached_tokens"]
    assert summary["run"] == summary["items"] == len(_items()) and summary["errors"] == 0
    # two of each document's three questions reuse it: over half of all prompt tokens, or,
    # cut back to whole 64-token granules on GPU builds, still over a third
    assert summary["reused_share"] > (0.35 if llama_cpp.llama_supports_gpu_offload() else 0.5)
    assert summary["est_cold_s"] is None or summary["est_cold_s"] > summary["elapsed_s"]


def test_sigkill_mid_run_then_resume_writes_the_same_output(
    smollm2_path: Path, tmp_path: Path
) -> None:
    inp = _write_input(tmp_path / "in.jsonl", _items())
    whole = _run(*_cmd(inp, tmp_path / "whole.jsonl", "--quiet", model=smollm2_path))
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "resumed.jsonl"
    proc = subprocess.Popen(_cmd(inp, out, "--quiet", model=smollm2_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 300
    while not (out.exists() and len(out.read_text().splitlines()) >= 3):
        assert proc.poll() is None, "batch finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(out.read_text().splitlines())
    assert 3 <= done < len(_items())
    with out.open("a") as f:
        f.write('{"id": "light-2", "text": " half wri')  # as if killed mid-write
    resumed = _run(*_cmd(inp, out, "--json", model=smollm2_path))
    assert resumed.returncode == 0, resumed.stderr
    assert "dropped a partial last line" in resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["already_done"] == done and summary["run"] == len(_items()) - done
    assert out.read_bytes() == (tmp_path / "whole.jsonl").read_bytes()
    # a finished batch run again has nothing left to do
    again = _run(*_cmd(inp, out, "--json", model=smollm2_path))
    assert again.returncode == 0 and json.loads(again.stdout)["run"] == 0


def test_failed_items_are_recorded_and_bad_lines_named(smollm2_path: Path, tmp_path: Path) -> None:
    items = [
        {"id": 1, "prompt": "The sky is"},
        {"id": 2, "prompt": TEXT * 40, "max_tokens": 4},  # longer than the context
        {"id": 3, "prompt": "The sea is"},
    ]
    inp = _write_input(tmp_path / "in.jsonl", items)
    out = tmp_path / "out.jsonl"
    res = _run(*_cmd(inp, out, "--n-ctx", "1024", "--keep-order", model=smollm2_path))
    assert res.returncode == 1, res.stderr
    records = _records(out)
    assert [r["id"] for r in records] == [1, 2, 3]
    assert "error" in records[1] and "context window" in records[1]["error"]
    assert "text" in records[0] and "text" in records[2]
    assert "1 failed" in res.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "ok"}\n{"id": 2, "prompt": "x", "max_tokens": -3}\n')
    res = _run(*_cmd(bad, tmp_path / "never.jsonl", model=smollm2_path))
    assert res.returncode == 2
    assert f"{bad} line 2: 'max_tokens' must be a positive integer" in res.stderr
    assert not (tmp_path / "never.jsonl").exists()
    res = _run(*_cmd(inp, inp, model=smollm2_path))
    assert res.returncode == 2 and "same file" in res.stderr
