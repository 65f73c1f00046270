"""``skippy-llama matrix --small`` end to end on SmolLM2: the report files and the CPU gates.

The matrix runs once, in a subprocess, as an operator would run it (about 2 minutes on 2 cores).
Only the gates that do not depend on timing are asserted: exactness, outputs with L3 on equal
outputs with L3 off, write amplification, low space → 0 writes, prune/clear → 0. TTFT and decode
ratios are measurements of a shared machine and are only checked to be present.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# one `skippy-llama matrix --small` run serves every test here: minutes on 2 cores
pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def matrix(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("matrix")
    proc = subprocess.run(
        # --backends CPU: on a GPU build too, so the test asks the same of every build (the GPU
        # columns and portability are the CLI's job there: docs/matrix.md)
        [sys.executable, "-m", "skippy_llama.cli.main", "matrix", "--small", "--out", str(out),
         "--model", str(smollm2_path), "--portability", "--backends", "CPU"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    for name in (
        "matrix.json",
        "matrix.md",
        "ttft_ratio.png",
        "bytes_stored.png",
        "decode_p99.png",
    ):
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
        if name.endswith(".png"):
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report: dict[str, Any] = json.loads((out / "matrix.json").read_text())
    report["_stdout"] = proc.stdout
    report["_markdown"] = (out / "matrix.md").read_text()
    return report


def test_every_cell_of_the_small_matrix_is_reported(matrix: dict[str, Any]) -> None:
    cells = {(r["kv"], r["workload"], r["tier"]) for r in matrix["rows"]}
    assert cells == {
        (kv, w, t)
        for kv in ("f16", "q8_0")
        for w in ("chats", "documents", "restart")
        for t in ("l1", "l2", "l3")
    }
    assert {r["backend"] for r in matrix["rows"]} == {"CPU"}
    for row in matrix["rows"]:
        assert row["ttft_ratio"] is not None and row["ttft_ratio"] > 0
        assert row["decode_p99_slowdown"] is not None, row  # replies were long enough to time
        assert f"| {row['kv']} | {row['workload']} | {row['tier']} |" in matrix["_markdown"]
        assert f"{row['kv']} {row['workload']} {row['tier']}:" in matrix["_stdout"]  # progress
    # the cache was used where it can be: L1 in the chats, L3 after the restart
    assert all(r["cached_tokens"] > 0 for r in matrix["rows"] if r["workload"] != "restart")
    for r in matrix["rows"]:
        if r["workload"] == "restart" and r["tier"] != "l1":
            assert r["served"].get("l3", 0) >= 1, r


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
@pytest.mark.parametrize("tier", ["l1", "l2", "l3"])
def test_outputs_equal_cold_and_l3_off(matrix: dict[str, Any], kv: str, tier: str) -> None:
    rows = [r for r in matrix["rows"] if r["kv"] == kv and r["tier"] == tier]
    assert len(rows) == 3
    for row in rows:
        assert row["gates"]["exact"] is True, row
        assert row["identical_outputs"] == row["requests"]
        if tier != "l1":
            assert row["gates"]["l3_onoff"] is True, row


def test_store_gates_hold(matrix: dict[str, Any]) -> None:
    for row in matrix["rows"]:
        if row["tier"] == "l1":
            for gate in ("l3_onoff", "restart", "write_amp", "low_space", "prune_clear"):
                assert row["gates"][gate] is None, (gate, row)
            continue
        assert row["gates"]["write_amp"] is True, row
        assert row["gates"]["low_space"] is True, row
        assert row["gates"]["prune_clear"] is True, row
        assert row["store"]["l3_pages"] > 0 and row["bytes_stored"] > 0
    for low in matrix["low_space"]:
        assert low["writes"] == 0 and low["bytes_written"] == 0
        assert low["state"] == "read_only_low_space"
        assert low["outputs_equal_cold"] is True


def test_noreuse_row_and_portability_skip(matrix: dict[str, Any]) -> None:
    modes = {r["mode"] for r in matrix["noreuse"]}
    assert modes == {"plain", "skippy", "skippy_l3"}
    for row in matrix["noreuse"]:
        assert row["outputs_equal_plain"] is True, row
        assert row["request_ratio"] is not None
    # one backend on this machine: portability is skipped with a message, not an error
    assert "only one backend" in matrix["portability"]["skipped"]
    assert "Skipped: only one backend" in matrix["_markdown"]
