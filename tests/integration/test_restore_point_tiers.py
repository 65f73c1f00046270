"""Restore points of recurrent and hybrid models in L2 and L3: a prompt that extends an earlier
prompt is served from the deepest restore point in any tier (L3 across a restart, in a new
process too), and answers exactly as a cold run; a damaged record is a miss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_restore_points import _FAMILIES, PATCHED, _cold, _greedy, _skippy, points_or_skip

from skippy_llama.config import Settings
from skippy_llama.restore_points import is_composed
from skippy_llama.tiers.l3.schema import POINT, POINT_PAGE
from skippy_llama.tiers.l3.tier import DiskTier

pytestmark = pytest.mark.model


def _tiers(directory: Path, *, l2: bool = False) -> Settings:
    extra: dict[str, Any] = {"l2": {"budget": "64MiB"}} if l2 else {}
    return Settings(
        l3={
            "mode": "fixed",
            "budget": "1GiB",
            "directory": str(directory),
            "minimum_free": "1GiB",
        },
        **extra,
    )


def _doc(n: int = 90) -> list[int]:
    rng = np.random.default_rng(2)
    return [int(t) for t in rng.integers(3, 300, size=n)]


def _check(path: Path, llm: Any, prompt: list[int]) -> tuple[str, int]:
    """Serve ``prompt``; assert tokens and first logits equal cold; (tier, cached tokens)."""
    tokens, logits = _greedy(llm, prompt, 5)
    cold_tokens, cold_logits = _cold(path, prompt, 5, n_ctx=llm.n_ctx())
    assert tokens == cold_tokens
    assert np.array_equal(logits, cold_logits)
    event = llm.last_cache_event
    assert event is not None
    return str(event.tier), int(event.cached_tokens)


def _recorded(path: Path, store: Path, family: str = "lfm2") -> list[int]:
    """A document served once (cold, exactly) by a SkippyLlama that keeps its restore points
    in an L3 in ``store``, then closed, so that only the disk holds them; the document."""
    doc = _doc()
    llm = _skippy(path, _tiers(store))
    try:
        points_or_skip(llm, family)
        assert _check(path, llm, doc) == ("cold", 0)
    finally:
        llm.close()
    return doc


@pytest.mark.parametrize("family", _FAMILIES)
def test_l3_restore_points_survive_a_restart(
    family: str, synthetic_models: dict[str, Path], tmp_path: Path
) -> None:
    path = synthetic_models[family]
    doc = _doc()
    first = _skippy(path, _tiers(tmp_path / "l3"))
    try:
        points_or_skip(first, family)  # the stock build's check may refuse a family
        assert _check(path, first, doc) == ("cold", 0)
        assert _check(path, first, [*doc, 7, 8]) == ("l1", 90)
    finally:
        first.close()
    # a new SkippyLlama: nothing in memory, the points only on disk; suffixes of two tokens,
    # which every build restores (test_a_one_token_suffix_... covers single tokens)
    again = _skippy(path, _tiers(tmp_path / "l3"))
    try:
        assert again.restore_points is not None
        # the deepest point the prompt extends (92 tokens), from L3, then L1 for the next
        assert _check(path, again, [*doc, 7, 8, 9, 10]) == ("l3", 92)
        assert _check(path, again, [*doc, 7, 8, 9, 10, 11, 12]) == ("l1", 94)
        assert _check(path, again, [*doc, 5, 6]) == ("l3", 90)  # not promoted before
        status = again.prefix_cache.disk
        assert status is None  # the page tiers stay off for this model
        tier = again.restore_points.tiers[-1]
        assert isinstance(tier, DiskTier)
        listed = tier.status().restore_points
        assert len(listed) == 1 and listed[0].points == 5
        assert sorted(n for n, _ in listed[0].sizes) == [90, 92, 92, 94, 96]
    finally:
        again.close()


def test_l2_serves_after_l1_drops_its_points(
    synthetic_models: dict[str, Path], tmp_path: Path
) -> None:
    path = synthetic_models["lfm2"]
    doc = _doc()
    llm = _skippy(path, _tiers(tmp_path / "l3", l2=True))
    try:
        points_or_skip(llm, "lfm2")
        points = llm.restore_points
        assert points is not None and [t.name for t in points.tiers] == ["l2", "l3"]
        _check(path, llm, doc)
        points.store.clear()  # L1 only: L2 still mirrors what L3 holds
        assert _check(path, llm, [*doc, 3, 4]) == ("l2", 90)
        points.store.clear()
        points.tiers[0].clear()  # type: ignore[attr-defined]
        assert _check(path, llm, [*doc, 4, 5]) == ("l3", 90)
        assert _check(path, llm, [*doc, 4, 5, 6, 7]) == ("l1", 92)
        memory = llm.cache_status()["restore_points"]
        assert memory["l1"]["points"] == 3 and memory["l2"]["bytes"] > 0
    finally:
        llm.close()


def test_a_damaged_l3_record_is_a_cold_miss(
    synthetic_models: dict[str, Path], tmp_path: Path
) -> None:
    path = synthetic_models["lfm2"]
    doc = _recorded(path, tmp_path / "l3")
    llm = _skippy(path, _tiers(tmp_path / "l3"))
    try:
        assert llm.restore_points is not None
        disk = llm.restore_points.tiers[-1]
        assert isinstance(disk, DiskTier)
        store = disk._parts.rw
        (key,) = store.keys(POINT)
        raw = bytearray(store.get(key) or b"")
        raw[len(raw) // 2] ^= 0x10
        store.set(key, bytes(raw))
        assert _check(path, llm, [*doc, 1, 2]) == ("cold", 0)
        assert disk._parts.counters.get("corrupt_points") == 1
    finally:
        llm.close()


_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_restore_point_tiers import _tiers, _greedy
from test_restore_points import _skippy
from pathlib import Path
llm = _skippy(Path({model!r}), _tiers(Path({l3!r})))
tokens, logits = _greedy(llm, {prompt!r}, 5)
event = llm.last_cache_event
print(json.dumps({{"tokens": tokens, "logits": logits.tolist(), "tier": event.tier,
                  "cached": event.cached_tokens}}))
llm.close()
"""


