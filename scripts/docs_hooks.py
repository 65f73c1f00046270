"""mkdocs hooks (``mkdocs.yml``: ``hooks``): pages generated from the code at build time.

``<!-- settings-table -->`` in a page becomes the table of every field of
:class:`skippy_llama.config.Settings`: its dotted name, type, default, environment variable, CLI
flag and description, read from the pydantic model itself, so the reference cannot drift from
the code. A field without a description fails the build (``mkdocs build --strict`` in CI).
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

from annotated_types import Ge, Le
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from skippy_llama.cli.options import _FLAG_FIELDS
from skippy_llama.config import Settings
from skippy_llama.sizes import format_size, parse_size

MARKER = "<!-- settings-table -->"


def _is_size(info: FieldInfo) -> bool:
    return any(getattr(m, "func", None) is parse_size for m in info.metadata)


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _type_name(annotation: Any, info: FieldInfo) -> str:
    if _is_size(info):
        return "size (IEC: `512MiB`, `32GiB`)"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        if any(getattr(m, "func", None) is parse_size for m in args[1:]):
            return "size (IEC: `512MiB`, `32GiB`)"
        return _type_name(args[0], info)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        names = [_type_name(a, info) for a in args if a is not type(None)]
        return " \\| ".join(names) + (" or unset" if type(None) in args else "")
    if annotation is Path:
        return "absolute path"
    name = getattr(annotation, "__name__", str(annotation))
    bounds = [f"≥ {m.ge}" for m in info.metadata if isinstance(m, Ge)]
    bounds += [f"≤ {m.le}" for m in info.metadata if isinstance(m, Le)]
    return name + (f" ({', '.join(bounds)})" if bounds else "")


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value: Any = info.default_factory()  # type: ignore[call-arg]
        if isinstance(value, Path):
            home = str(Path.home())
            text = str(value)
            return f"`{'~' + text[len(home) :] if text.startswith(home) else text}`"
        return f"`{value!r}`"
    if info.default is PydanticUndefined or info.default is None:
        return "unset"
    if _is_size(info):
        return f"`{format_size(info.default)}`"
    if isinstance(info.default, bool):
        return f"`{str(info.default).lower()}`"
    if isinstance(info.default, str):
        return f'`"{info.default}"`' if info.default else '`""`'
    return f"`{info.default}`"


def settings_rows(
    model: type[BaseModel] = Settings, path: tuple[str, ...] = ()
) -> list[dict[str, str]]:
    """One row per leaf field of ``model``, nested models flattened to dotted names."""
    flags = {fields: "--" + dest.replace("_", "-") for dest, fields in _FLAG_FIELDS}
    rows: list[dict[str, str]] = []
    for name, info in model.model_fields.items():
        here = (*path, name)
        sub = _submodel(info.annotation)
        if sub is not None:
            rows.extend(settings_rows(sub, here))
            continue
        dotted = ".".join(here)
        if not info.description:
            raise ValueError(
                f"settings field {dotted} has no description: give it Field(description=...) "
                "in skippy_llama/config.py (the docs' settings reference is generated from it)"
            )
        rows.append(
            {
                "field": f"`{dotted}`",
                "type": _type_name(info.annotation, info),
                "default": _default(info),
                "env": f"`SKIPPY_{'__'.join(here).upper()}`",
                "flag": f"`{flags[here]}`" if here in flags else "",
                "description": info.description.replace("|", "\\|").replace("\n", " "),
            }
        )
    return rows


def settings_table() -> str:
    """The Markdown table of every settings field."""
    head = "| field | type | default | environment | flag | meaning |\n|---|---|---|---|---|---|\n"
    body = "".join(
        f"| {r['field']} | {r['type']} | {r['default']} | {r['env']} | {r['flag']} "
        f"| {r['description']} |\n"
        for r in settings_rows()
    )
    return head + body


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs event: expand the settings marker."""
    if MARKER in markdown:
        # the table shows defaults as a user sees them, not this build machine's cache directory
        saved = os.environ.pop("XDG_CACHE_HOME", None)
        try:
            markdown = markdown.replace(MARKER, settings_table())
        finally:
            if saved is not None:
                os.environ["XDG_CACHE_HOME"] = saved
    return markdown
