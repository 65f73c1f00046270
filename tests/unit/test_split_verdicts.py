"""The split probe's verdict memo: what its key covers, and what it keeps (no model needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from skippy_llama.runtime import split_verdicts


@pytest.fixture(autouse=True)
def _private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(split_verdicts, "_verdicts", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_the_key_changes_with_the_model_file_and_the_settings(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    key = split_verdicts.verdict_key(str(model), ["n_ubatch=512"])
    assert key == split_verdicts.verdict_key(str(model), ["n_ubatch=512"])
    assert key != split_verdicts.verdict_key(str(model), ["n_ubatch=256"])
    st = model.stat()
    model.write_bytes(b"GGUF" + bytes(63) + b"\1")  # rewritten in place, mtime put back
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert key != split_verdicts.verdict_key(str(model), ["n_ubatch=512"])


def test_a_verdict_is_kept_for_a_new_process(tmp_path: Path) -> None:
    assert split_verdicts.lookup("k") is None
    split_verdicts.remember("k", False)
    split_verdicts._verdicts.clear()
    assert split_verdicts.lookup("k") is False
    memo = tmp_path / "xdg" / "skippy-llama" / "split-verdicts.json"
    assert json.loads(memo.read_text()) == {"k": False}


def test_an_entry_that_is_not_a_boolean_is_no_verdict(tmp_path: Path) -> None:
    memo = tmp_path / "xdg" / "skippy-llama" / "split-verdicts.json"
    memo.parent.mkdir(parents=True)
    memo.write_text(json.dumps({"k": 1, "j": "true"}))
    assert split_verdicts.lookup("k") is None and split_verdicts.lookup("j") is None


def test_an_unwritable_cache_only_keeps_the_verdict_in_the_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where the folder would go
    split_verdicts.remember("k", True)
    assert split_verdicts.lookup("k") is True
