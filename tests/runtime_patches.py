"""Patches tests apply to the runtime: through ``monkeypatch.setattr`` in pytest
(``tests/conftest.py``) and through plain ``setattr`` in worker processes
(``tests/integration/l3_worker.py``), so both apply the same ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``monkeypatch.setattr`` or the builtin ``setattr``.
Setter = Callable[[Any, str, Any], None]


def restores_always_pay(set_attr: Setter = setattr) -> None:
    """L1 parks and L1/L2/L3 restores go ahead whatever this machine's measured costs say (on
    the CPU they always pay; on a GPU a short prefix's prefill may beat them)."""
    from skippy_llama.cache import PrefixCache
    from skippy_llama.tiers.resident_costs import ResidentCosts

    set_attr(PrefixCache, "_restore_pays", lambda self, *a, **k: True)
    set_attr(ResidentCosts, "restore_pays", lambda self, saved_tokens: True)
    set_attr(ResidentCosts, "park_pays", lambda self, n_tokens: True)


def gpu_like(set_attr: Setter = setattr) -> None:
    """A GPU build's reuse granule (``n_ubatch``) and record deferral, on any build."""
    from skippy_llama.runtime import llama as runtime

    init = runtime.SkippyLlama.__init__

    def canonical_granule(self: runtime.SkippyLlama) -> int:
        return int(self.context_params.n_ubatch)

    def gpu_like_init(self: runtime.SkippyLlama, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.defer_record_tokens = runtime.DEFER_RECORD_TOKENS

    set_attr(runtime.SkippyLlama, "_canonical_granule", canonical_granule)
    set_attr(runtime.SkippyLlama, "__init__", gpu_like_init)
