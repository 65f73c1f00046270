"""Bundles of restore points (issue 46) through the real ``kv-cache export|import`` CLI: a chain
of points a SkippyLlama stored in one L3 (snapshots and attention pages) moves to another L3
and is served there exactly as a cold prefill; a changed byte, or a trusted signer's bundle
whose content does not hold together, is refused with the reason and nothing is written."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

if importlib.util.find_spec("cryptography") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (cryptography) is not installed", allow_module_level=True)

from test_handoff_bundle import l3_flags, open_store
from test_restore_point_tiers import _check, _doc, _tiers
from test_restore_points import _FAMILIES, _skippy, points_or_skip

from skippy_llama.cli.main import main
from skippy_llama.handoff.bundle import load_private_key, load_trust, read_signed, write_signed
from skippy_llama.handoff.points import read_point_bundle, write_point_bundle
from skippy_llama.restore_points import PointOwner, RestorePoint, pack_point, point_key

ROOT = bytes(range(16))
OWNER = PointOwner("model-a", "synthetic")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command line in a new process."""
    return subprocess.run(
        [sys.executable, "-m", "skippy_llama.cli.main", *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ),
        timeout=300,
    )


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    """(private key, public key) made by ``kv-cache keygen``."""
    assert main(["kv-cache", "keygen", str(tmp_path / "node-a")]) == 0
    return tmp_path / "node-a.pem", tmp_path / "node-a.pub.pem"


def _whole(n: int, seed: int = 0) -> RestorePoint:
    rng = np.random.default_rng(seed)
    return RestorePoint(rng.integers(3, 50_000, size=n).astype(np.int32), rng.bytes(2048))


