"""Attaching L2's host arena (:mod:`skippy_llama.tiers.arena`) where the per-layer copies serve.

An L2 restore through the arena copies each run of pages straight into the KV tensors with the
patched ``skippy_kv_cells_set`` (patch 0006). That path is taken only where everything agrees:
an L2 tier, a pageable layout, a roster verdict that certifies ``layer_copy_exact`` for this
model and backend, and a cache whose layers (as llama.cpp reports them) are the ones the state
format describes. Anywhere else L2 keeps page bytes and restores by the stock state path.
"""

from __future__ import annotations

import logging
from typing import Any

from ..cache import PrefixCache
from ..hostmem import Pinner
from ..roster import Verdict
from ..state import KVLayout
from ..tiers.arena import HostArena, slot_count
from . import native_ext
from .seam import KVSeam

log = logging.getLogger("skippy_llama")

#: The largest arena that is page-locked (CUDA builds). Registering locks and commits all of it at
#: load (measured on an H100: 53-62 ms per 720 MB, ``skippy_llama/pinned.py``), so an L2 budget
#: far above what L2 holds would take that much RAM from the machine; a larger arena stays
#: pageable (its copies are staged by the driver: slower, the same bytes).
PIN_ARENA_MAX_BYTES = 8 << 30


def layers_match(infos: list[native_ext.KVLayerInfo], layout: KVLayout) -> str | None:
    """Why the cache's layers (``skippy_kv_layers``) differ from ``layout`` (None: they agree)."""
    if len(infos) != layout.n_layer:
        return f"the cache has {len(infos)} layers, the state {layout.n_layer}"
    for il, (info, layer) in enumerate(zip(infos, layout.layers, strict=True)):
        v = (info.v_elem, info.n_embd_v) if layout.v_trans else (info.v_row, 0)
        got = (info.type_k, info.k_row, info.type_v, *v, bool(info.v_trans))
        want = (layer.k_type, layer.k_row, layer.v_type, layer.v_unit, layer.v_embd)
        if got != (*want, layout.v_trans):
            return f"layer {il}: the cache reports {got}, the state {want}"
    return None


def attach_arena(
    ctx: Any,
    seam: KVSeam,
    cache: PrefixCache,
    layout: KVLayout | None,
    verdict: Verdict,
    *,
    pinner: Pinner | None = None,
) -> str | None:
    """Give L2 a host arena and turn the seam's arena restores on; returns why not (None: on)."""
    ram = cache.ram
    if ram is None:
        return "no L2"
    if layout is None or not layout.pageable or layout.ext_bytes:
        return "the KV layout cannot be kept in an arena"
    if not verdict.layer_copy:
        return f"layer_copy_exact is not certified ({verdict.kind})"
    infos = native_ext.kv_layers(ctx)
    if infos is None:
        return "the library or this cache type has no per-layer cell copies"
    differ = layers_match(infos, layout)
    if differ is not None:
        return differ
    n = slot_count(ram.budget_bytes, layout, cache.page_tokens)
    if n <= 0:
        return "the L2 budget is smaller than one page"
    arena = HostArena(layout, cache.page_tokens, n)
    if pinner is not None and arena.nbytes <= PIN_ARENA_MAX_BYTES and pinner.pin(arena.buffer):
        ram.arena_pinned = True
        arena.on_close = lambda: pinner.unpin(arena.buffer)
    ram.attach_arena(arena)
    seam.layer_copies = True
    log.info(
        "skippy-llama: L2 keeps pages in a %s host arena of %d slots (%.1f MiB)",
        "pinned" if ram.arena_pinned else "pageable",
        n,
        arena.nbytes / (1 << 20),
    )
    return None
