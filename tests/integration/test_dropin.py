"""SkippyLlama in place of ``llama_cpp.Llama`` on every path a user can take (SmolLM2).

Each test runs the same calls on ``SkippyLlama`` and on a cold reference (``ColdLlama``: plain
``Llama`` prefilling every prompt from scratch) and compares what the caller sees. Where reuse
is token-granular (CPU, flash attention off) plain ``Llama``, which reuses its own live cells,
must agree too; elsewhere its own reuse is not exact (bits depend on the batch split), so only
the cold reference is the truth. Each test also checks that the cache really served something,
so it cannot pass because the cache stood aside.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from modelhelpers import TEXT, aligned, short_of_a_boundary

from skippy_llama.config import Settings
from skippy_llama.runtime import context, native, native_ext, repair
from skippy_llama.runtime.baseline import ColdLlama
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.workload import SYSTEM_PROMPT

pytestmark = pytest.mark.model

OTHER = "A recipe for bread: flour, water, salt and yeast, kneaded and left to rise. " * 6
# the planner parks a left prefix only when it destroys a page (128 tokens) or more before costs
# are measured; where reuse ends on 64-token boundaries (GPU builds) the exact live part of
# OTHER's 121 tokens is 64, so the tests that need a park leave a document twice as long
LONG = OTHER * 2


def _run(
    make: Callable[..., llama_cpp.Llama], script: Callable[[llama_cpp.Llama], list[Any]]
) -> tuple[list[Any], llama_cpp.Llama]:
    llm = make()
    try:
        return script(llm), llm
    finally:
        llm.close()


def _both(
    path: Path,
    script: Callable[[llama_cpp.Llama], list[Any]],
    n_ctx: int = 1024,
    **kwargs: Any,
) -> tuple[list[Any], list[Any], SkippyLlama]:
    """``script``'s results on a cold reference and on SkippyLlama (plain Llama checked too)."""
    args = {"n_ctx": n_ctx, "verbose": False, **kwargs}
    want, _ = _run(lambda: ColdLlama(str(path), **args), script)
    got, skippy = _run(lambda: SkippyLlama(str(path), cache_settings=Settings(), **args), script)
    assert isinstance(skippy, SkippyLlama)
    if skippy.granule == 1:
        plain, _ = _run(lambda: llama_cpp.Llama(str(path), **args), script)
        assert plain == want
    return want, got, skippy


def _choice(out: Any) -> Any:
    """The first choice of a (not streamed) completion: llama_cpp types the result as a
    response or a stream, so the test reads it untyped."""
    return out["choices"][0]


def _text(out: Any) -> str:
    return str(_choice(out)["text"])


def _complete(llm: llama_cpp.Llama, prompt: str, **kwargs: Any) -> str:
    kwargs.setdefault("max_tokens", 10)
    kwargs.setdefault("temperature", 0.0)
    return _text(llm.create_completion(prompt, **kwargs))


# -- whole-context calls ------------------------------------------------------------------


def test_save_and_load_state_match_plain_llama(smollm2_path: Path) -> None:
    def script(llm: llama_cpp.Llama) -> list[Any]:
        out = [_complete(llm, TEXT + "The keeper")]
        saved = llm.save_state()
        out.append(_complete(llm, OTHER + "Bake it"))
        llm.load_state(saved)
        out.append(_complete(llm, TEXT + "The keeper wrote"))
        out.append(_complete(llm, OTHER + "Serve it"))  # the resident copy of OTHER is intact
        return out

    want, got, skippy = _both(smollm2_path, script)
    assert got == want
    assert skippy.prefix_cache.counters.hits["l1"] >= 2


def test_set_cache_with_llama_ram_cache_matches_plain_llama(smollm2_path: Path) -> None:
    def script(llm: llama_cpp.Llama) -> list[Any]:
        llm.set_cache(llama_cpp.llama_cache.LlamaRAMCache(capacity_bytes=2 << 30))
        return [
            _complete(llm, TEXT + "Question one:"),
            _complete(llm, OTHER + "Question two:"),
            _complete(llm, TEXT + "Question three:"),
            _complete(llm, OTHER + "Question four:"),
        ]

    want, got, _ = _both(smollm2_path, script)
    assert got == want


def test_reset_matches_plain_llama(smollm2_path: Path) -> None:
    def script(llm: llama_cpp.Llama) -> list[Any]:
        out = [_complete(llm, TEXT + "The keeper")]
        llm.reset()
        out.append(_complete(llm, TEXT + "The keeper climbed"))
        return out

    want, got, skippy = _both(smollm2_path, script)
    assert got == want
    assert skippy.last_cache_event is not None and skippy.last_cache_event.cached_tokens > 0


