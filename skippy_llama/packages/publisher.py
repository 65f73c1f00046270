"""Publisher metadata: the Hugging Face files a package keeps under ``metadata/``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..errors import PackageError

CONFIG: Final = "config.json"
GENERATION_CONFIG: Final = "generation_config.json"
#: The publisher files a package carries, in the order they are looked for. ``config.json`` is
#: required whenever publisher metadata is given: without it nothing can be validated.
PUBLISHER_FILES: Final = (
    CONFIG,
    GENERATION_CONFIG,
    "tokenizer_config.json",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class PublisherMetadata:
    """Publisher files of one ``repo_id`` at one commit, parsed.

    Instances handed to :func:`~skippy_llama.packages.kvdtype.resolve_kv_dtype` by the loader
    are *package-validated*: every file matched its recorded sha256 and the geometry that
    ``config.json`` states agreed with the GGUF.
    """

    repo_id: str
    revision: str
    config: Mapping[str, Any]
    generation_config: Mapping[str, Any] | None = None
    files: tuple[str, ...] = ()


def parse_json_object(path: Path, *, label: str | None = None) -> dict[str, Any]:
    """Read a JSON file that must hold an object; :class:`PackageError` names the file if not."""
    name = label or str(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PackageError(f"cannot read {name}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackageError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise PackageError(f"{name} must hold a JSON object, found {type(data).__name__}")
    return data


def find_publisher_files(directory: Path) -> dict[str, Path]:
    """The known publisher files present in ``directory``, by name (``config.json`` first)."""
    return {n: directory / n for n in PUBLISHER_FILES if (directory / n).is_file()}


def read_publisher_metadata(
    directory: Path, *, repo_id: str, revision: str, names: tuple[str, ...] | None = None
) -> PublisherMetadata:
    """Parse the publisher files in ``directory`` (only ``names`` if given).

    Raises :class:`PackageError` when ``config.json`` is missing or any file is not a JSON object.
    """
    present = find_publisher_files(directory)
    if names is not None:
        present = {n: p for n, p in present.items() if n in names}
    if CONFIG not in present:
        raise PackageError(f"{directory} has no {CONFIG}; publisher metadata needs it")
    parsed = {n: parse_json_object(p, label=f"{directory.name}/{n}") for n, p in present.items()}
    return PublisherMetadata(
        repo_id=repo_id,
        revision=revision,
        config=parsed[CONFIG],
        generation_config=parsed.get(GENERATION_CONFIG),
        files=tuple(present),
    )
