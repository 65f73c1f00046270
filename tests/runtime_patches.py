"""Patches tests apply to the runtime: through ``monkeypatch.setattr`` in pytest
(``tests/conftest.py``) and through plain ``setattr`` in worker processes
(``tests/integration/l3_worker.py``), so both apply the same ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``monkeypatch.setattr`` or the builtin ``setattr``.
Setter = Callable[[Any, str, Any], None]


def gpu_like(set_attr: Setter = setattr) -> None:
    """A GPU build's reuse granule (``n_ubatch``), records (exported into arena slots off the
    request path where patch 0006 is certified, else waiting), chunked restores,
    roster-certified restore points on micro-batch boundaries and page paths (L3 pages staged
    into a host arena before their per-layer copies, as where the KV cache is on a device:
    :func:`staged_page_copies`), on any build."""
    from skippy_llama.runtime import llama as runtime
    from skippy_llama.runtime import probes, restore_points
    from skippy_llama.runtime.recording import default_defer_tokens
    from skippy_llama.runtime.working import WorkingSequence

    init = runtime.SkippyLlama.__init__
    staged_page_copies(set_attr)

    def canonical_granule(seq: WorkingSequence) -> tuple[int, str | None]:
        return int(seq.llm.context_params.n_ubatch), None

    def gpu_like_init(self: runtime.SkippyLlama, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        exporter = self.seam.exporter
        if exporter is not None:
            exporter.background = True  # the CUDA path: the export on the exporter's thread
        self.defer_record_tokens = default_defer_tokens(on_cpu=False, exports=bool(exporter))
        self.pipeline_restores = True

    set_attr(probes, "canonical_granule", canonical_granule)
    # restore points as on a GPU: only where the roster certifies them, on micro-batch
    # boundaries, after the aligned load-time check
    set_attr(restore_points, "splits_change_results", lambda flash: True)
    set_attr(runtime.SkippyLlama, "__init__", gpu_like_init)


def staged_page_copies(set_attr: Setter = setattr) -> None:
    """Every ``SkippyLlama`` sets up its page paths as where its KV cache is on a device
    (``arena_setup.open_page_paths(on_device=True)``): pages read from L3 go through the
    seam's staging arenas (pageable here: no device to pin them for) into the KV tensors."""
    from skippy_llama.runtime import arena_setup
    from skippy_llama.runtime import llama as runtime

    real = arena_setup.open_page_paths

    def on_device(*args: Any, **kwargs: Any) -> arena_setup.PagePaths:
        kwargs["on_device"] = True
        return real(*args, **kwargs)

    set_attr(runtime, "open_page_paths", on_device)