def test_kv_cache_clear_behind_the_cache_never_reuses_cleared_cells(smollm2_path: Path) -> None:
    """``_ctx.kv_cache_clear()`` (multimodal handlers call it) leaves resident prefixes intact and
    the cleared working sequence is not reused: outputs equal a cold model's."""
    fresh = ColdLlama(str(smollm2_path), n_ctx=1024, verbose=False)
    try:
        want = [_complete(fresh, TEXT + "The keeper wrote"), _complete(fresh, LONG + "Then")]
    finally:
        fresh.close()
    skippy = SkippyLlama(str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings())
    try:
        _complete(skippy, LONG + "First")
        _complete(skippy, TEXT + "The keeper")  # LONG is checkpointed as it is left
        skippy._ctx.kv_cache_clear()  # n_tokens still claims the cells
        got = [_complete(skippy, TEXT + "The keeper wrote")]
        after_clear = skippy.last_cache_event
        got.append(_complete(skippy, LONG + "Then"))
        resident = skippy.last_cache_event
    finally:
        skippy.close()
    assert got == want
    assert after_clear is not None and after_clear.cached_tokens == 0
    assert (
        resident is not None
        and resident.tier == "l1"
        and resident.cached_tokens >= aligned(skippy, 100)
    )


# -- prompt logprobs ----------------------------------------------------------------------


def test_prompt_logprobs_after_a_cached_prefix_match_plain_llama(smollm2_path: Path) -> None:
    def script(llm: llama_cpp.Llama) -> list[Any]:
        _complete(llm, TEXT + "Question one:")
        _complete(llm, OTHER + "Question two:")
        out = llm.create_completion(
            TEXT + "Question three:", max_tokens=4, temperature=0.0, echo=True, logprobs=3
        )
        plain_after = _complete(llm, TEXT + "Question four:")
        return [_choice(out)["logprobs"], plain_after]

    want, got, skippy = _both(smollm2_path, script, logits_all=True)
    assert got[0]["token_logprobs"][1:] == want[0]["token_logprobs"][1:]
    assert got[0]["top_logprobs"][1:] == want[0]["top_logprobs"][1:]
    assert got == want
    assert skippy.last_cache_event is not None and skippy.last_cache_event.cached_tokens > 0


def test_logits_all_rows_are_never_restored_ones(smollm2_path: Path) -> None:
    """With ``logits_all`` every prompt token's logits row can be read (prompt logprobs,
    ``llm.scores`` in a perplexity loop), and cells restored from a tier come without theirs
    (zeros before the fix: a uniform -log(n_vocab) logprob). Here TEXT would come back from
    L1; the rows must equal plain Llama's, and cells this object decoded are still reused."""

    def script(llm: llama_cpp.Llama) -> list[Any]:
        _complete(llm, TEXT + "Question one:")
        _complete(llm, OTHER + "Question two:")
        _complete(llm, TEXT + "Question three:")  # TEXT is resident in L1 here
        out = llm.create_completion(
            TEXT + "Question four:", max_tokens=2, temperature=0.0, echo=True, logprobs=2
        )
        _complete(llm, OTHER + "Question five:")
        llm.reset()
        llm.eval(llm.tokenize((TEXT + "Question six:").encode()))
        rows = llm.scores[: llm.n_tokens].tobytes()
        again = _complete(llm, TEXT + "Question six: and")
        return [_choice(out)["logprobs"], rows, again]

    want, got, skippy = _both(smollm2_path, script, logits_all=True)
    assert got == want
    # no checkpoint was restored (live cells are: the cost model timed no checkpoint restore)
    assert skippy.prefix_cache.costs.checkpoint_restore_seconds is None
    event = skippy.last_cache_event  # the last prompt extends the cells eval just decoded
    assert event is not None and event.cached_tokens > 100


# -- sampling paths ------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "steps": {"type": "integer"}},
    "required": ["name", "steps"],
}


def _sampling_script(llm: llama_cpp.Llama) -> list[Any]:
    q = TEXT + "Question: what did the keeper count? Answer:"
    grammar = llama_cpp.llama_grammar.LlamaGrammar.from_json_schema(
        json.dumps(SCHEMA), verbose=False
    )
    return [
        _complete(llm, q, max_tokens=16, temperature=0.9, seed=1234),
        _complete(llm, q, max_tokens=16, temperature=0.7, top_k=20, top_p=0.8, seed=7),
        _complete(llm, q, max_tokens=16, temperature=0.8, min_p=0.1, seed=99),
        _complete(llm, q + " {", max_tokens=40, grammar=grammar),
        _complete(llm, q, max_tokens=12, logit_bias={198: -100.0, 13: 5.0}),
        _complete(llm, q, max_tokens=40, stop=["\n", "."]),
        _choice(llm.create_completion(q, max_tokens=12, temperature=0.0, stop=["steps"]))[
            "finish_reason"
        ],
    ]


