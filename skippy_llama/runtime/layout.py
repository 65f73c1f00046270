"""The KV layout of a ``SkippyLlama``'s context and the native verdict that depends on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..roster import Verdict
from ..state import KVLayout
from .recipe import native_verdict
from .seam import SCRATCH_SEQ, backend_name

if TYPE_CHECKING:
    from .llama import SkippyLlama


def read_layout(llm: SkippyLlama) -> KVLayout | None:
    """The byte layout of ``llm``'s KV cells: from one cell of the working sequence when it
    holds any, otherwise by decoding one token into it and dropping it again."""
    if llm.seam.live_cells() > 0:
        if int(llm.context_params.n_seq_max) <= SCRATCH_SEQ:
            return None  # no spare sequence to share one cell with
        return llm.seam.layout_from_cell()
    if llm.n_tokens:
        return None  # cleared behind llama-cpp-python's back: probing would hide it
    try:
        llm.decode([llm.token_bos() if llm.token_bos() >= 0 else 0])
        # both sections of a sliding-window model's state: the roster row and identity
        # need its layout even though its states are never paged
        return llm.seam.layout_from_state()
    finally:
        llm.drop_working()


def verdict(llm: SkippyLlama, layout: KVLayout | None) -> Verdict:
    """Whether the loaded llama.cpp carries skippy's patches, certified for this model."""
    return native_verdict(
        str(llm.metadata.get("general.architecture", "unknown")),
        backend_name(),
        layout,
        allow_uncertified=llm.cache_settings.native.allow_uncertified,
    )
