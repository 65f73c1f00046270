"""The patch queue: documented patches that apply to a fresh sdist, and the roster check."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_llama.roster import PATCHES_DIR, ROSTER_PATH, queue_patches

ROOT = PATCHES_DIR.parent
BUILD = ROOT / "scripts" / "build_patched_llama.sh"
CERTIFY = ROOT / "scripts" / "certify.py"


@pytest.mark.parametrize("patch", queue_patches(), ids=lambda p: p.name)
def test_each_patch_says_what_why_and_abi(patch: Path) -> None:
    head = patch.read_text("utf-8").split("\ndiff --git", 1)[0]
    assert re.match(r"\d{4}-skippy-[a-z-]+\.patch$", patch.name)
    for field in ("What:", "Why:", "ABI added:"):
        assert field in head, f"{patch.name} lacks {field!r} in its header"
    # C API additions keep the skippy_ prefix
    added = re.findall(r"^\+\s*LLAMA_API\s+[^(]*?\b(\w+)\s*\(", patch.read_text("utf-8"), re.M)
    assert all(name.startswith("skippy_") for name in added), added


def _applied_queue(tmp_path: Path) -> Path:
    """A fresh sdist unpacked under ``tmp_path`` with the queue applied (skips where the sdist
    cannot be downloaded); its source directory."""
    done = subprocess.run(
        ["bash", str(BUILD), "apply", str(tmp_path)],
        capture_output=True, text=True, check=False, env=_env(),
    )  # fmt: skip
    if done.returncode != 0 and "downloading the llama-cpp-python" in done.stderr:
        _sdist_unavailable(
            f"the llama-cpp-python sdist could not be downloaded: {done.stderr[-300:]}"
        )
    assert done.returncode == 0, done.stderr
    src = Path(done.stdout.strip().splitlines()[-1])
    return src


def test_queue_applies_to_a_fresh_sdist(tmp_path: Path) -> None:
    src = _applied_queue(tmp_path)
    header = (src / "vendor/llama.cpp/include/llama.h").read_text()
    for symbol in (
        "skippy_abi_version",
        "skippy_patch_queue_sha256",
        "skippy_state_seq_range_get_data",
        "skippy_state_seq_append_data",
        "skippy_kv_layers",
        "skippy_kv_cells_get",
        "skippy_kv_cells_set",
        "#define SKIPPY_ABI_VERSION 2",
    ):
        assert symbol in header
    recorded = (src / "vendor/llama.cpp/src/skippy-queue.h").read_text()
    from skippy_llama.roster import queue_digest

    assert queue_digest() in recorded
    _assert_host_state_io_batches_device_copies(
        (src / "vendor/llama.cpp/src/llama-context.cpp").read_text()
    )


def _proposed_patches() -> list[Path]:
    """Patches the series names in a comment (``# NNNN-skippy-....patch: why not yet``): kept
    beside the queue, measured, waiting for a wheel built from them and a certification."""
    names = re.findall(
        r"^#\s*(\d{4}-skippy-[a-z-]+\.patch)\b", (PATCHES_DIR / "series").read_text("utf-8"), re.M
    )
    return [PATCHES_DIR / name for name in names]


def test_proposed_patches_say_what_why_and_abi_and_apply_after_the_queue(
    tmp_path: Path,
) -> None:
    proposed = _proposed_patches()
    if not proposed:
        pytest.skip("the series proposes no patch")
    for patch in proposed:
        assert patch.is_file(), f"the series proposes {patch.name}, which is not in patches/"
        head = patch.read_text("utf-8").split("\ndiff --git", 1)[0]
        for field in ("What:", "Why:", "ABI added:"):
            assert field in head, f"{patch.name} lacks {field!r} in its header"
    src = _applied_queue(tmp_path)
    for patch in proposed:
        applied = subprocess.run(
            ["patch", "-p1", "--batch", "--fuzz=0", "--quiet", "-i", str(patch)],
            cwd=src, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert applied.returncode == 0, f"{patch.name}: {applied.stdout}{applied.stderr}"


def _assert_host_state_io_batches_device_copies(source: str) -> None:
    """Patch 0005: the host state io queues device copies asynchronously, and every place that
    builds one (the stock state calls and the skippy_* ones) hands it the context's backends;
    one that did not would silently keep a synchronized copy per tensor on a GPU."""
    for call in (
        "ggml_backend_tensor_get_async(winfo.backend",
        "ggml_backend_tensor_set_async(rinfo.backend",
    ):
        assert call in source
    built = re.findall(r"llama_io_(?:write|read)_host(?:>\(|\s+io\()(.*?)\);", source)
    assert len(built) >= 7, built  # state get/set, seq get/set (3), range export, append import
    assert all("backends" in args for args in built), built


def _sdist_unavailable(message: str) -> None:
    """Skip without the sdist, except under CI (``CI`` set): there it fails, as the model and
    browser tests do (``tests/conftest.py``), so CI cannot go green without applying the queue."""
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and {message}")
    pytest.skip(message)


def test_a_missing_sdist_fails_under_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        _sdist_unavailable("the sdist could not be downloaded")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        _sdist_unavailable("the sdist could not be downloaded")


def test_a_patch_that_does_not_apply_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "patches", repo / "patches")
    shutil.copytree(ROOT / "skippy_llama", repo / "skippy_llama")
    (repo / "scripts").mkdir()
    for script in (BUILD, BUILD.parent / "wheel_build.sh"):
        shutil.copy(script, repo / "scripts")
    patch = repo / "patches" / queue_patches()[1].name
    patch.write_text(
        patch.read_text().replace("io.write(&n_stream, sizeof(n_stream));", "io.write(&nope);")
    )
    done = subprocess.run(
        ["bash", str(repo / "scripts" / BUILD.name), "apply", str(tmp_path / "src")],
        capture_output=True, text=True, check=False, env=_env(),
    )  # fmt: skip
    assert done.returncode != 0
    assert "does not apply" in done.stderr


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CERTIFY), "--check", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_check_passes_on_this_checkout() -> None:
    done = _check()
    assert done.returncode == 0, done.stderr


def test_check_fails_on_a_changed_patch(tmp_path: Path) -> None:
    queue = tmp_path / "patches"
    shutil.copytree(PATCHES_DIR, queue)
    patch = queue / queue_patches()[0].name
    patch.write_text(patch.read_text().replace("Why:", "Why (edited):", 1))
    done = _check("--patches", str(queue))
    assert done.returncode == 1
    assert "patch queue" in done.stderr


def test_check_fails_on_a_hand_edited_roster(tmp_path: Path) -> None:
    roster = tmp_path / "split-certified.json"
    roster.write_text(ROSTER_PATH.read_text().replace("\n  ", "\n    ", 1))
    done = _check("--roster", str(roster))
    assert done.returncode == 1
    assert "by hand" in done.stderr


def test_check_fails_without_a_roster(tmp_path: Path) -> None:
    done = _check("--roster", str(tmp_path / "none.json"))
    assert done.returncode == 1
    assert "no roster" in done.stderr


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHON", sys.executable)
    return env
