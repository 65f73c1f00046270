"""A prefix restored from sliced pages gives the same logits as a cold prefill (SmolLM2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from modelhelpers import TEXT, last_logits

from skippy_llama.config import Settings
from skippy_llama.runtime import native
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.state import assemble, cut_pages, page_from_bytes, parse_state

pytestmark = pytest.mark.model

F16, Q8_0 = 1, 8
LAYOUTS = [
    pytest.param(F16, F16, False, id="f16-fa_off"),
    pytest.param(F16, F16, True, id="f16-fa_on"),
    # llama.cpp refuses a quantized V cache without flash attention, so Q8_0 K alone there
    pytest.param(Q8_0, F16, False, id="q8k-fa_off"),
    pytest.param(Q8_0, Q8_0, True, id="q8kv-fa_on"),
]


@pytest.mark.parametrize(("type_k", "type_v", "flash_attn"), LAYOUTS)
def test_sliced_prefix_restores_bit_identical_logits(
    smollm2_path: Path, type_k: int, type_v: int, flash_attn: bool
) -> None:
    llm = SkippyLlama(
        str(smollm2_path), n_ctx=1024, type_k=type_k, type_v=type_v, flash_attn=flash_attn,
        verbose=False, cache_settings=Settings(page_tokens=64),
    )  # fmt: skip
    tokens = llm.tokenize((TEXT * 3).encode())[:300]
    prefix, suffix = tokens[:192], tokens[192:]
    # a suffix must really be decoded after the restore, or the comparison reads stale logits
    assert len(tokens) == 300 and len(suffix) == 108
    try:
        # cold: the prefix and then the suffix, decoded in the same batch shapes as the restore
        llm.reset()
        llama_eval = super(SkippyLlama, llm).eval
        llama_eval(prefix)
        llama_eval(suffix)
        cold = last_logits(llm)
        whole = native.get_seq_state(llm.ctx, 0)

        state = parse_state(whole)
        assert state.n_tokens == len(tokens)
        assert state.layout == llm.kv_layout
        pages = [page_from_bytes(p.to_bytes()) for p in cut_pages(state, 64)]
        blob = assemble(pages[:3], llm.kv_layout, seq_id=0)  # 3 pages = the 192-token prefix

        native.seq_rm(llm.ctx, 0)
        llm.reset()
        # poison the logits buffer so a skipped suffix decode cannot pass as a match
        llama_eval(tokens[:2])
        assert not np.array_equal(last_logits(llm), cold)
        native.seq_rm(llm.ctx, 0)
        llm.reset()
        assert native.set_seq_state(llm.ctx, blob, 0)
        assert native.seq_pos_max(llm.ctx, 0) == len(prefix) - 1
        llm.input_ids[: len(prefix)] = prefix
        llm.n_tokens = len(prefix)
        llama_eval(suffix)
        warm = last_logits(llm)
    finally:
        llm.close()
    assert np.array_equal(cold, warm), f"max |Δ| = {np.abs(cold - warm).max()}"
    assert int(np.argmax(cold)) == int(np.argmax(warm))


def test_restore_into_another_sequence_id(smollm2_path: Path) -> None:
    """An assembled blob restores into any destination sequence, not only the one it came from."""
    llm = SkippyLlama(str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings())
    try:
        tokens = llm.tokenize(TEXT.encode())[:140]
        super(SkippyLlama, llm).eval(tokens)
        state = parse_state(native.get_seq_state(llm.ctx, 0))
        layout = llm.kv_layout
        assert layout is not None
        blob = assemble(cut_pages(state, 128, keep_tail=False), layout, seq_id=3)
        assert native.set_seq_state(llm.ctx, blob, 3)
        assert native.seq_pos_max(llm.ctx, 3) == 127
        again = parse_state(native.get_seq_state(llm.ctx, 3))
        assert again.n_tokens == 128
        for a, b in zip(again.k, state.k, strict=True):
            assert np.array_equal(a, b[:128])
    finally:
        llm.close()


def test_canonical_batching_makes_cached_logits_equal_a_one_shot_prefill(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """Flash attention on: llama.cpp's CPU kernel makes bits depend on the batch split, so
    SkippyLlama reuses cells only up to multiples of n_ubatch and prefills from there; the last
    logits then equal plain Llama's one-shot prefill bit for bit (L1 and L3)."""
    import llama_cpp

    kwargs: dict[str, Any] = {
        "n_ctx": 1024, "n_batch": 64, "n_ubatch": 64, "flash_attn": True, "verbose": False
    }  # fmt: skip
    text = (TEXT * 3).encode()
    settings = Settings(
        page_tokens=32, l3={"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path)}
    )
    plain = llama_cpp.Llama(str(smollm2_path), **kwargs)
    try:
        prompt = plain.tokenize(text)[:301]
        other = plain.tokenize(b"Bread is made of flour and water. " * 8)
        plain.eval(prompt)
        cold = last_logits(plain)
    finally:
        plain.close()
    first = SkippyLlama(str(smollm2_path), cache_settings=settings, **kwargs)
    try:
        assert first.granule == 64
        first.eval(prompt[:250])  # a shorter prompt with the same start: L1 and L3 get it
        first.eval(other)  # leaves it: it becomes resident
        first.reset()
        first.eval(prompt)
        l1 = first.last_cache_event
        from_l1 = last_logits(first)
    finally:
        first.close()
    second = SkippyLlama(str(smollm2_path), cache_settings=settings, **kwargs)
    try:
        second.eval(prompt)
        l3 = second.last_cache_event
        from_l3 = last_logits(second)
    finally:
        second.close()
    assert l1 is not None and l1.tier == "l1" and l1.cached_tokens == 192  # 3 × 64 ≤ 250 − 2
    # the first object recorded the whole prompt too, as far as a repeat reuses it: 4 × 64 ≤ 299
    assert l3 is not None and l3.tier == "l3" and l3.cached_tokens == 256
    assert np.array_equal(from_l1, cold), f"max |Δ| = {np.abs(from_l1 - cold).max()}"
    assert np.array_equal(from_l3, cold), f"max |Δ| = {np.abs(from_l3 - cold).max()}"
