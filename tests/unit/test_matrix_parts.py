"""The matrix's pure parts: workloads, backend choice, gates, the Markdown report (no model)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from skippy_llama.cli.main import main
from skippy_llama.errors import ConfigError
from skippy_llama.matrix import gates, report, workloads
from skippy_llama.matrix.config import PRESETS, backends_for_build, select_backends
from skippy_llama.matrix.runner import Answer, Cell
from skippy_llama.matrix.store import StoreStats

SMALL = PRESETS["small"]


def test_requests_never_follow_their_own_conversation() -> None:
    """Interleaved: the live sequence is always another chat's or document's."""
    for name in ("chats", "documents"):
        reqs = workloads.build(name, SMALL)  # type: ignore[arg-type]
        keys = [r.chat or r.label.split()[0] for r in reqs]
        assert len(set(keys)) == 2
        assert all(a != b for a, b in itertools.pairwise(keys)), keys


def test_restart_puts_question_one_before_the_restart() -> None:
    reqs = workloads.build("restart", PRESETS["full"])
    assert [r.phase for r in reqs] == [1, 1, 2, 2, 2, 2]
    assert all(r.label.endswith("q1") for r in reqs if r.phase == 1)


def test_noreuse_prompts_share_no_prefix() -> None:
    prompts = [r.prompt or "" for r in workloads.noreuse(PRESETS["full"])]
    assert len(prompts) == 4
    assert len({p[:6] for p in prompts}) == 4


def test_backends_per_build_and_selection() -> None:
    assert [b.name for b in backends_for_build("CPU")] == ["CPU"]
    cuda = backends_for_build("CUDA")
    assert [b.name for b in cuda] == ["CPU", "CUDA"]
    # on a GPU build the CPU column keeps everything off the GPU
    assert cuda[0].llama_kwargs == {"n_gpu_layers": 0, "offload_kqv": False, "op_offload": False}
    assert cuda[1].llama_kwargs == {"n_gpu_layers": -1}
    assert [b.name for b in select_backends(cuda, ["cuda"])] == ["CUDA"]
    with pytest.raises(ConfigError, match="Vulkan"):
        select_backends(cuda, ["Vulkan"])


def _answers(texts: list[str], ttft: float, gap: float, tier: str = "l3") -> list[Answer]:
    return [
        Answer(text=t, ttft_ms=ttft, request_ms=ttft + 10, token_ms=[gap] * 4, prompt_tokens=100,
               tier=tier, cached_tokens=80 if tier != "cold" else 0)
        for t in texts
    ]  # fmt: skip


def _cell(tier: str, texts: list[str], **store: Any) -> Cell:
    return Cell(
        backend="CPU",
        kv="f16",
        workload="restart",
        tier=tier,  # type: ignore[arg-type]
        labels=["p1 a", "p2 a"],
        phases=[1, 2],
        answers=_answers(texts, 20.0, 10.0),
        cold=_answers(["x", "y"], 100.0, 10.0, "cold"),
        store=StoreStats(**store),
        emptied={"pass": True} if tier != "l1" else None,
    )


def test_gates_of_a_good_and_a_bad_cell() -> None:
    good = gates.summarize(
        _cell("l3", ["x", "y"], l3_page_bytes=100, bytes_written=110, pages=2),
        ["x", "y"],
        {"pass": True},
    )
    assert good["gates"] == {
        "exact": True,
        "l3_onoff": True,
        "restart": True,
        "write_amp": True,
        "low_space": True,
        "prune_clear": True,
        "decode_p99": True,
    }
    assert good["ttft_ratio"] == pytest.approx(0.2)
    assert good["restart_ttft_ratio"] == pytest.approx(0.2)
    bad = gates.summarize(
        _cell("l2", ["x", "z"], l3_page_bytes=100, bytes_written=130), ["x", "y"], {"pass": False}
    )
    assert bad["gates"]["exact"] is False and bad["gates"]["l3_onoff"] is False
    assert bad["gates"]["write_amp"] is False and bad["gates"]["low_space"] is False
    l1 = gates.summarize(_cell("l1", ["x", "y"]), None, {"pass": True})
    assert [g for g, v in l1["gates"].items() if v is None] == [
        "l3_onoff", "restart", "write_amp", "low_space", "prune_clear"
    ]  # fmt: skip
    nothing = _cell("l3", ["x", "y"])
    nothing.emptied = {"pass": False, "pages_before": 0, "pages_after": 0}
    none_stored = gates.summarize(nothing, ["x", "y"], {"pass": True})
    assert none_stored["gates"]["write_amp"] is None
    assert none_stored["gates"]["prune_clear"] is None
    totals = gates.overall([good, bad, l1])
    assert totals["exact"] == {"pass": 2, "fail": 1, "n/a": 0}


def test_markdown_report_lists_cells_and_a_skipped_portability() -> None:
    row = gates.summarize(
        _cell("l3", ["x", "y"], l3_page_bytes=100, bytes_written=100), ["x", "y"], None
    )
    text = report.markdown(
        {
            "config": {"preset": "small"},
            "model": "/m/model.gguf",
            "build_backend": "CPU",
            "backends": [{"name": "CPU"}],
            "commit": "abc",
            "seconds": 1.0,
            "rows": [row],
            "gate_totals": gates.overall([row]),
            "noreuse": [],
            "portability": {"skipped": "only one backend (CPU)"},
        }
    )
    assert "| CPU | f16 | restart | l3 |" in text
    assert "Skipped: only one backend (CPU)" in text


def test_cli_rejects_unknown_names_before_loading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["matrix", "--small", "--kv", "q4_0", "--out", str(tmp_path)]) == 2
    assert "--kv: q4_0 not in f16, q8_0" in capsys.readouterr().err
    assert main(["matrix", "--small"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err


def test_a_failing_step_is_reported_and_the_rest_runs(tmp_path: Path) -> None:
    """A build that cannot make a context (here: no model file) costs its cells, not the run."""
    from skippy_llama.matrix.run import run_matrix

    cfg = SMALL.with_overrides(kv_types=("f16", "q8_0"), n_noreuse=0)
    lines: list[str] = []
    result = run_matrix(
        cfg,
        str(tmp_path / "missing.gguf"),
        backends_for_build("CPU"),
        "CPU",
        tmp_path,
        with_portability=True,
        say=lines.append,
    )
    assert [(e["kv"], e["step"]) for e in result["errors"]] == [("f16", "load"), ("q8_0", "load")]
    assert result["rows"] == [] and "skipped" in result["portability"]
    assert any(line.startswith("!! CPU f16 load failed") for line in lines)
    result.update(seconds=0.0)
    assert "**Failed steps**" in report.markdown(result)
