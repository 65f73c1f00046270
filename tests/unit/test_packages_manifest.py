"""model-package.json: revision/repo/path rules and manifest reading errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from skippy_llama.errors import PackageError
from skippy_llama.packages.geometry import Geometry
from skippy_llama.packages.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    Validation,
    check_relative_path,
    check_repo_id,
    check_revision,
    read_manifest,
    write_manifest,
)

SHA = "a" * 40
DIGEST = "b" * 64


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("0123456789abcdef0123456789abcdef01234567", "0123456789abcdef0123456789abcdef01234567"),
        ("0123456789ABCDEF0123456789ABCDEF01234567", "0123456789abcdef0123456789abcdef01234567"),
        (" " + SHA + "\n", SHA),
    ],
)
def test_full_commits_are_accepted(given: str, kept: str) -> None:
    assert check_revision(given) == kept


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("main", "branch or tag"),
        ("v1.0", "branch or tag"),
        ("refs/pr/1", "branch or tag"),
        ("0123abc", "abbreviated commit"),
        ("0123456789abcdef0123456789abcdef0123456", "abbreviated commit"),
        ("g" * 40, "branch or tag"),
        ("a" * 41, "branch or tag"),
    ],
)
def test_moving_or_short_revisions_are_rejected(given: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as err:
        check_revision(given)
    assert "40-hex" in str(err.value)
    assert repr(given) in str(err.value)


@pytest.mark.parametrize("good", ["HuggingFaceTB/SmolLM2-135M-Instruct", "a/b", "org_1/name.v2"])
def test_repo_ids_accepted(good: str) -> None:
    assert check_repo_id(good) == good


@pytest.mark.parametrize(
    "bad", ["SmolLM2", "a/b/c", "/name", "org/", "org/-x", "org/a..b", "o/a--b"]
)
def test_repo_ids_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="ORG/NAME"):
        check_repo_id(bad)


@pytest.mark.parametrize(
    "bad",
    ["../x.gguf", "/etc/passwd", "a//b", "a\\b", "./a", "metadata/../../x", MANIFEST_NAME, ""],
)
def test_paths_must_stay_inside_the_package(bad: str) -> None:
    with pytest.raises(ValueError, match="relative path"):
        check_relative_path(bad)


def manifest_dict(**over: Any) -> dict[str, Any]:
    m = Manifest(
        repo_id="org/name",
        revision=SHA,
        gguf=["m.gguf"],
        files=[
            FileEntry(path="m.gguf", kind="gguf", size=10, sha256=DIGEST),
            FileEntry(path="metadata/config.json", kind="metadata", size=2, sha256=DIGEST),
        ],
        geometry=Geometry(architecture="llama", layers=2),
        validation=Validation(publisher_metadata="validated", reasons=["ok"]),
    )
    d: dict[str, Any] = json.loads(m.model_dump_json())
    d.update(over)
    return d


def write_raw(tmp_path: Path, data: object) -> Path:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    return tmp_path


def test_round_trip(tmp_path: Path) -> None:
    m = Manifest.model_validate(manifest_dict())
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path) == m
    assert m.metadata_names() == ("config.json",)
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed away


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="not a directory"):
        read_manifest(tmp_path / "nope")


def test_missing_manifest_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="package create"):
        read_manifest(tmp_path)


def test_bad_json(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(PackageError, match="not readable JSON"):
        read_manifest(tmp_path)


def test_future_schema_version(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="schema_version 2"):
        read_manifest(write_raw(tmp_path, manifest_dict(schema_version=2)))


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"revision": "main"}, "revision: revision 'main' is a branch"),
        ({"repo_id": "nope"}, "repo_id"),
        ({"surprise": 1}, "surprise"),
        ({"gguf": ["other.gguf"]}, "other.gguf"),
        ({"gguf": []}, "at least one"),
    ],
)
def test_invalid_manifest_names_the_field(
    tmp_path: Path, over: dict[str, Any], needle: str
) -> None:
    with pytest.raises(PackageError, match="is invalid") as err:
        read_manifest(write_raw(tmp_path, manifest_dict(**over)))
    assert needle in str(err.value)


def test_file_entry_rules(tmp_path: Path) -> None:
    d = manifest_dict()
    d["files"][1]["path"] = "config.json"  # metadata outside metadata/
    with pytest.raises(PackageError, match="must live under metadata/"):
        read_manifest(write_raw(tmp_path, d))
    d = manifest_dict()
    d["files"][0]["sha256"] = "XYZ"
    with pytest.raises(PackageError, match="64 lowercase hex"):
        read_manifest(write_raw(tmp_path, d))
    d = manifest_dict()
    d["files"].append(d["files"][0])
    with pytest.raises(PackageError, match="more than once"):
        read_manifest(write_raw(tmp_path, d))
    d = manifest_dict()
    d["files"][0]["path"] = "../../escape.gguf"
    d["gguf"] = ["../../escape.gguf"]
    with pytest.raises(PackageError, match="relative path"):
        read_manifest(write_raw(tmp_path, d))
