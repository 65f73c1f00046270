"""L2's host arena on the real SmolLM2 model: a restore from it equals a cold prefill.

Where the roster certifies ``layer_copy_exact`` (the patched build, patch 0006), L2 keeps pages
in a host arena laid out as the KV tensors and a restore copies them per layer straight into the
context; anywhere else L2 keeps page bytes and restores through the state format. Either way the
continuation's logits must be bit-identical to a one-shot cold prefill (CPU), with flash
attention on (V rows) and off (V transposed, the library's default).
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest
from modelhelpers import TEXT, last_logits

from skippy_llama.config import Settings
from skippy_llama.costs import AlwaysRestore
from skippy_llama.runtime.llama import SkippyLlama

pytestmark = pytest.mark.model

N_CTX = 1024
DOC = 700  # five pages and a tail: one run of arena slots, cut inside the last page


def _tokens(path: Path) -> list[int]:
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize((TEXT * 4).encode())[: DOC + 200]
    finally:
        llm.close()


@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa_off", "fa_on"])
def test_l2_restores_from_the_arena_exactly(
    smollm2_path: Path, tmp_path: Path, flash_attn: bool
) -> None:
    tokens = _tokens(smollm2_path)
    doc, first, query = tokens[:DOC], tokens[DOC : DOC + 40], tokens[DOC + 40 : DOC + 100]
    plain = llama_cpp.Llama(
        str(smollm2_path), n_ctx=N_CTX, n_batch=512, flash_attn=flash_attn, verbose=False
    )
    try:
        plain.eval(doc + query)
        cold = last_logits(plain)
    finally:
        plain.close()
    settings = Settings(
        l1={"enabled": False},
        l2={"budget": "64MiB"},
        l3={"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path), "minimum_free": "1GiB"},
    )
    llm = SkippyLlama(
        str(smollm2_path),
        n_ctx=N_CTX,
        n_batch=512,
        flash_attn=flash_attn,
        verbose=False,
        cache_settings=settings,
        cost_model=AlwaysRestore(),
    )
    try:
        arena = llm.native_verdict.layer_copy
        assert (llm.arena_refusal is None) == arena, llm.arena_refusal
        llm.eval(doc + first)  # recorded into L3
        llm.recorder.flush()
        tiers, cached, exact = [], [], []
        for _ in range(3):
            llm.reset()
            llm.eval(doc + query)
            event = llm.last_cache_event
            assert event is not None
            tiers.append(event.tier)
            cached.append(event.cached_tokens)
            exact.append(bool((last_logits(llm) == cold).all()))
        ram = llm.prefix_cache.ram
        assert ram is not None
        status = ram.status()
    finally:
        llm.close()
    # the second L3 read promotes the pages; the third request is L2's
    assert tiers == ["l3", "l3", "l2"]
    assert len(set(cached)) == 1 and cached[0] >= DOC - 128
    assert exact == [True, True, True]
    if arena:
        assert status.arena_hits > 0 and status.arena_bytes > 0
    else:
        assert status.arena_hits == 0 and status.arena_bytes == 0
