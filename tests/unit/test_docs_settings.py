"""The docs' settings reference (``scripts/docs_hooks.py``) covers every settings field.

``mkdocs build --strict`` in CI builds it; this checks the same without mkdocs: every leaf field
of :class:`~skippy_llama.config.Settings` has a row, with its env variable and a description.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import BaseModel

from skippy_llama.config import Settings

HOOKS = Path(__file__).resolve().parents[2] / "scripts" / "docs_hooks.py"


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", HOOKS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    names: list[str] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names += _leaves(annotation, f"{prefix}{name}.")
        else:
            names.append(prefix + name)
    return names


def test_every_field_has_a_row_with_env_and_description(hooks: ModuleType) -> None:
    rows = {row["field"].strip("`"): row for row in hooks.settings_rows()}
    assert sorted(rows) == sorted(_leaves(Settings))
    assert rows["l3.mode"]["env"] == "`SKIPPY_L3__MODE`"
    assert rows["l3.mode"]["flag"] == "`--l3-mode`"
    assert rows["l3.minimum_free"]["default"] == "`16GiB`"
    assert all(row["description"] for row in rows.values())


def test_the_marker_becomes_the_table(hooks: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/build/machine/cache")
    page = hooks.on_page_markdown(f"# Settings\n\n{hooks.MARKER}\n")
    assert "/build/machine/cache" not in page and "`~/.cache/skippy-llama/kv`" in page
    assert os.environ["XDG_CACHE_HOME"] == "/build/machine/cache"
    assert hooks.MARKER not in page
    assert "| `l3.policy` |" in page and "`SKIPPY_NATIVE__ALLOW_UNCERTIFIED`" in page