def test_sampling_paths_match_plain_llama(smollm2_path: Path) -> None:
    want, got, skippy = _both(smollm2_path, _sampling_script)
    assert got == want
    assert skippy.prefix_cache.counters.hits["l1"] >= 1


def test_a_reply_that_runs_into_n_ctx_matches_plain_llama(smollm2_path: Path) -> None:
    def script(llm: llama_cpp.Llama) -> list[Any]:
        first = llm.create_completion(TEXT, max_tokens=-1, temperature=0.0)
        again = llm.create_completion(TEXT + " And", max_tokens=-1, temperature=0.0)
        return [_text(first), _choice(first)["finish_reason"], _text(again)]

    want, got, _ = _both(smollm2_path, script, n_ctx=256)
    assert got == want
    assert want[1] == "length"


def _stream_text(chunks: Any, chat: bool = False) -> str:
    if chat:
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    return "".join(c["choices"][0]["text"] for c in chunks)


def test_streams_and_an_abandoned_stream_match_plain_llama(smollm2_path: Path) -> None:
    messages: list[Any] = [{"role": "user", "content": "Tell me about lighthouses."}]

    def script(llm: llama_cpp.Llama) -> list[Any]:
        out = [
            _stream_text(
                llm.create_completion(
                    TEXT + "The keeper", max_tokens=10, temperature=0, stream=True
                )
            ),
            _stream_text(
                llm.create_chat_completion(
                    messages=messages, max_tokens=10, temperature=0, stream=True
                ),
                chat=True,
            ),
        ]
        abandoned = llm.create_completion(OTHER + "Knead", max_tokens=20, stream=True)
        assert isinstance(abandoned, Iterator)
        out.append(next(abandoned)["choices"][0]["text"])
        out.append(_complete(llm, TEXT + "The keeper wrote"))
        del abandoned
        gc.collect()  # the abandoned stream is finalized after a newer request ran
        out.append(_complete(llm, TEXT + "The keeper wrote down"))
        out.append(_complete(llm, OTHER + "Knead it"))
        return out

    want, got, skippy = _both(smollm2_path, script)
    assert got == want
    assert skippy.prefix_cache.counters.hits["l1"] >= 2


# -- fail-open on the whole request path ----------------------------------------------------


def _raise(exc: BaseException) -> Callable[..., Any]:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return boom


FAULTS = [
    pytest.param("checkpoint", MemoryError("state too large"), "park", id="park"),
    pytest.param("restore_checkpoint", ValueError("bad checkpoint"), "l1", id="l1-restore"),
    pytest.param("capture_range", MemoryError("huge state"), "record", id="record"),
    pytest.param("set_seq_state", OSError("EIO"), "l3", id="l3-restore"),
]


