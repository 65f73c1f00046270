"""The loaded llama.cpp library's native recipe, and its verdict against the split-certified roster.

Everything but reading the library (:func:`library_recipe`) is the pure :mod:`skippy_llama.roster`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import llama_cpp

from ..errors import RosterError
from ..roster import (
    LLAMA_CPP_COMMIT,
    LLAMA_CPP_PYTHON_VERSION,
    ROSTER_PATH,
    PointVerdict,
    Recipe,
    RowKey,
    Verdict,
    decide,
    decide_points,
    load_roster,
)
from ..state.layout import KVLayout, type_name
from . import native_ext

log = logging.getLogger("skippy_llama")


def row_key(architecture: str, backend: str, layout: KVLayout) -> RowKey:
    """The roster row a model runs under, from its live KV layout (V transposed = flash attention off).

    Every layer counts, a sliding-window model's second section too: layers of differing K or V
    types name the type ``mixed``, which no row certifies.
    """
    layers = (*layout.layers, *layout.swa_layers)

    def one(types: set[int]) -> str:
        if not types:
            return "none"
        return type_name(types.pop()) if len(types) == 1 else "mixed"

    return RowKey(
        architecture=architecture,
        backend=backend,
        type_k=one({layer.k_type for layer in layers}),
        type_v=one({layer.v_type for layer in layers}),
        flash_attn=not layout.v_trans,
    )


def library_recipe() -> Recipe | None:
    """The recipe of the llama.cpp library llama_cpp loaded; None for a stock (unpatched) build."""
    abi = native_ext.abi_version()
    if abi is None:
        return None
    version = str(getattr(llama_cpp, "__version__", "unknown"))
    return Recipe(
        llama_cpp_python=version,
        # the vendored commit is fixed by the sdist version; the library cannot report it
        llama_cpp_commit=LLAMA_CPP_COMMIT if version == LLAMA_CPP_PYTHON_VERSION else "unknown",
        skippy_abi=abi,
        queue_sha256=native_ext.queue_sha256() or "unrecorded",
    )


def native_verdict(
    architecture: str,
    backend: str,
    layout: KVLayout | None,
    *,
    allow_uncertified: bool = False,
    roster_path: Path = ROSTER_PATH,
) -> Verdict:
    """The verdict for a model of ``architecture`` with live KV ``layout`` on ``backend``.

    Fail-open: an unreadable roster or an unknown layout gives a verdict that keeps the stock paths
    (unless ``allow_uncertified``), with the reason, never an error.
    """
    library = library_recipe()
    if layout is None:
        if library is None:
            return Verdict("stock", "the llama.cpp library has no skippy patches")
        if allow_uncertified:
            return Verdict("uncertified_override", "the live KV layout is unknown", recipe=library)
        return Verdict("uncertified", "the live KV layout is unknown", recipe=library)
    key = row_key(architecture, backend, layout)
    try:
        roster = load_roster(roster_path)
    except RosterError as exc:
        log.warning("skippy-llama: %s; the patched calls are treated as uncertified", exc)
        roster = None
    return decide(library, roster, key, allow_uncertified=allow_uncertified)


def points_verdict(
    architecture: str, backend: str, flash_attn: bool, *, roster_path: Path = ROSTER_PATH
) -> PointVerdict:
    """The roster's ``restore_points`` verdict for this library (:func:`decide_points`).

    Fail-open: an unreadable roster certifies nothing, with the reason, never an error."""
    try:
        roster = load_roster(roster_path)
    except RosterError as exc:
        log.warning("skippy-llama: %s; restore points are treated as uncertified", exc)
        roster = None
    return decide_points(library_recipe(), roster, architecture, backend, flash_attn)


def native_status(
    verdict: Verdict | None = None, model: str | None = None, *, roster_path: Path = ROSTER_PATH
) -> dict[str, Any]:
    """What ``kv-cache status`` (and the server's status) report about the native library.

    The loaded library's recipe (None: stock), the roster and whether it certifies that recipe,
    its rows (each row's lanes and the lanes that failed), and, when a model was loaded, the
    model and its verdict (:meth:`Verdict.to_json`). Never raises for a bad roster: its problem
    is reported instead.
    """
    library = library_recipe()
    problem: str | None = None
    try:
        roster = load_roster(roster_path)
    except RosterError as exc:
        roster, problem = None, str(exc)
    if roster is None and problem is None:
        problem = f"no roster at {roster_path}"
    return {
        "library": asdict(library) if library is not None else None,
        "roster": {
            "path": str(roster_path),
            "problem": problem,
            "recipe": asdict(roster.recipe) if roster is not None else None,
            "certifies_library": roster is not None and roster.recipe == library,
            "rows": [
                {
                    **asdict(row.key),
                    "describe": row.key.describe(),
                    "lanes": list(row.lanes),
                    "failed": [lane for lane, _ in row.failed],
                }
                for row in (roster.rows if roster is not None else ())
            ],
        },
        "model": model,
        "verdict": verdict.to_json() if verdict is not None else None,
    }


def format_native_status(report: dict[str, Any]) -> list[str]:
    """Human-readable lines for a :func:`native_status` report."""
    library, roster = report["library"], report["roster"]
    if library is None:
        lines = ["native library: stock llama-cpp-python (no skippy patches): stock state calls"]
    else:
        lines = [f"native library: {Recipe(**library).describe()}"]
        if roster["problem"]:
            lines.append(f"  roster: {roster['problem']}")
        elif not roster["certifies_library"]:
            lines.append(
                f"  roster {roster['path']} certifies another recipe: "
                f"{Recipe(**roster['recipe']).describe()}"
            )
        else:
            lines.append(f"  roster {roster['path']} certifies it ({len(roster['rows'])} rows):")
            lines.extend(
                f"    {row['describe']}: {', '.join(row['lanes'])}"
                + (f" (failed: {', '.join(row['failed'])})" if row["failed"] else "")
                for row in roster["rows"]
            )
    verdict = report["verdict"]
    if verdict is None:
        lines.append("native verdict: give --model PATH or --package DIR for a model's verdict")
    else:
        lines.append(f"native verdict for {report['model']}: {verdict['reason']}")
    return lines
