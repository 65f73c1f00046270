"""Cache identity and page keys: every identity field changes the root, so a change is a miss."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from skippy_llama.identity import (
    CacheIdentity,
    ModelIdentity,
    chain_key,
    file_digest,
    file_stamp,
    page_keys,
    paging_refusal,
    process_digest,
    record_file_digest,
    stderr_progress,
)


def _identity(**changes: Any) -> CacheIdentity:
    model_changes = {
        k: changes.pop(k) for k in ("digest", "architecture", "geometry") if k in changes
    }
    model = ModelIdentity(
        digest="d" * 32, architecture="llama", geometry={"n_layer": 30, "n_embd": 576}
    )
    base = CacheIdentity(
        model=dataclasses.replace(model, **model_changes),
        layout_digest="l" * 32,
        type_k=1,
        type_v=1,
        flash_attn=False,
        v_trans=True,
        rope_freq_base=10000.0,
        rope_freq_scale=1.0,
        yarn=(-1.0, 1.0, 32.0, 1.0, 0.0, -1.0),
        n_swa=0,
        kv_unified=True,
        backend="CPU",
    )
    return dataclasses.replace(base, **changes)


CHANGES = {
    "digest": "e" * 32,
    "architecture": "qwen2",
    "geometry": {"n_layer": 31, "n_embd": 576},
    "layout_digest": "m" * 32,
    "type_k": 8,
    "type_v": 8,
    "flash_attn": True,
    "v_trans": False,
    "rope_freq_base": 500000.0,
    "rope_freq_scale": 0.5,
    "yarn": (1.0, 1.0, 32.0, 1.0, 4096.0, 2.0),
    "n_swa": 512,
    "kv_unified": False,
    "backend": "CUDA",
    "namespace": "tenant-b",
    "state_format": 2,
    "page_format": 2,
    "params": {"lora": {"digest": "xxh3:" + "a" * 32, "scale": 1.0}},
    "codec": {"name": "cachegen", "version": 1, "k_bits": [4, 4, 4], "v_bits": [4, 4, 4]},
}


def test_changes_cover_every_identity_field() -> None:
    fields = {f.name for f in dataclasses.fields(CacheIdentity)} - {"model"}
    fields |= {f.name for f in dataclasses.fields(ModelIdentity)} - {"name"}
    assert fields == set(CHANGES)


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_changing_any_identity_field_misses(name: str) -> None:
    base, changed = _identity(), _identity(**{name: CHANGES[name]})
    assert base.root != changed.root
    tokens = np.arange(300, dtype=np.int32)
    # keys chain from the root, so the same tokens under another identity share no page key
    assert not set(page_keys(base.root, tokens, 64)) & set(page_keys(changed.root, tokens, 64))


def test_model_name_is_not_identity() -> None:
    a = _identity()
    b = dataclasses.replace(a, model=dataclasses.replace(a.model, name="renamed.gguf"))
    assert a.root == b.root


def test_page_keys_chain() -> None:
    root = b"\x00" * 16
    tokens = np.arange(10, dtype=np.int32)
    keys = page_keys(root, tokens, 4)
    assert len(keys) == 2  # only full pages
    assert keys[0] == chain_key(root, tokens[:4])
    assert keys[1] == chain_key(keys[0], tokens[4:8])
    other = tokens.copy()
    other[1] = 99
    assert page_keys(root, other, 4)[1] != keys[1]  # a change early changes every later key


def test_file_digest_memoized_and_content_sensitive(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    memo = tmp_path / "memo.json"
    model.write_bytes(b"GGUF" + bytes(1000))
    first = file_digest(model, memo=memo)
    assert memo.is_file()
    assert file_digest(model, memo=memo) == first
    model.write_bytes(b"GGUF" + bytes(999) + b"\x01")
    assert file_digest(model, memo=memo) != first


def test_file_digest_memo_does_not_survive_an_in_place_rewrite(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    memo = tmp_path / "memo.json"
    model.write_bytes(b"GGUF" + bytes(4096))
    first = file_digest(model, memo=memo)
    before = model.stat()
    with model.open("r+b") as f:  # same size, same inode
        f.seek(100)
        f.write(b"\x01")
    os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = model.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    assert file_digest(model, memo=memo) != first


def test_recorded_digest_is_reused_only_for_the_stamp_it_was_verified_at(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    memo = tmp_path / "memo.json"
    model.write_bytes(b"GGUF" + bytes(64))
    stamp = file_stamp(model)
    assert record_file_digest(model, "sha256:" + "5" * 64, stamp, memo=memo)
    assert file_digest(model, memo=memo) == "sha256:" + "5" * 64  # no second hash
    model.write_bytes(b"GGUF" + bytes(63) + b"\x02")
    assert not record_file_digest(model, "sha256:" + "5" * 64, stamp, memo=memo)
    assert file_digest(model, memo=memo).startswith("xxh3:")


def test_file_digest_reports_progress_for_large_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import skippy_llama.identity as identity

    monkeypatch.setattr(identity, "PROGRESS_BYTES", 1 << 20)
    monkeypatch.setattr(identity, "_DIGEST_CHUNK", 1 << 19)
    big, small = tmp_path / "big.gguf", tmp_path / "small.gguf"
    big.write_bytes(bytes(3 << 19))
    small.write_bytes(bytes(1000))
    seen: list[tuple[int, int]] = []
    file_digest(big, memo=tmp_path / "memo.json", progress=lambda d, t: seen.append((d, t)))
    assert seen == [(1 << 19, 3 << 19), (2 << 19, 3 << 19), (3 << 19, 3 << 19)]
    seen.clear()
    file_digest(small, memo=tmp_path / "memo.json", progress=lambda d, t: seen.append((d, t)))
    assert seen == []


def test_stderr_progress_prints_tenths(capsys: pytest.CaptureFixture[str]) -> None:
    report = stderr_progress("model.gguf")
    for done in range(0, 101, 5):
        report(done, 100)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 11 and "model.gguf" in lines[-1] and "100%" in lines[-1]


def test_process_identity_is_never_durable_nor_shared() -> None:
    a, b = process_digest(), process_digest()
    assert a != b
    ident = _identity(digest=a)
    assert not ident.durable and not ident.model.durable
    assert _identity().durable
    assert ident.root != _identity().root


def test_recurrent_models_are_not_paged() -> None:
    assert paging_refusal("mamba", (), recurrent=True) is not None
    assert "ssm_" in (paging_refusal("jamba", ["blk.0.ssm_in.weight"], recurrent=False) or "")
    assert paging_refusal("llama", ["blk.0.attn_q.weight"], recurrent=False) is None
