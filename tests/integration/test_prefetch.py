"""Prefetch with the real model: L3 pages brought into L2 ahead of a request, after a restart.

The store is the one a real process filled in ``test_l3_runtime`` (``golden``); each test opens a
new ``SkippyLlama`` on a private copy of it (a restart: L1 and L2 empty), prefetches, and then
asks. Every output is compared with a cache-off run (plain ``llama_cpp.Llama``, greedy).
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from modelhelpers import TEXT, aligned
from serverproc import THREADS, ServerProcess, free_port
from test_l3_runtime import (
    DOC,
    N_CTX,
    PROMPTS,
    UNRELATED,
    _private_cache_home,
    clean_env,
    complete,
    golden,
    l3_settings,
    page_file,
    prompt_manifest,
    reference,
    store,
)

from skippy_llama.batch.items import BatchItem
from skippy_llama.batch.output import OutputFile
from skippy_llama.batch.runner import run_batch
from skippy_llama.costs import CostModel
from skippy_llama.runtime.llama import DECODED_SUFFIX, SkippyLlama
from skippy_llama.runtime.prompt_tokens import chat_tokens, completion_tokens

__all__ = ["_private_cache_home", "golden", "reference", "store"]  # fixtures

pytestmark = pytest.mark.model


def open_llm(model: Path, store: Path, cost_model: CostModel, **settings: Any) -> SkippyLlama:
    return SkippyLlama(
        str(model),
        n_ctx=N_CTX,
        verbose=False,
        cache_settings=l3_settings(store, **settings),
        cost_model=cost_model,  # restores forced: a GPU build may serve a short prompt cold
    )


def l3_hits(llm: SkippyLlama) -> int:
    disk = llm.prefix_cache.disk
    assert disk is not None
    return disk.status().process_activity.hits


def test_a_prefetched_prompt_restores_from_l2_after_a_restart(
    smollm2_path: Path, store: Path, reference: list[str], always_restore: CostModel
) -> None:
    llm = open_llm(smollm2_path, store, always_restore, l2={"budget": "256MiB"})
    try:
        result = llm.prefetch(PROMPTS[0])
        before = l3_hits(llm)
        out0 = complete(llm, PROMPTS[0])
        event0 = llm.last_cache_event
        reads = l3_hits(llm) - before

        # by token ids, on another thread, while this one serves a request from L3
        tokens = completion_tokens(llm, PROMPTS[2])
        done: list[Any] = []
        thread = threading.Thread(target=lambda: done.append(llm.prefetch(tokens)))
        thread.start()
        out1 = complete(llm, PROMPTS[1])
        event1 = llm.last_cache_event
        thread.join()
        complete(llm, UNRELATED)
        out2 = complete(llm, PROMPTS[2])
        event2 = llm.last_cache_event
        status = llm.cache_status()["counters"]
    finally:
        llm.close()
    assert result.stopped == "complete" and result.pages >= 3 and result.bytes > 0
    assert event0 is not None and event0.tier == "l2"
    assert event0.cached_tokens == aligned(llm, event0.prompt_tokens - DECODED_SUFFIX)
    assert result.tokens >= event0.cached_tokens
    assert reads == 0  # the request read nothing from disk
    assert [out0, out1, out2] == reference[:3]
    assert event1 is not None and event1.cached_tokens > 0
    assert done and done[0].stopped == "complete" and done[0].pages > 0
    assert event2 is not None and event2.tier == "l2"
    assert status["prefetches"] == 2 and status["prefetch_misses"] == 0
    assert status["prefetched_pages"] == result.pages + done[0].pages


def test_prefetch_does_nothing_with_l2_off(
    smollm2_path: Path, store: Path, reference: list[str], always_restore: CostModel
) -> None:
    llm = open_llm(smollm2_path, store, always_restore)
    try:
        result = llm.prefetch(PROMPTS[0])
        before = l3_hits(llm)
        out = complete(llm, PROMPTS[0])
        event = llm.last_cache_event
        reads = l3_hits(llm) - before
        counters = llm.cache_status()["counters"]
    finally:
        llm.close()
    assert result.stopped == "off" and result.pages == 0
    assert counters["prefetched_pages"] == 0
    assert out == reference[0]
    assert event is not None and event.tier == "l3" and reads == 1


def test_a_corrupt_l3_page_is_a_counted_miss_and_the_request_stays_exact(
    smollm2_path: Path,
    golden: dict[str, Any],
    store: Path,
    reference: list[str],
    always_restore: CostModel,
) -> None:
    pages = prompt_manifest(golden, store, 0)
    assert len(pages) >= 3 and pages[1][1] == 128
    path = page_file(store, pages[1][0])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    llm = open_llm(smollm2_path, store, always_restore, l2={"budget": "256MiB"})
    try:
        result = llm.prefetch(PROMPTS[0])  # never raises
        out = complete(llm, PROMPTS[0])
        event = llm.last_cache_event
        counters = llm.cache_status()["counters"]
        disk = llm.prefix_cache.disk
        assert disk is not None
        corrupt = disk.status().process_activity.corrupt_entries
    finally:
        llm.close()
    assert result.stopped == "miss" and result.pages == 1 and result.tokens == 128
    assert counters["prefetch_misses"] == 1 and corrupt == 1
    assert out == reference[0]
    assert event is not None and event.tier == "l2" and event.cached_tokens == aligned(llm, 128)


def test_prefetch_tokens_are_the_tokens_the_request_prefills(smollm2_path: Path) -> None:
    llm = SkippyLlama(str(smollm2_path), n_ctx=N_CTX, verbose=False)
    try:
        llm.create_completion(PROMPTS[0], max_tokens=1, temperature=0.0)
        n = llm.last_cache_event.prompt_tokens if llm.last_cache_event else 0
        assert llm.input_ids[:n].tolist() == completion_tokens(llm, PROMPTS[0])
        messages = [{"role": "system", "content": TEXT}, {"role": "user", "content": "Why?"}]
        llm.create_chat_completion(messages=messages, max_tokens=1, temperature=0.0)  # type: ignore[arg-type]
        n = llm.last_cache_event.prompt_tokens if llm.last_cache_event else 0
        assert llm.input_ids[:n].tolist() == chat_tokens(llm, messages)
    finally:
        llm.close()


def _batch(llm: SkippyLlama, out: Path) -> dict[str, Any]:
    items = [BatchItem(id=f"p{i}", line=i, prompt=p) for i, p in enumerate(PROMPTS)]
    chat = ({"role": "system", "content": DOC}, {"role": "user", "content": "Who is he?"})
    items.append(BatchItem(id="chat", line=len(items), messages=chat))
    run_batch(llm, items, OutputFile(out), max_tokens=8, progress=False)
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_a_batch_with_prefetch_gives_the_outputs_of_one_without(
    smollm2_path: Path,
    golden: dict[str, Any],
    store: Path,
    tmp_path: Path,
    reference: list[str],
    always_restore: CostModel,
) -> None:
    plain_store = tmp_path / "plain"
    shutil.copytree(golden["dir"], plain_store)
    llm = open_llm(smollm2_path, store, always_restore, l2={"budget": "256MiB"})
    try:
        prefetched = _batch(llm, tmp_path / "a.jsonl")
        counters = llm.cache_status()["counters"]
    finally:
        llm.close()
    llm = open_llm(smollm2_path, plain_store, always_restore)  # L2 off: no prefetch
    try:
        plain = _batch(llm, tmp_path / "b.jsonl")
        plain_counters = llm.cache_status()["counters"]
    finally:
        llm.close()
    assert prefetched == plain
    assert [prefetched[f"p{i}"]["text"] for i in range(3)] == reference[:3]
    assert counters["prefetches"] == 3 and counters["prefetched_pages"] > 0
    assert counters["hits"].get("l2", 0) >= 1  # a prefetched item restored from RAM
    assert plain_counters["prefetches"] == 0


# ---------------------------------------------------------------------- serve's idle gap


def _status(server: ServerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(server.base + "/v1/kv-cache/status") as r:
        data: dict[str, Any] = json.loads(r.read())
    return data


def test_the_idle_gap_prefetches_a_conversation_that_is_not_resident(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """With L1 off, a conversation the server left lives only in L3: the gap after the next
    request copies its pages into L2, and its next turn restores from there."""
    port = free_port()
    argv = [
        *("python", "-m", "skippy_llama.cli.main", "serve", "--model", str(smollm2_path)),
        *("--port", str(port), "--threads", str(THREADS), "--log-level", "warning"),
        *("--l3-mode", "fixed", "--l3-budget", "1GiB", "--l3-minimum-free", "1GiB"),
        *("--l3-dir", str(tmp_path / "l3"), "--l2-budget", "256MiB"),
    ]
    argv[0] = sys.executable
    env = clean_env(SKIPPY_L1__ENABLED="false", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    server = ServerProcess(argv, port, tmp_path / "serve.log", env=env).wait_ready()
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
        first = DOC + "\nQuestion: Who kept the light?\nAnswer:"  # two pages and a tail
        other = "Bread and butter, " * 20 + "\nQuestion: What is for breakfast?\nAnswer:"

        def ask(prompt: str) -> Any:
            return client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)

        answer = ask(first)
        time.sleep(1.0)  # the record of the first conversation lands in L3
        ask(other)  # leaves the first conversation: L1 is off, so it is in L3 alone
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the gap opens 0.2 s after the reply
            process = _status(server)["process"]
            if process["prefetched_pages"] > 0:
                break
            time.sleep(0.2)
        l2 = _status(server)["l2"]
        again = ask(first)
        by_tier = _status(server)["process"]["requests"]["by_tier"]
    finally:
        assert server.stop() == 0
    assert process["prefetches"] >= 1 and process["prefetched_pages"] >= 2, process
    assert process["prefetch_misses"] == 0
    assert l2["prefetched"] == process["prefetched_pages"] and l2["pages"] >= 2
    assert again.choices[0].text == answer.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens >= 256
    assert by_tier.get("l2", 0) == 1, by_tier
