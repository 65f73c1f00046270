"""The status page: one HTML document with its stylesheet and script inlined.

The assets ship in the package (``static/``) and nothing is fetched from elsewhere: the
machines this runs on are often offline.
"""

from __future__ import annotations

import functools
from importlib import resources


@functools.cache
def index_html() -> str:
    """The page, with ``status.css`` and ``status.js`` inlined."""
    static = resources.files("skippy_llama.server") / "static"
    page = (static / "index.html").read_text(encoding="utf-8")
    css = (static / "status.css").read_text(encoding="utf-8")
    js = (static / "status.js").read_text(encoding="utf-8")
    return page.replace("/*STYLE*/", css).replace("/*SCRIPT*/", js)
