"""``skippy-llama run`` in a real subprocess on the real model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "skippy_llama.cli.main"]


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.model
def test_run_jsonl_reuses_prefixes_and_matches_the_cold_baseline(
    tmp_path: Path, smollm2_path: Path
) -> None:
    doc = "Notes: " + "the harbour light turns twice a minute and the tide is high at noon. " * 12
    lines = [
        {"prompt": doc + "Question: when is high tide?\nAnswer:"},
        {"prompt": doc + "Question: how often does the light turn?\nAnswer:"},
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = _run(
        "run", "--prompts", str(prompts), "--json", "--max-tokens", "6", "--n-ctx", "1024"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["model"] == str(smollm2_path)
    rows = report["requests"]
    assert [r["tier"] for r in rows[:2]] == ["cold", "l1"]
    assert rows[1]["cached_tokens"] >= 128  # the shared notes (whole granules on GPU builds)
    assert report["totals"]["identical_outputs"] == 3
    assert report["totals"]["prefilled_tokens"] < report["totals"]["prompt_tokens"]


@pytest.mark.model
def test_run_table_output(tmp_path: Path, smollm2_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "One two three", "max_tokens": 2}) + "\n")
    result = _run("run", "--prompts", str(prompts), "--no-baseline", "--n-ctx", "512")
    assert result.returncode == 0, result.stderr
    assert "cached/prompt" in result.stdout and "totals: 1 requests" in result.stdout
    assert "live K/V dtype: K=F16 V=F16 by default" in result.stdout


def test_run_help_explains() -> None:
    result = _run("run", "--help", timeout=60)
    assert result.returncode == 0
    for flag in ("--model", "--prompts", "--json", "--l3-mode", "--package"):
        assert flag in result.stdout


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    result = _run("run", "--model", str(tmp_path / "nope.gguf"), timeout=60)
    assert result.returncode == 2
    assert "nope.gguf" in result.stderr and "does not exist" in result.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json\n", "line 1"),
        ('{"prompt": 3}\n', "needs 'prompt'"),
        ('{"prompt": "x", "max_tokens": 0}\n', "max_tokens"),
        ("\n", "holds no requests"),
    ],
)
def test_bad_prompts_file_names_the_problem(tmp_path: Path, content: str, message: str) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(content)
    result = _run("run", "--prompts", str(prompts), "--model", sys.executable, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


def test_bad_setting_flag_is_rejected(tmp_path: Path) -> None:
    result = _run("run", "--l3-mode", "fixed", "--l3-budget", "10GB", timeout=60)
    assert result.returncode == 2
    assert "l3.budget" in result.stderr
