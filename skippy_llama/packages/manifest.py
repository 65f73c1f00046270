"""``model-package.json``: the schema binding a package's files to one repository commit."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import PackageError
from .geometry import Geometry

SCHEMA_VERSION: Final = 1
MANIFEST_NAME: Final = "model-package.json"
METADATA_DIR: Final = "metadata"

_REVISION_RE: Final = re.compile(r"[0-9a-f]{40}")
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
# Hugging Face repo ids: "org/name", letters, digits, '-', '_', '.', at most 96 chars a part.
_REPO_PART_RE: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")

Verdict = Literal["validated", "rejected", "absent"]


def check_revision(value: str) -> str:
    """Return ``value`` if it is a full 40-hex commit id, else raise ``ValueError`` saying why.

    Branches and tags move, so a package pinned to one would not say which files it was built
    from; only a commit id is immutable.
    """
    text = value.strip()
    if _REVISION_RE.fullmatch(text):
        return text
    if re.fullmatch(r"[0-9a-fA-F]{40}", text):
        return text.lower()
    if re.fullmatch(r"[0-9a-fA-F]{7,39}", text):
        why = "an abbreviated commit id"
    else:
        why = "a branch or tag name, which can move"
    raise ValueError(
        f"revision {value!r} is {why}, not an immutable commit: pass the full 40-hex commit id "
        "(the hub cache keeps it in models--ORG--NAME/refs/main; the repository's "
        "'Files and versions' history shows it too)"
    )


def check_repo_id(value: str) -> str:
    """Return ``value`` if it looks like a Hugging Face ``org/name`` repo id, else raise."""
    parts = value.split("/")
    if (
        len(parts) != 2
        or not all(_REPO_PART_RE.fullmatch(p) for p in parts)
        or any(".." in p or "--" in p for p in parts)
    ):
        raise ValueError(
            f"repo id {value!r} is not of the form ORG/NAME (e.g. 'HuggingFaceTB/SmolLM2-135M')"
        )
    return value


def check_relative_path(value: str) -> str:
    """A manifest path must stay inside the package: relative, POSIX, no ``..``."""
    p = PurePosixPath(value)
    if (
        not value
        or "\\" in value
        or p.is_absolute()
        or any(part in ("..", ".", "") for part in value.split("/"))
        or value == MANIFEST_NAME
    ):
        raise ValueError(f"file path {value!r} must be a plain relative path inside the package")
    return value


class FileEntry(BaseModel):
    """One file of the package, relative to its root, with its size and sha256."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    kind: Literal["gguf", "metadata"]
    size: int = Field(ge=0)
    sha256: str

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return check_relative_path(v)

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        if not _SHA256_RE.fullmatch(v):
            raise ValueError(f"sha256 {v!r} is not 64 lowercase hex digits")
        return v


class Validation(BaseModel):
    """Whether the publisher metadata agreed with the GGUF when the package was made."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    publisher_metadata: Verdict
    reasons: list[str] = []
    compared_fields: list[str] = []


class Manifest(BaseModel):
    """The content of ``model-package.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    repo_id: str
    revision: str
    created_by: str = "skippy-llama"
    #: GGUF files, the one to load first (later entries are the other shards of a split model).
    gguf: list[str]
    files: list[FileEntry]
    geometry: Geometry
    validation: Validation

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str) -> str:
        return check_revision(v)

    @field_validator("repo_id")
    @classmethod
    def _repo(cls, v: str) -> str:
        return check_repo_id(v)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ValueError("files lists a path more than once")
        if not self.gguf:
            raise ValueError("gguf must name at least one GGUF file")
        kinds = {f.path: f.kind for f in self.files}
        for g in self.gguf:
            if kinds.get(g) != "gguf":
                raise ValueError(f"gguf entry {g!r} is not listed in files as kind 'gguf'")
        for f in self.files:
            if f.kind == "metadata" and not f.path.startswith(METADATA_DIR + "/"):
                raise ValueError(f"metadata file {f.path!r} must live under {METADATA_DIR}/")
        return self

    def metadata_names(self) -> tuple[str, ...]:
        """Names (inside ``metadata/``) of the publisher files the package carries."""
        prefix = METADATA_DIR + "/"
        return tuple(f.path[len(prefix) :] for f in self.files if f.kind == "metadata")


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def read_manifest(root: Path) -> Manifest:
    """Load and validate ``root/model-package.json``; :class:`PackageError` says what is wrong."""
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise PackageError(f"{root} is not a directory; pass a model package folder")
    if not path.is_file():
        raise PackageError(
            f"{root} has no {MANIFEST_NAME}, so it is not a model package; "
            "make one with `skippy-llama package create`"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackageError(f"{path} is not readable JSON: {exc}") from exc
    if isinstance(raw, dict) and raw.get("schema_version") not in (None, SCHEMA_VERSION):
        raise PackageError(
            f"{path} has schema_version {raw.get('schema_version')!r}; this skippy-llama reads "
            f"version {SCHEMA_VERSION}: upgrade skippy-llama or re-create the package"
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise PackageError(f"{path} is invalid: {_validation_message(exc)}") from exc


def write_manifest(root: Path, manifest: Manifest) -> Path:
    """Write ``root/model-package.json`` atomically (temp file + rename)."""
    path = root / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
    tmp.write_text(manifest.model_dump_json(indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