def test_a_bundle_of_whole_points_round_trips_and_refuses_changes(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    short = _whole(40)
    long = RestorePoint(np.concatenate([short.tokens, _whole(20, 1).tokens]), b"s" * 3000)
    bundle = tmp_path / "points.skb"
    write_point_bundle(bundle, ROOT, OWNER, [short, long], load_private_key(keys[0]))
    read = read_point_bundle(bundle, read_signed(bundle, load_trust(keys[1])))
    assert [p.blob for p in read.points] == [short.blob, long.blob]
    assert read.owner == OWNER and read.root == ROOT
    # imported through the CLI: L3 serves both
    argv = ["kv-cache", "import", str(bundle), "--trust", str(keys[1]), "--json"]
    assert main([*argv, *l3_flags(tmp_path / "b")]) == 0
    with open_store(tmp_path / "b") as tier:
        got = tier.get_point(ROOT, long.tokens)
        assert got is not None and got.blob == long.blob
        assert sorted(tier.point_lengths(ROOT)) == [40, 60]
    # one changed byte: the signature
    raw = bytearray(bundle.read_bytes())
    raw[len(raw) // 2] ^= 1
    changed = tmp_path / "changed.skb"
    changed.write_bytes(bytes(raw))
    assert main([*argv[:2], str(changed), *argv[3:], *l3_flags(tmp_path / "c")]) == 3


def test_a_trusted_signer_cannot_serve_a_point_under_other_tokens(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A bundle signed by a trusted key whose record is not the one its key names (another
    point's record under this key, or another identity's) is refused: trust is in the signer,
    consistency is still checked."""
    point, other = _whole(30), _whole(30, seed=9)
    forged = tmp_path / "forged.skb"
    header = {
        "kind": "restore-points",
        "cache_identity": ROOT.hex(),
        "model_identity": "model-a",
        "model_name": "synthetic",
        "page_tokens": 128,
        "points": [],
        "pages": [],
    }
    record = pack_point(other, ROOT)  # the other point's record under this point's key
    header["points"] = [
        {
            "key": point_key(ROOT, point.tokens).hex(),
            "n_tokens": 30,
            "size": len(record),
            "digest": xxhash.xxh3_128_hexdigest(record),
        }
    ]
    write_signed(forged, header, [record], load_private_key(keys[0]))
    argv = ["kv-cache", "import", str(forged), "--trust", str(keys[1])]
    assert main([*argv, *l3_flags(tmp_path / "b")]) == 3
    assert "other tokens than its key" in capsys.readouterr().err
    # another identity's record (the root is in the record's header)
    header["cache_identity"] = bytes(range(1, 17)).hex()
    record = pack_point(point, ROOT)
    header["points"][0]["digest"] = xxhash.xxh3_128_hexdigest(record)  # type: ignore[index]
    write_signed(forged, header, [record], load_private_key(keys[0]))
    assert main([*argv, *l3_flags(tmp_path / "b")]) == 3
    assert "another cache identity" in capsys.readouterr().err
    with open_store(tmp_path / "b") as tier:
        assert tier.point_metas() == []


def _export_import(
    store_a: Path, store_b: Path, keys: tuple[Path, Path], out: Path
) -> dict[str, Any]:
    """Through the CLI in new processes: list A's points, export the deepest, import in B."""
    listed = cli("kv-cache", "export", "--list", "--json", *l3_flags(store_a))
    assert listed.returncode == 0, listed.stderr
    points = [r for r in json.loads(listed.stdout) if r["kind"] == "restore-point"]
    deepest = max(points, key=lambda r: r["tokens"])
    argv = ["kv-cache", "export", deepest["id"][:12], str(out), "--key", str(keys[0]), "--json"]
    exported = cli(*argv, *l3_flags(store_a))
    assert exported.returncode == 0, exported.stderr
    imported = cli("kv-cache", "import", str(out), "--trust", str(keys[1]), *l3_flags(store_b))
    assert imported.returncode == 0, imported.stderr
    assert "imported" in imported.stdout
    result: dict[str, Any] = json.loads(exported.stdout)
    return result


@pytest.mark.model
@pytest.mark.parametrize(
    "family",
    # about 10 s each (two CLI processes); the default lane runs one hybrid, CI's slow lane all
    [f if f == "lfm2" else pytest.param(f, marks=pytest.mark.slow) for f in _FAMILIES],
)
def test_restore_points_move_by_bundle_and_serve_exactly(
    family: str, synthetic_models: dict[str, Path], tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    path = synthetic_models[family]
    doc = _doc(300)
    llm = _skippy(path, _tiers(tmp_path / "a"), n_ctx=1024)
    try:
        points_or_skip(llm, family)
        assert _check(path, llm, [*doc, 1, 2]) == ("cold", 0)  # points at 256 and 302
    finally:
        llm.close()
    exported = _export_import(tmp_path / "a", tmp_path / "b", keys, tmp_path / "p.skb")
    assert exported["tokens"] == [256, 302] and exported["snapshot_bytes"] > 0
    # a purely recurrent model has no attention pages; the hybrids share theirs
    assert (exported["page_bytes"] == 0) == (family == "mamba2")
    again = _skippy(path, _tiers(tmp_path / "b"), n_ctx=1024)
    try:
        # two tokens after the point: the stock build decodes no lone one (lone_free_points)
        assert _check(path, again, [*doc, 1, 2, 3, 4]) == ("l3", 302)
        assert _check(path, again, doc[:280]) == ("l3", 256)
    finally:
        again.close()


@pytest.mark.model
@pytest.mark.slow
def test_gemma3_restore_points_move_by_bundle(
    gemma3_path: Path, tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    rng = np.random.default_rng(3)
    doc = [int(t) for t in rng.integers(3, 200_000, size=600)]
    llm = _skippy(gemma3_path, _tiers(tmp_path / "a"), n_ctx=1024)
    try:
        points_or_skip(llm, "gemma3", swa=True)
        assert _check(gemma3_path, llm, [*doc, 1, 2]) == ("cold", 0)
        align = llm.restore_points.align  # type: ignore[union-attr]
    finally:
        llm.close()
    exported = _export_import(tmp_path / "a", tmp_path / "b", keys, tmp_path / "g.skb")
    assert exported["tokens"] == list(range(align, 513, align))
    assert exported["page_bytes"] > 0  # the full-attention layers' cells as pages
    again = _skippy(gemma3_path, _tiers(tmp_path / "b"), n_ctx=1024)
    try:
        assert _check(gemma3_path, again, [*doc, 6]) == ("l3", 512)
    finally:
        again.close()
