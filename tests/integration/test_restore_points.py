"""SkippyLlama on recurrent and hybrid models: a prompt that extends an earlier prompt restores
that prompt's restore point and decodes only the rest, and answers exactly as a cold run."""

from __future__ import annotations

import os
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from skippy_llama import SkippyLlama
from skippy_llama.config import Settings
from skippy_llama.runtime import native, native_ext

#: the patched build (patch 0004's CPU kernels): lone decodes are exact there (one token after a
#: point is restored); the stock build restores along pieces of two tokens or more
PATCHED = native_ext.abi_version() is not None

#: where the runtime takes restore points at all (``open_restore_points``): the CPU backend
#: without BLAS, flash attention off (``LLCPP_FORCE_FA`` of tests/force_ngl turns it on). On a
#: GPU build they are off by design and the model is served as plain ``Llama``.
POINT_BACKEND = (
    native.backend_name() == "CPU"
    and "BLAS" not in native.registered_backends()
    and not os.environ.get("LLCPP_FORCE_FA")
)

#: restore points must be on for every synthetic family on a point backend, stock or patched:
#: the stock build's only difference (a one-token micro-batch) is planned around
PROMISED = POINT_BACKEND

#: sliding-window models (Gemma 3) get points on the patched build only (``open_for_model``:
#: their alignment was measured there)
SWA_PROMISED = PROMISED and PATCHED


def skip_if_aligned(llm: SkippyLlama, what: str) -> None:
    """Skip a test of points at any prompt end where they sit on micro-batch boundaries (a GPU
    build with a roster row, or the GPU-like lane): test_restore_points_aligned.py covers it."""
    points = llm.restore_points
    if points is not None and points.step > 0:
        pytest.skip(f"{what}: restore points sit on multiples of {points.step} tokens here")


def points_or_skip(llm: SkippyLlama, what: str, *, swa: bool = False) -> None:
    """Skip a test of restore points where the runtime does not take them (a GPU build, the
    stock build's refusal), after asserting that it is off only where that is allowed;
    ``swa``: the model has a sliding window (points on the patched build only)."""
    skip_if_aligned(llm, what)
    if llm.restore_points is not None:
        assert POINT_BACKEND and (PATCHED or not swa)  # never where the runtime does not certify
        return
    promised = SWA_PROMISED if swa else PROMISED
    assert not promised, f"{what}: restore points must be on on the CPU (flash attention off)"
    backend = native.backend_name()
    pytest.skip(f"{what}: restore points are off here ({backend}, patched={PATCHED})")


pytestmark = pytest.mark.model

_FAMILIES = ("mamba2", "qwen35", "granitehybrid", "lfm2")


def _cold(
    path: Path, prompt: list[int], max_tokens: int, n_ctx: int = 512
) -> tuple[list[int], np.ndarray]:
    """Tokens and first-token logits of a fresh plain Llama (a cold prefill)."""
    llm = llama_cpp.Llama(
        str(path), n_ctx=n_ctx, n_threads=1, n_threads_batch=1, verbose=False, logits_all=False
    )
    try:
        out = _greedy(llm, prompt, max_tokens)
    finally:
        llm.close()
    return out


def _greedy(
    llm: llama_cpp.Llama, prompt: list[int], max_tokens: int
) -> tuple[list[int], np.ndarray]:
    tokens: list[int] = []
    first: np.ndarray | None = None
    for token in llm.generate(prompt, temp=0.0, top_k=1):
        if first is None:
            first = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)
            ).copy()
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    assert first is not None
    return tokens, first


def _skippy(path: Path, settings: Settings | None = None, n_ctx: int = 512) -> SkippyLlama:
    """A SkippyLlama on a synthetic model, one thread (a loaded machine's spinning batch
    threads made these tiny models 100x slower)."""
    return SkippyLlama(
        str(path),
        n_ctx=n_ctx,
        n_threads=1,
        n_threads_batch=1,
        verbose=False,
        cache_settings=settings or Settings(),
    )


@pytest.mark.parametrize("family", _FAMILIES)
def test_extended_prompts_restore_and_match_cold(
    family: str, synthetic_models: dict[str, Path]
) -> None:
    path = synthetic_models[family]
    rng = np.random.default_rng(1)
    doc = [int(t) for t in rng.integers(3, 300, size=90)]
    turns = [doc, [*doc, 17, 18, 19, 20], [*doc, 17, 18, 19, 20, 40, 41, 42], [*doc, 99, 98]]
    llm = _skippy(path)
    try:
        assert not llm.caching  # the paged cache still refuses the model
        # where the load-time check found restores inexact (stock kernels, chunked prefills of
        # some families), the model is served as plain Llama: no event, outputs still cold's
        skip_if_aligned(llm, family)
        on = llm.restore_points is not None
        assert on or not PROMISED
        assert POINT_BACKEND or not on  # a GPU build: off, served as plain Llama
        served = []
        for prompt in turns:
            tokens, logits = _greedy(llm, prompt, 5)
            cold_tokens, cold_logits = _cold(path, prompt, 5)
            assert tokens == cold_tokens
            assert np.array_equal(logits, cold_logits)
            event = llm.last_cache_event
            assert (event is not None) == on
            served.append(event.cached_tokens if event is not None else 0)
    finally:
        llm.close()
    # turn 1 is cold; turns 2-4 continue from the deepest earlier prompt they extend
    assert served == ([0, 90, 94, 90] if on else [0, 0, 0, 0])


@pytest.mark.parametrize("family", _FAMILIES)
def test_context_is_plain_llamas_own(family: str, synthetic_models: dict[str, Path]) -> None:
    """A recurrent or hybrid model gets plain ``Llama``'s context (one sequence, no unified
    cache), not the paged cache's eight sequences: served from restore points or as plain
    ``Llama``, it must answer as a cold plain ``Llama`` does on every backend."""
    path = synthetic_models[family]
    llm = _skippy(path)
    plain = llama_cpp.Llama(str(path), n_ctx=512, n_threads=1, verbose=False)
    try:
        for field in ("n_seq_max", "kv_unified"):
            got = getattr(llm.context_params, field)
            assert got == getattr(plain.context_params, field), field
        assert llm.context_params.n_seq_max == 1
    finally:
        llm.close()
        plain.close()


def test_text_completions_report_cached_tokens(synthetic_models: dict[str, Path]) -> None:
    llm = _skippy(synthetic_models["qwen35"])
    try:
        skip_if_aligned(llm, "qwen35")
        if not POINT_BACKEND:  # off by design: plain Llama reports nothing cached
            assert llm.restore_points is None
            text = "A shared document about cats and dogs. " * 4
            for tail in ("Question one?", "Question one? More"):
                out = llm.create_completion(text + tail, max_tokens=3, temperature=0.0)
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            return
        text = "A shared document about cats and dogs. " * 4
        llm.create_completion(text + "Question one?", max_tokens=3, temperature=0.0)
        second = llm.create_completion(text + "Question two?", max_tokens=3, temperature=0.0)
        # the first prompt's end is the only restore point; the second does not extend it
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        third = llm.create_completion(text + "Question two? More", max_tokens=3, temperature=0.0)
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        llm.close()


def test_off_without_l1(synthetic_models: dict[str, Path]) -> None:
    llm = _skippy(synthetic_models["mamba2"], Settings(l1={"enabled": False}))
    try:
        assert llm.restore_points is None
    finally:
        llm.close()