@pytest.mark.parametrize(("call", "exc", "step"), FAULTS)
def test_a_fault_in_any_step_is_a_counted_fallback_with_plain_output(
    smollm2_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    call: str,
    exc: BaseException,
    step: str,
) -> None:
    settings = Settings(l3={"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path)})
    prompts = [TEXT + "The keeper", OTHER + "Bake", TEXT + "The keeper wrote"]
    cold = ColdLlama(str(smollm2_path), n_ctx=1024, verbose=False)
    try:
        want = [_complete(cold, p) for p in prompts]
    finally:
        cold.close()
    if step == "l3":  # a first process fills L3, the faulty one restores from it
        filler = SkippyLlama(str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=settings)
        try:
            _complete(filler, prompts[0])
        finally:
            filler.close()
    skippy = SkippyLlama(str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=settings)
    monkeypatch.setattr(native, call, _raise(exc))
    if call == "capture_range":  # patched builds capture through the range export instead
        monkeypatch.setattr(native_ext, "range_export", _raise(exc))
        # ... or export records by per-layer copies (patch 0006, runtime/export.py)
        monkeypatch.setattr(native_ext, "cells_get", _raise(exc))
    if call == "set_seq_state":  # ... and restore L3 pages by per-layer copies (patch 0006)
        monkeypatch.setattr(native_ext, "cells_set", _raise(exc))
    try:
        got = [_complete(skippy, p) for p in prompts]
    finally:
        skippy.close()
    assert got == want
    fallbacks = skippy.prefix_cache.counters.fallbacks
    assert any(reason.startswith(step) for reason in fallbacks), fallbacks


def test_a_fault_in_the_repair_is_a_counted_fallback(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def script(llm: llama_cpp.Llama) -> list[Any]:
        out = []
        for content in ("Tell me about tides.", "How is bread made?", "Why two tides a day?"):
            # a long shared system prompt: every chat leaves an exact part to checkpoint
            # and user messages long enough to leave it past a canonical batch boundary; the
            # prompt ends at most 4 tokens short of an n_ubatch boundary (the same prompts on
            # every model here), so that the 8-token reply crosses one and is repaired where
            # reuse ends on such boundaries (a reply inside one granule is not repaired)
            def chat(filler: str, content: str = content) -> list[dict[str, str]]:
                # ... and long enough (over a page and a granule) that leaving it is parked
                user = content + " Please explain it in detail." * 32 + (filler and " " + filler)
                return [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": user},
                ]

            messages = short_of_a_boundary(llm, chat, int(llm.context_params.n_ubatch), room=4)
            reply = llm.create_chat_completion(messages=messages, max_tokens=8, temperature=0)
            out.append(_choice(reply)["message"]["content"])
        return out

    monkeypatch.setattr(repair, "repair", _raise(ValueError("repair failed")))
    want, got, skippy = _both(smollm2_path, script)
    assert got == want
    if skippy.lone_decodes_exact:  # replies are exact as generated: no repair to fail
        assert skippy.prefix_cache.counters.fallbacks == {}
    else:
        assert any(r.startswith("park") for r in skippy.prefix_cache.counters.fallbacks)


# -- memory --------------------------------------------------------------------------------


def test_one_context_of_plain_size_and_resident_memory_within_the_budget(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []
    original = context._HookedContext.__init__

    def counting(self: Any, *, model: Any, params: Any, verbose: bool = True) -> None:
        original(self, model=model, params=params, verbose=verbose)
        built.append(int(params.n_ctx))

    monkeypatch.setattr(context._HookedContext, "__init__", counting)
    skippy = SkippyLlama(str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings())
    try:
        for i in range(6):  # more distinct prefixes than slots and than the budget holds
            _complete(skippy, f"Document {i}: " + (TEXT if i % 2 else OTHER) * 2, max_tokens=2)
        status = skippy.cache_status()
    finally:
        skippy.close()
    assert built == [1024]  # built once, with the cells plain Llama has
    l1 = status["l1"]
    assert l1["budget_tokens"] == 1024
    assert 0 < l1["resident_tokens"] <= l1["budget_tokens"]
    assert skippy.prefix_cache.counters.parked >= 4


def test_the_kv_layout_is_read_lazily_and_the_same_either_way(smollm2_path: Path) -> None:
    # L1 alone needs no layout to serve requests: loading decodes nothing (plain Llama's load
    # time); status reads it then, by a one-token probe before any request or from one live cell
    prompt = "Document: " + TEXT
    cold = ColdLlama(str(smollm2_path), n_ctx=1024, verbose=False)
    try:
        want = _complete(cold, prompt, max_tokens=8)
    finally:
        cold.close()
    layouts = []
    for status_first in (True, False):
        skippy = SkippyLlama(
            str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings()
        )
        try:
            assert skippy.n_tokens == 0 and native.seq_pos_max(skippy.ctx, 0) < 0
            if status_first:
                assert skippy.cache_status()["kv_bytes_per_token"] > 0
                assert skippy.n_tokens == 0 and native.seq_pos_max(skippy.ctx, 0) < 0
            assert _complete(skippy, prompt, max_tokens=8) == want
            if not status_first:
                assert skippy.cache_status()["kv_bytes_per_token"] > 0
            assert _complete(skippy, prompt, max_tokens=8) == want
            layouts.append(skippy.kv_layout)
            assert skippy.native_verdict.kind in ("stock", "certified", "uncertified")
        finally:
            skippy.close()
    assert layouts[0] is not None and layouts[0] == layouts[1]


def test_quantized_kv_resident_prefixes_restore_their_own_cells(smollm2_path: Path) -> None:
    # llama.cpp's device checkpoints copy 1/32 of a Q8_0 range (size / block size taken as
    # elements), so a second resident prefix's bytes came back in the first's restore (found by
    # the traffic matrix); quantized K/V keep host checkpoints and equal a cold prefill
    shared = "Read the document and answer the question.\n\n"
    docs = [TEXT * 2, OTHER * 2]
    prompts = [
        shared + docs[0] + "\nQuestion: what is it about?\nAnswer:",
        shared + docs[1] + "\nQuestion: what is it about?\nAnswer:",
        shared + docs[0] + "\nQuestion: who wrote it?\nAnswer:",
    ]
    kwargs: dict[str, Any] = {
        "n_ctx": 1024,
        "n_batch": 64,
        "n_ubatch": 64,
        "flash_attn": True,
        "type_k": llama_cpp.GGML_TYPE_Q8_0,
        "type_v": llama_cpp.GGML_TYPE_Q8_0,
        "verbose": False,
    }
    cold = ColdLlama(str(smollm2_path), **kwargs)
    try:
        want = [_complete(cold, p, max_tokens=12) for p in prompts]
    finally:
        cold.close()
    skippy = SkippyLlama(str(smollm2_path), cache_settings=Settings(), **kwargs)
    try:
        got = [_complete(skippy, p, max_tokens=12) for p in prompts]
        event = skippy.last_cache_event
    finally:
        skippy.close()
    assert event is not None and event.tier == "l1" and event.cached_tokens >= 128
    assert got == want


def test_checkpoints_that_cost_more_than_their_prefill_are_skipped(smollm2_path: Path) -> None:
    # on a GPU build a state call has a fixed cost (~60 ms on an H200) that can exceed the
    # prefill it saves; the measured costs then skip the restore (and later the park), and the
    # output is the cold one either way
    prompts = ["Document: " + TEXT * 2 + " Summary:", "Document: " + LONG + " Summary:"]
    cold = ColdLlama(str(smollm2_path), n_ctx=1024, verbose=False)
    try:
        want = [_complete(cold, p, max_tokens=6) for p in prompts]
    finally:
        cold.close()
    skippy = SkippyLlama(str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings())
    try:
        assert [_complete(skippy, p, max_tokens=6) for p in prompts] == want  # parks prompt 0
        costs = skippy.prefix_cache.costs
        assert costs.prefill_seconds_per_token is not None and costs.park_seconds is not None
        costs.checkpoint_restore_seconds = 1e3  # as if a restore took longer than any prefill here
        assert _complete(skippy, prompts[0], max_tokens=6) == want[0]
        skipped = skippy.last_cache_event
        counters = skippy.prefix_cache.counters
        # only the few tokens it shares with the live sequence (free to keep) are reused
        assert skipped is not None and skipped.cached_tokens < 16
        assert counters.restores_skipped == 1
        parks = counters.park_skipped
        assert _complete(skippy, prompts[1], max_tokens=6) == want[1]  # leaves prompt 0's chat
        assert counters.park_skipped == parks + 1  # not kept: it could never repay its park
        displaced = skippy.last_cache_event
        assert displaced is not None and displaced.park_skipped is not None
        assert "tokens lost" in displaced.park_skipped
        costs.checkpoint_restore_seconds = 0.0
        assert _complete(skippy, prompts[0], max_tokens=6) == want[0]
        resumed = skippy.last_cache_event
        assert resumed is not None and resumed.tier == "l1" and resumed.cached_tokens > 100
    finally:
        skippy.close()


def test_host_buffers_are_pinned_only_on_cuda_with_kv_offloaded(smollm2_path: Path) -> None:
    for pin in (True, False):
        llm = SkippyLlama(
            str(smollm2_path),
            n_ctx=512,
            verbose=False,
            cache_settings=Settings(pin_host_buffers=pin),
        )
        try:
            offloaded = llm.model_params.n_gpu_layers != 0 and llm.context_params.offload_kqv
            status = llm.cache_status()["pinned_host_buffers"]
            if pin and native.backend_name() == "CUDA" and offloaded:
                assert status is not None and status["refused"] is False
            else:
                assert status is None and llm.seam.buffers.pinner is None
        finally:
            llm.close()


def test_the_bus_is_probed_where_pages_may_be_restored(smollm2_path: Path, tmp_path: Path) -> None:
    """Issue 45: with a page tier on, loading probes the bus and page restores no tier has
    measured yet are planned at its rate; with L1 alone nothing is probed."""
    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path), "minimum_free": "1GiB"}
    for settings, probed in ((Settings(l3=l3), True), (Settings(), False)):
        llm = SkippyLlama(str(smollm2_path), n_ctx=512, verbose=False, cache_settings=settings)
        try:
            costs = llm.prefix_cache.costs
            status = llm.cache_status()["bus_gb_per_s"]
            if probed:
                assert llm.bus is not None and status is not None and status > 0
                assert costs.bus_seconds_per_byte == llm.bus.seconds_per_byte
                assert costs.restore_cost(10**6, tier="l3") is not None
            else:
                assert llm.bus is None and status is None and costs.bus_seconds_per_byte is None
        finally:
            llm.close()
