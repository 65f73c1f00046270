"""The record path and park rule as they were before issue 45 item 4, for same-run baselines.

``skippy_l3_before`` in ``bench_overhead.py`` and ``bench_gpu.py``: SkippyLlama with L3 on whose
records are captured through the state format (left waiting on GPU builds, as shipped before)
instead of exported into arena slots off the request path, and whose parks follow the rule
before it (the reuse chance and L3's copy of the live sequence ignored). Run beside
``skippy_l3`` in the same session, it measures the change under the same load.
"""

from __future__ import annotations

from typing import Any

from skippy_llama.costs import CostModel
from skippy_llama.runtime import native
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.runtime.recording import default_defer_tokens

#: the mode's name in both benchmarks
BEFORE_MODE = "skippy_l3_before"


class ParksAsBefore(CostModel):
    """The park rule before issue 45 item 4: park when prefilling the destroyed tokens costs
    more than a park and a checkpoint restore, whether or not prefixes return or L3 holds them."""

    def park_pays(self, n_tokens: int, *, unmeasured_min: int = 0, **_: Any) -> bool:
        return super().park_pays(n_tokens, unmeasured_min=unmeasured_min)


def capture_as_before(llm: SkippyLlama) -> SkippyLlama:
    """Detach ``llm``'s record exporter: records are captured through the state format, and
    wait on GPU builds, as before (build ``llm`` with ``cost_model=ParksAsBefore()``)."""
    exporter = llm.seam.exporter
    if exporter is not None:
        llm.seam.exporter = None
        exporter.close()
        exporter.arena.close()
    on_cpu = native.backend_name() == "CPU"
    llm.defer_record_tokens = default_defer_tokens(on_cpu=on_cpu, exports=False)
    return llm
