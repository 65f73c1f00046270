"""The loaded llama.cpp library's native recipe, and its verdict against the split-certified roster.

Everything but reading the library (:func:`library_recipe`) is the pure :mod:`skippy_llama.roster`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import llama_cpp

from ..errors import RosterError
from ..roster import (
    LLAMA_CPP_COMMIT,
    LLAMA_CPP_PYTHON_VERSION,
    ROSTER_PATH,
    Recipe,
    RowKey,
    Verdict,
    decide,
    load_roster,
)
from ..state.layout import KVLayout, type_name
from . import native_ext

log = logging.getLogger("skippy_llama")


def row_key(architecture: str, backend: str, layout: KVLayout) -> RowKey:
    """The roster row a model runs under, from its live KV layout (V transposed = flash attention off)."""
    first = layout.layers[0] if layout.layers else None
    return RowKey(
        architecture=architecture,
        backend=backend,
        type_k=type_name(first.k_type) if first else "none",
        type_v=type_name(first.v_type) if first else "none",
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
