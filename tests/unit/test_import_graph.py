"""The package's import graph: no loops, and ``SkippyLlama`` imported only from above.

Every ``import`` statement counts, also those under ``TYPE_CHECKING`` and inside functions: a
loop drawn only for the type checker is still two modules that cannot be read apart (issue 44:
eight runtime modules took the whole ``SkippyLlama`` and it imported them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import skippy_llama

PACKAGE = Path(skippy_llama.__file__).resolve().parent

#: Modules that may import ``runtime/llama.py``: the package's lazy entry point and the user
#: surfaces built on ``SkippyLlama``.
SURFACES = (
    "skippy_llama.cli.",
    "skippy_llama.server.",
    "skippy_llama.batch.",
    "skippy_llama.matrix.",
)
ENTRY_POINTS = {"skippy_llama", "skippy_llama.runtime"}


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package by dotted name: its file and whether it is a package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module's imports of the package's own modules (``from X import Y`` names module
    ``X.Y`` where that is a module, else ``X``)."""
    mods = modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, (path, is_package) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names if alias.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join([*here, base] if base else here)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in mods:
                        graph[name].add(sub)
                    elif base in mods:
                        graph[name].add(base)
    return graph


def loops(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan), and modules that
    import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_imports_it_must() -> None:
    """The graph is built from real edges: the runtime's known imports are in it (a parser
    that found nothing would find no loop either)."""
    graph = import_graph()
    assert "skippy_llama.runtime.working" in graph["skippy_llama.runtime.restore"]
    assert "skippy_llama.runtime.seam" in graph["skippy_llama.runtime.working"]
    assert "skippy_llama.plan" in graph["skippy_llama.cache"]
    # a TYPE_CHECKING import counts
    assert "skippy_llama.runtime.llama" in graph["skippy_llama"]


def test_loops_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}
    assert loops(graph) == {frozenset("abc"), frozenset("d")}


def test_the_package_has_no_import_loop() -> None:
    assert loops(import_graph()) == set()


def test_only_the_surfaces_import_skippy_llama() -> None:
    """The runtime modules take a ``WorkingSequence`` and the cache, never ``SkippyLlama``."""
    importers = {
        name for name, imports in import_graph().items() if "skippy_llama.runtime.llama" in imports
    }
    below = {
        name for name in importers if name not in ENTRY_POINTS and not name.startswith(SURFACES)
    }
    assert below == set()
