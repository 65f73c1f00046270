"""Reuse at any token boundary only where the model's prefill does not depend on the batch split.

On the CPU with flash attention off, SmolLM2 Q4_1 gives every token the same results however a
prompt is split, but Gemma 3 270M Q4_K_M does not (its weights are repacked for the CPU and its
kernels take a batch's columns in groups): an L1 hit reused after 107 tokens answered with logits
up to 1.12 away from a cold prefill's, its argmax changed (measured before the probe). The load
time probe (``runtime.probes.split_invariant``) must keep any-token reuse for the first and end
reuse on ``n_ubatch`` boundaries for the second, where every answer then equals a cold one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
from modelhelpers import cold_logits, last_logits

from skippy_llama.config import Settings
from skippy_llama.runtime import probes as runtime_probes
from skippy_llama.runtime import split_verdicts
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.runtime.working import WorkingSequence

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        llama_cpp.llama_supports_gpu_offload(),
        reason="GPU build: reuse ends on n_ubatch boundaries for every model, no probe runs",
    ),
]

KWARGS: dict[str, Any] = {"n_ctx": 2048, "n_batch": 512, "flash_attn": False, "verbose": False}


def _tokens(n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(100, 20000, n)]


def test_a_split_invariant_model_reuses_any_token_boundary(smollm2_path: Path) -> None:
    llm = SkippyLlama(str(smollm2_path), cache_settings=Settings(), **KWARGS)
    try:
        assert llm.granule == 1
        assert llm.n_tokens == 0  # the probe leaves nothing behind
    finally:
        llm.close()


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """The n_ubatch of each probe run, with empty verdict memos (this process's and the disk's)."""
    runs: list[int] = []
    probe = runtime_probes._probe_split

    def counted(seq: WorkingSequence) -> bool:
        runs.append(int(seq.llm.context_params.n_ubatch))
        return probe(seq)

    monkeypatch.setattr(runtime_probes, "_probe_split", counted)
    monkeypatch.setattr(split_verdicts, "_verdicts", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return runs


def _granule(model: Path, **kwargs: object) -> int:
    llm = SkippyLlama(str(model), cache_settings=Settings(), **{**KWARGS, **kwargs})
    try:
        return llm.granule
    finally:
        llm.close()


def test_the_verdict_is_probed_once_per_model_and_kernel_settings(
    smollm2_path: Path, probes: list[int]
) -> None:
    assert [_granule(smollm2_path, n_ubatch=n) for n in (512, 512, 256)] == [1, 1, 1]
    assert probes == [512, 256]  # the second load reused the first's verdict


def test_a_new_process_reuses_the_verdict_kept_on_disk(
    smollm2_path: Path, probes: list[int], tmp_path: Path
) -> None:
    llm = SkippyLlama(str(smollm2_path), cache_settings=Settings(), **KWARGS)
    lone = llm.lone_decodes_exact
    llm.close()
    split_verdicts._verdicts.clear()  # what a new process starts with
    assert _granule(smollm2_path) == 1
    assert probes == [512]
    memo = tmp_path / "xdg" / "skippy-llama" / "split-verdicts.json"
    # the split verdict, then the lone-decode one (each under its own key)
    assert list(json.loads(memo.read_text()).values()) == [True, lone]


@pytest.mark.parametrize("damage", ["not a boolean", "not json", "not an object"])
def test_a_damaged_verdict_memo_means_a_new_probe(
    smollm2_path: Path, probes: list[int], tmp_path: Path, damage: str
) -> None:
    assert _granule(smollm2_path) == 1
    memo = tmp_path / "xdg" / "skippy-llama" / "split-verdicts.json"
    key = next(iter(json.loads(memo.read_text())))
    damaged = {
        "not a boolean": json.dumps({key: "yes"}),
        "not json": "{tru",
        "not an object": "[1]",
    }
    memo.write_text(damaged[damage])
    split_verdicts._verdicts.clear()
    assert _granule(smollm2_path) == 1
    assert probes == [512, 512]


def test_a_blas_build_reuses_only_canonical_batches(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # BLAS takes matrix products of 32 tokens or more, beyond what the probe decodes; no BLAS
    # build here, so the registry is what changes (its numerics are llama.cpp's to test)
    monkeypatch.setattr("skippy_llama.runtime.native.registered_backends", lambda: ["CPU", "BLAS"])
    llm = SkippyLlama(str(smollm2_path), cache_settings=Settings(), **KWARGS)
    try:
        assert llm.granule == 512
    finally:
        llm.close()


@pytest.mark.parametrize("k", [103, 107, 150])
def test_a_split_dependent_model_reuses_only_canonical_batches(gemma3_path: Path, k: int) -> None:
    tokens = _tokens(400)
    llm = SkippyLlama(str(gemma3_path), cache_settings=Settings(), **KWARGS)
    cold = llama_cpp.Llama(str(gemma3_path), **KWARGS)
    try:
        assert llm.granule == 512
        llm.create_completion(tokens[:k], max_tokens=1)
        llm.create_completion(tokens[300:340], max_tokens=1)  # the first prompt leaves
        longer = tokens[: k + 20]
        llm.create_completion(longer, max_tokens=1)
        event = llm.last_cache_event
        assert event is not None and event.cached_tokens % 512 == 0
        assert np.array_equal(last_logits(llm), cold_logits(cold, longer))
    finally:
        llm.close()
        cold.close()
