"""The llama.cpp sequence-state format as numpy views: parse, cut into pages, assemble.

Nothing here imports llama.cpp; the runtime hands blobs in and takes blobs out.
"""

from .format import (
    STATE_FORMAT_VERSION,
    SequenceState,
    parse_layout,
    parse_sections,
    parse_state,
)
from .layout import KVLayout, LayerLayout, type_name
from .pages import (
    PAGE_FORMAT_VERSION,
    Page,
    assemble,
    assemble_into,
    assembled_size,
    check_layout,
    cut_pages,
    page_from_bytes,
    slice_state,
    sort_by_position,
)

__all__ = [
    "PAGE_FORMAT_VERSION",
    "STATE_FORMAT_VERSION",
    "KVLayout",
    "LayerLayout",
    "Page",
    "SequenceState",
    "assemble",
    "assemble_into",
    "assembled_size",
    "check_layout",
    "cut_pages",
    "page_from_bytes",
    "parse_layout",
    "parse_sections",
    "parse_state",
    "slice_state",
    "sort_by_position",
    "type_name",
]
