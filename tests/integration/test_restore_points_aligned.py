"""Restore points where a batch split changes the numbers (GPU builds, BLAS, flash attention):
on only where the roster certifies them (a ``restore_points`` row of the architecture, backend
and flash-attention setting), kept only on multiples of the context's micro-batch, and every
answer equal to a cold prefill's.

On a CUDA build these run as they are once ``scripts/certify.py --restore-points`` wrote its
rows (until then they skip, and the runtime serves the models as plain ``Llama``). On the CPU
the path is forced (``splits_change_results``), the roster's CPU rows standing in for a GPU's;
the GPU-like lane (``LLCPP_FORCE_UBATCH=64``) runs it with 64-token micro-batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_restore_point_tiers import _check, _tiers
from test_restore_points import _cold, _greedy, _skippy

from skippy_llama import SkippyLlama
from skippy_llama.roster import ROSTER_PATH, PointVerdict
from skippy_llama.runtime import native, recipe
from skippy_llama.runtime import restore_points as runtime_points

pytestmark = pytest.mark.model


@pytest.fixture(autouse=True)
def _splits_matter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime_points, "splits_change_results", lambda flash: True)


def _on_or_skip(llm: SkippyLlama, family: str) -> Any:
    points = llm.restore_points
    if points is None:
        arch = str(llm.metadata.get("general.architecture"))
        verdict = recipe.points_verdict(arch, native.backend_name(), False)
        assert verdict.alignment is None, "certified, yet the aligned load-time check failed"
        pytest.skip(f"{family}: {verdict.reason}")
    return points


def _doc(n: int) -> list[int]:
    rng = np.random.default_rng(11)
    return [int(t) for t in rng.integers(3, 300, size=n)]


@pytest.mark.parametrize("family", ["lfm2", "qwen35"])
def test_points_sit_on_micro_batch_boundaries_and_answer_as_cold(
    family: str, synthetic_models: dict[str, Path], tmp_path: Path
) -> None:
    _aligned_points_answer_as_cold(synthetic_models[family], family, tmp_path)


@pytest.mark.slow
def test_gemma3_points_sit_on_micro_batch_boundaries_and_answer_as_cold(
    gemma3_path: Path, tmp_path: Path
) -> None:
    """The sliding window too: its points on multiples of the roster's step, ``SWA_ALIGN``
    and ``n_ubatch`` (512 at the default micro-batch and at the GPU-like lane's 64)."""
    _aligned_points_answer_as_cold(gemma3_path, "gemma3", tmp_path)


def _aligned_points_answer_as_cold(path: Path, family: str, tmp_path: Path) -> None:
    llm = _skippy(path, _tiers(tmp_path / "l3"), n_ctx=2048)
    try:
        points = _on_or_skip(llm, family)
        n_ubatch = int(llm.context_params.n_ubatch)
        assert points.step > 0 and points.step % n_ubatch == 0
        every = points.every
        assert every % points.step == 0
        doc = _doc(2 * every + 10)
        assert _check(path, llm, doc) == ("cold", 0)
        # the prefill's points on multiples of the step; the prompt's end (not one) is none
        assert sorted(points.store.lengths()) == [every, 2 * every]
        assert _check(path, llm, [*doc, 1, 2]) == ("l1", 2 * every)
        # a prompt one token past a point is served from it: its micro-batches are cold's
        assert _check(path, llm, doc[: every + 1]) == ("l1", every)
        # a prompt ending on a boundary keeps its point
        aligned = [*doc[: 2 * every], *_doc(3 * every)[-points.step :]]
        assert _check(path, llm, aligned) == ("l1", 2 * every)
        assert len(aligned) in points.store.lengths()
        assert _check(path, llm, [*aligned, 5, 6, 7]) == ("l1", len(aligned))
    finally:
        llm.close()
    # a restart: the points from L3
    again = _skippy(path, _tiers(tmp_path / "l3"), n_ctx=2048)
    try:
        assert again.restore_points is not None
        assert _check(path, again, [*doc, 3]) == ("l3", 2 * every)
    finally:
        again.close()


def test_without_a_roster_row_points_stay_off(
    synthetic_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime asks the roster, not a blanket rule: the same model with a roster whose
    ``restore_points`` rows are gone is served as plain ``Llama``."""
    doc = json.loads(ROSTER_PATH.read_text("utf-8"))
    doc.pop("restore_points", None)
    bare = tmp_path / "roster.json"
    bare.write_text(json.dumps(doc), "utf-8")
    real = recipe.points_verdict
    asked: list[PointVerdict] = []

    def verdict(arch: str, backend: str, flash: bool, **_: Any) -> PointVerdict:
        asked.append(real(arch, backend, flash, roster_path=bare))
        return asked[-1]

    monkeypatch.setattr(recipe, "points_verdict", verdict)
    llm = _skippy(synthetic_models["lfm2"], _tiers(tmp_path / "l3"))
    try:
        assert llm.restore_points is None
        assert len(asked) == 1 and asked[0].alignment is None
        prompt = _doc(40)
        assert _greedy(llm, prompt, 3)[0] == _cold(synthetic_models["lfm2"], prompt, 3)[0]
        assert llm.last_cache_event is None  # plain Llama: no cache took part
    finally:
        llm.close()
