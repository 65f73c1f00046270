"""The native verdict that ``skippy-llama run`` and ``kv-cache status`` print, on the real models.

Gemma 3 270M (sliding-window attention, a two-section state) is certified by the roster for the
L1 lane only; SmolLM2-135M (llama) for every lane. On the patched library built from this
checkout's patch queue both print ``certified`` with their lanes; on a stock wheel, ``stock``.
Each command runs as a real subprocess and loads the model as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_llama.roster import LANES, load_roster
from skippy_llama.runtime import native, native_ext

pytestmark = pytest.mark.model

CLI = [sys.executable, "-m", "skippy_llama.cli.main"]
PATCHED = native_ext.abi_version() is not None
STOCK = "stock: the llama.cpp library has no skippy patches [stock llama-cpp-python]"
L1_ONLY = ("l1_stream_copy_exact",)


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    # no SKIPPY_* settings from the caller's environment, and a private HOME: the defaults
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKIPPY_")}
    env["HOME"] = str(home)
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    return done


def _on_this_backend(lanes: tuple[str, ...]) -> tuple[str, ...]:
    """The row's lanes on this library's backend: patch 0004 makes lone decodes exact on the
    CPU's kernels only (the CUDA rows record the lane as failed)."""
    if native.backend_name() == "CPU":
        return lanes
    return tuple(lane for lane in lanes if lane != "lone_decode_exact")


def _expected(architecture: str, lanes: tuple[str, ...]) -> str:
    """The verdict line the roster's row gives on this library (written out, not computed)."""
    if not PATCHED:
        return STOCK
    roster = load_roster()
    assert roster is not None
    lanes = _on_this_backend(lanes)
    others = [lane for lane in LANES if lane not in lanes]
    key = f"{architecture} on {native.backend_name()}, K F16 / V F16, flash attention off"
    reason = f"{key} is certified for {', '.join(lanes)}"
    if others:
        reason += f"; stock paths for {', '.join(others)}"
    return f"certified: {reason} [{roster.recipe.describe()}]"


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "The lighthouse keeper climbed", "max_tokens": 2}) + "\n")
    return path


@pytest.mark.certified_backend
@pytest.mark.parametrize(
    ("model", "architecture", "lanes"),
    [("gemma3_path", "gemma3", L1_ONLY), ("smollm2_path", "llama", LANES)],
)
def test_run_and_status_print_the_models_roster_verdict(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    prompts: Path,
    model: str,
    architecture: str,
    lanes: tuple[str, ...],
) -> None:
    path: Path = request.getfixturevalue(model)
    want = _expected(architecture, lanes)
    ran = _cli(
        "run", "--model", str(path), "--prompts", str(prompts), "--no-baseline",
        "--n-ctx", "1024", home=tmp_path,
    )  # fmt: skip
    assert f"native: {want}\n" in ran.stdout
    assert "the live KV layout is unknown" not in ran.stdout + ran.stderr

    status = _cli("kv-cache", "status", "--model", str(path), home=tmp_path)
    assert f"native verdict for {path}: {want}\n" in status.stdout
    report = json.loads(
        _cli("kv-cache", "status", "--json", "--model", str(path), home=tmp_path).stdout
    )
    verdict = report["native"]["verdict"]
    assert verdict["reason"] == want
    if PATCHED:
        lanes = _on_this_backend(lanes)
        assert verdict["verdict"] == "certified" and tuple(verdict["lanes"]) == lanes
        assert set(verdict["failed"]) == set(LANES) - set(lanes)
        assert report["native"]["roster"]["certifies_library"] is True
    else:
        assert verdict["verdict"] == "stock" and verdict["lanes"] == []
        assert report["native"]["library"] is None


@pytest.mark.certified_backend
def test_status_without_a_model_prints_the_library_and_roster(tmp_path: Path) -> None:
    out = _cli("kv-cache", "status", home=tmp_path).stdout
    assert "native verdict: give --model PATH or --package DIR" in out
    if not PATCHED:
        assert "native library: stock llama-cpp-python" in out
        return
    roster = load_roster()
    assert roster is not None
    assert f"native library: {roster.recipe.describe()}\n" in out
    backend = native.backend_name()
    architectures = {row.key.architecture for row in roster.rows if row.key.backend == backend}
    assert "llama" in architectures  # every backend is certified on SmolLM2 at least
    assert f"    llama on {backend}, K F16 / V F16, flash attention off: " in out
    if "gemma3" in architectures:  # certified where the Gemma 3 packages were installed
        assert (
            f"    gemma3 on {backend}, K F16 / V F16, flash attention off: l1_stream_copy_exact "
            "(failed: page_restore_exact, range_export_slice, append_import_exact, "
            "restart_exact, lone_decode_exact, layer_copy_exact)\n"
        ) in out