@pytest.mark.slow
def test_a_new_process_restores_from_l3(synthetic_models: dict[str, Path], tmp_path: Path) -> None:
    path = synthetic_models["lfm2"]
    doc = _recorded(path, tmp_path / "l3")
    prompt = [*doc, 11, 12, 13]
    code = _CHILD.format(
        tests=str(Path(__file__).parent), model=str(path), l3=str(tmp_path / "l3"), prompt=prompt
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    cold_tokens, cold_logits = _cold(path, prompt, 5)
    assert (got["tier"], got["cached"]) == ("l3", 90)
    assert got["tokens"] == cold_tokens
    assert np.array_equal(np.asarray(got["logits"], dtype=np.float32), cold_logits)


@pytest.mark.parametrize("family", ["qwen35", "mamba2"])
def test_a_long_prompt_keeps_points_every_256_tokens(
    family: str, synthetic_models: dict[str, Path], tmp_path: Path
) -> None:
    """The next question on a shared document does not extend the last prompt: it continues
    from the deepest point of the document's prefill instead (in L3 after a restart too)."""
    path = synthetic_models[family]
    doc = _doc(600)
    llm = _skippy(path, _tiers(tmp_path / "l3"), n_ctx=1024)
    try:
        points_or_skip(llm, family)
        assert llm.restore_points is not None
        assert _check(path, llm, [*doc, 1, 2, 3]) == ("cold", 0)
        assert _check(path, llm, [*doc, 4, 5]) == ("l1", 512)
        # L3 keeps the points composed: attention pages shared through the page chain (the
        # points at 256, 512, 603 and 602 tokens run through the same first pages) + each
        # point's recurrent state; a purely recurrent model has no pages
        disk = llm.restore_points.tiers[-1]
        assert isinstance(disk, DiskTier)
        store = disk._parts.rw
        assert all(is_composed((store.get(k) or b"")[16:]) for k in store.keys(POINT))
        shared = disk._parts.counters.get("point_pages_shared")
        if family == "mamba2":
            assert store.count(POINT_PAGE) == 0 and shared == 0
        else:
            # pages [0, 512) once, and the two prompt ends' own partial last pages
            assert store.count(POINT_PAGE) == 4 + 2 and shared == 2 + 4 + 4
        status = disk.status()
        (entry,) = status.restore_points
        assert entry.points == 4 and entry.bytes == status.usage.restore_point_bytes
    finally:
        llm.close()
    again = _skippy(path, _tiers(tmp_path / "l3"), n_ctx=1024)
    try:
        assert _check(path, again, [*doc, 6]) == ("l3", 512)
        assert _check(path, again, doc[:300]) == ("l3", 256)
    finally:
        again.close()


def test_a_one_token_suffix_is_decoded_as_the_cold_prefill_decodes_it(
    synthetic_models: dict[str, Path], tmp_path: Path
) -> None:
    """Stock ggml-cpu decodes a micro-batch of one token with other kernels (``vec_dot``) than
    a batch (sgemm): plain ``Llama`` decoding a 91st token alone after a 90-token batch gave
    logits 8e-4 off the 91 tokens in one batch (synthetic LFM2). So where lone decodes are
    inexact a restore point is used only where the rest of the prompt avoids a one-token
    micro-batch, and a prompt whose cold prefill decodes one (its last ``n_batch`` batch a
    single token) is served as plain ``Llama`` serves it, keeping no point. The patched build
    (patch 0004) decodes lone tokens as batches do: one token after a point is restored."""
    path = synthetic_models["lfm2"]
    doc = _doc()
    llm = _skippy(path, _tiers(tmp_path / "l3"), n_ctx=1024)
    try:
        points_or_skip(llm, "lfm2")
        points = llm.restore_points
        assert points is not None
        lone = points.lone_exact
        assert lone == PATCHED
        assert _check(path, llm, doc) == ("cold", 0)
        assert _check(path, llm, [*doc, 3]) == (("l1", 90) if lone else ("cold", 0))
        # stock: the point at 91 would leave one token; the one at 90 leaves two
        assert _check(path, llm, [*doc, 3, 4]) == ("l1", 91 if lone else 90)
        # a 513-token prompt: Llama.eval's batches of 512 end with one token, cold too
        assert points.n_batch == 512
        points.store.clear()
        long = [int(t) for t in np.random.default_rng(5).integers(3, 300, size=513)]
        assert _check(path, llm, long) == ("cold", 0)
        event = llm.last_cache_event
        assert event is not None
        if lone:
            assert sorted(points.store.lengths()) == [256, 512, 513]
        else:
            assert points.store.lengths() == [] and event.fallbacks
    finally:
        llm.close()
