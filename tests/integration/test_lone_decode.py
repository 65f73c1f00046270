"""Replies reused as generated where lone decodes are exact, and decoded again where they are not.

A reply is generated one token at a time. On a stock CPU build ggml hands a one-token product to
``vec_dot`` and a batch's to sgemm, which sum in different orders, so a reply's cells differ from
those a cold prefill of the same text computes and the runtime decodes the reply again before a
next turn reuses it. Native patch 0004 sends single tokens through sgemm too; the load-time probe
(``SkippyLlama._lone_decodes_exact``) then finds lone decodes exact and the reply is reused as
generated. Either way every answer must equal a cold prefill's: these tests run on the stock lane
and on the patched one (``.ci/run``), each asserting what its build does.
"""

from __future__ import annotations

import platform
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from modelhelpers import TEXT, aligned, cold_logits, last_logits

from skippy_llama.config import Settings
from skippy_llama.roster import queue_digest
from skippy_llama.runtime import native, native_ext
from skippy_llama.runtime.baseline import ColdLlama
from skippy_llama.runtime.llama import SkippyLlama

pytestmark = pytest.mark.model

KWARGS: dict[str, object] = {"n_ctx": 2048, "verbose": False}


def _lone_decodes_agree(model: Path) -> bool:
    """Measured apart from the runtime: a 300-token prompt prefilled whole, against the same
    prompt with its last 40 tokens decoded one at a time (where the stock build differs)."""
    tokens = [1, *(int(t) for t in np.random.default_rng(0).integers(100, 20000, 300))]
    plain = llama_cpp.Llama(str(model), **KWARGS)  # type: ignore[arg-type]
    try:
        whole = cold_logits(plain, tokens)
        cold_logits(plain, tokens[:-40])
        for token in tokens[-40:]:
            plain.eval([token])
        return bool(np.array_equal(last_logits(plain), whole))
    finally:
        plain.close()


def test_the_lone_verdict_is_what_decoding_shows(smollm2_path: Path) -> None:
    agree = _lone_decodes_agree(smollm2_path)
    llm = SkippyLlama(str(smollm2_path), cache_settings=Settings(), **KWARGS)  # type: ignore[arg-type]
    try:
        assert llm.lone_decodes_exact == (agree and llm.granule == 1)
        assert llm.cache_status()["lone_decodes_exact"] == llm.lone_decodes_exact
        assert llm.n_tokens == 0  # the probe leaves nothing behind
    finally:
        llm.close()
    # patch 0004 changes ggml-cpu's kernels only: a GPU build decodes on the device
    cpu = native.backend_name() == "CPU"
    if native_ext.queue_sha256() == queue_digest() and platform.machine() == "x86_64" and cpu:
        assert agree, "this checkout's queue (patch 0004) makes x86 lone decodes exact"


def test_a_linear_chat_reuses_each_reply_exactly(smollm2_path: Path) -> None:
    """Each turn's prompt extends the last reply; its logits equal a cold prefill's, and the
    reply's cells are reused where lone decodes are exact (else decoded again, in one batch)."""
    skippy = SkippyLlama(str(smollm2_path), cache_settings=Settings(), **KWARGS)  # type: ignore[arg-type]
    cold = ColdLlama(str(smollm2_path), **KWARGS)  # type: ignore[arg-type]
    try:
        prompt = TEXT + " The keeper counted"
        before = None  # the previous turn's prompt and reply token counts
        for turn in range(3):
            # a one-token request first: its logits are those at the prompt's end
            skippy.create_completion(prompt, max_tokens=1, temperature=0.0)
            event = skippy.last_cache_event
            tokens = skippy.tokenize(prompt.encode())
            assert np.array_equal(last_logits(skippy), cold_logits(cold, tokens)), turn
            assert event is not None and event.repaired_tokens == 0
            if before is not None:
                n_prompt, n_generated = before
                # the reply's last token was sampled, never decoded (and may merge with the
                # next text's first when tokenized): the prompt decodes it
                if skippy.lone_decodes_exact:
                    assert event.cached_tokens >= n_prompt + n_generated - 2
                else:
                    assert event.cached_tokens <= aligned(skippy, n_prompt)
            out = skippy.create_completion(prompt, max_tokens=12, temperature=0.0)
            want = cold.create_completion(prompt, max_tokens=12, temperature=0.0)
            assert out["choices"][0]["text"] == want["choices"][0]["text"]  # type: ignore[index]
            n_generated = out["usage"]["completion_tokens"]  # type: ignore[index]
            assert n_generated >= 2
            before = (len(tokens), n_generated)
            prompt += out["choices"][0]["text"] + f" Then, at landing {turn}, he"  # type: ignore[index]
    finally:
        skippy.close()
        cold.close()
