"""Opening a ``SkippyLlama``'s cache: its seam, the L1 budget, pageability and the tiers from
settings."""

from __future__ import annotations

import logging
from typing import Any

import llama_cpp

from ..cache import PrefixCache
from ..config import Settings
from ..costs import CostModel
from ..hostmem import BufferPool
from ..identity import CacheIdentity
from ..state import KVLayout
from ..tiers.factory import TierContext, build_tiers
from .seam import KVSeam, backend_name

log = logging.getLogger("skippy_llama")

#: K/V types whose device checkpoints llama.cpp copies whole: F32, F16 and BF16 (ggml type 30,
#: which llama-cpp-python does not name)
_DEVICE_CHECKPOINT_TYPES = frozenset((llama_cpp.GGML_TYPE_F32, llama_cpp.GGML_TYPE_F16, 30))


def open_seam(ctx: Any, type_k: int, type_v: int, *, on_cpu: bool) -> KVSeam:
    """The seam of a context whose live K/V types are ``type_k`` / ``type_v``."""
    # llama.cpp's device checkpoints view a quantized K/V range as size / type_size
    # *elements* (blocks, not elements: 1/32 of a Q8_0 range is copied), so a restore brings
    # back other cells' bytes; quantized caches keep their checkpoints in host memory instead
    on_device = all(t in _DEVICE_CHECKPOINT_TYPES for t in (type_k, type_v))
    # host buffers for the blobs of L2/L3 restores and captures, reused: a fresh one each
    # time spends longer in page faults than the state call takes (0.48 s for 720 MB on
    # the H200 host); a capture stays with the L3 writer until it is cut. GPU builds keep
    # two: a pipelined restore holds two chunks at once (``SkippyLlama.pipeline_restores``)
    return KVSeam(ctx, BufferPool(keep=1 if on_cpu else 2), on_device=on_device)


def l1_budget(
    settings: Settings, n_ctx: int, slots: int, *, on_device: bool, disabled_reason: str | None
) -> int:
    """Tokens L1 may keep resident (0: no L1), logged once; ``disabled_reason``: why the
    cache is off (None: it is on)."""
    if disabled_reason is not None or slots <= 0:
        if disabled_reason is not None:
            log.warning("skippy-llama cache disabled: %s", disabled_reason)
        return 0
    # checkpoints hold their own cells: the default budget of n_ctx tokens keeps the KV
    # memory at most twice what plain Llama takes
    budget = settings.l1.budget_tokens or n_ctx
    log.info(
        "skippy-llama: L1 keeps up to %d resident prefixes, %d tokens in all, in %s "
        "(KV memory at most %.1fx plain Llama's)",
        slots,
        budget,
        "device checkpoints" if on_device else "host memory (quantized K/V)",
        1 + budget / n_ctx,
    )
    return budget


def open_cache(
    settings: Settings,
    identity: CacheIdentity,
    layout: KVLayout | None,
    costs: CostModel,
    *,
    caching: bool,
    slots: int,
    budget: int,
    window: int,
) -> PrefixCache:
    """The cache of a context, with the tiers ``settings`` ask for (fail-open: a tier that
    cannot open is left out); ``layout`` is None where it was not read (no page tier wants
    it), ``slots`` and ``budget`` are L1's (:func:`l1_budget`), ``window`` the model's
    sliding window (0: none)."""
    pageable = caching and layout is not None and layout.pageable and window == 0
    # measured by scripts/certify.py (roster/split-certified.json, gemma3 rows): the state of a
    # sliding-window model has a second section holding only the window's cells, so pages cut
    # from a capture cannot rebuild a shorter prefix
    why = f"SWA model (n_swa={window})" if window else "the KV layout cannot be paged"
    tiers = build_tiers(
        TierContext(
            settings=settings,
            identity=identity,
            backend=backend_name(),
            costs=costs,
            pageable=pageable,
            unpageable_reason=why,
            resident_slots=range(1, slots + 1) if budget else (),
            l1_budget_tokens=budget,
            window=window,
        )
    )
    return PrefixCache(
        identity=identity,
        page_tokens=settings.page_tokens,
        tiers=tiers,
        costs=costs,
        bytes_per_token=layout.bytes_per_token if layout else 0,
        trace_file=settings.l3.trace_file,
    )
