"""Restore points of a sliding-window model (Gemma 3 270M) in L1 and L3: the full-attention
layers' cells as pages shared by every point, plus the window's last cells of the SWA layers as
the point's own part. Kept only where a restore is exact (multiples of ``SWA_ALIGN`` tokens,
or inside the first window); every continuation equals a cold prefill, in a new
``SkippyLlama`` (a restart) too."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
from test_restore_point_tiers import _check, _tiers
from test_restore_points import _greedy, _skippy, points_or_skip

from skippy_llama.restore_points import is_composed
from skippy_llama.runtime.restore_points import SWA_ALIGN
from skippy_llama.tiers.l3.schema import POINT, POINT_PAGE
from skippy_llama.tiers.l3.tier import DiskTier

pytestmark = [pytest.mark.model, pytest.mark.slow]


def _doc(n: int) -> list[int]:
    rng = np.random.default_rng(3)
    return [int(t) for t in rng.integers(3, 200_000, size=n)]


def test_gemma3_points_in_l3_survive_a_restart(
    gemma3_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[int] = []
    plain_eval = llama_cpp.Llama.eval

    def counting_eval(self: llama_cpp.Llama, tokens: Sequence[int]) -> Any:
        decoded.append(len(tokens))
        return plain_eval(self, tokens)

    # a spy on what is decoded: the cached answer must also be cheaper, not only equal
    monkeypatch.setattr(llama_cpp.Llama, "eval", counting_eval)
    doc = _doc(600)
    llm = _skippy(gemma3_path, _tiers(tmp_path / "l3"), n_ctx=1024)
    try:
        points_or_skip(llm, "gemma3", swa=True)
        assert llm.restore_points is not None and llm.restore_points.window == 512
        assert _check(gemma3_path, llm, [*doc, 1, 2, 3]) == ("cold", 0)
        # points only on multiples of SWA_ALIGN and n_ubatch (512 by default; 64 in the
        # GPU-like lane): the prompt's end (603) is none, the deepest is the prefill's at 512
        align = math.lcm(SWA_ALIGN, int(llm.context_params.n_ubatch))
        assert llm.restore_points.align == align
        assert sorted(llm.restore_points.store.lengths()) == list(range(align, 513, align))
        assert _check(gemma3_path, llm, [*doc, 4, 5]) == ("l1", 512)
        disk = llm.restore_points.tiers[-1]
        assert isinstance(disk, DiskTier)
        store = disk._parts.rw
        # composed: the full-attention cells as 128-token pages shared by both points, the
        # sliding-window layers' cells as each point's own part
        assert all(is_composed((store.get(k) or b"")[16:]) for k in store.keys(POINT))
        assert store.count(POINT_PAGE) == 4
    finally:
        llm.close()
    again = _skippy(gemma3_path, _tiers(tmp_path / "l3"), n_ctx=1024)
    try:
        decoded.clear()
        _greedy(again, [*doc, 6], 1)
        # only the 89 tokens after the point: the paged L1 beside the points once decoded
        # the whole prompt again here (regression, issue 46)
        event, points = again.last_cache_event, again.restore_points
        assert event is not None and points is not None
        assert (event.tier, decoded) == ("l3", [601 - 512])
        points.store.clear()
        assert _check(gemma3_path, again, [*doc, 6]) == ("l3", 512)
        # at 256 only where 256 is a multiple of n_ubatch
        assert _check(gemma3_path, again, doc[:300]) == (
            ("l3", 256) if align == 256 else ("cold", 0)
        )
        # another prompt sharing the first 512 tokens continues there too
        assert _check(gemma3_path, again, [*doc[:512], 9, 8, 7]) == ("l1", 512)
    finally:
        again.close()


def test_gemma3_without_l3_keeps_the_paged_l1(gemma3_path: Path) -> None:
    llm = _skippy(gemma3_path, n_ctx=1024)
    try:
        assert llm.restore_points is None
    finally:
        llm.close()
