"""``skippy-llama serve`` under load: a real server process, real HTTP clients on 127.0.0.1.

32 clients stream at once against a queue of 8: each gets an answer equal to a cold run's or a
503 with ``Retry-After``; a client that goes away mid-stream frees the model at once; resident
prefixes stay within the memory budget. Every loop is bounded (attempts, polls), and nothing
asserts a duration.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import pytest
from modelhelpers import TEXT
from serverproc import THREADS, ServerProcess

pytestmark = pytest.mark.model

CLIENTS = 32
MAX_QUEUE = 8
PROMPTS = 8
MAX_TOKENS = 8
N_CTX = 2048
BUDGET = "32MiB"  # 1,456 SmolLM2 tokens: eight ~200-token prompts do not all stay resident


def _prompt(i: int) -> str:
    return f"Note {i}: visitor {i} asks about step {i * 7}. {TEXT}\nQuestion {i}: what is counted?\nAnswer:"


@pytest.fixture(scope="module")
def cold_answers(smollm2_path: Path) -> list[str]:
    """Each prompt answered by plain ``llama_cpp.Llama``, one at a time, nothing cached."""
    llm = llama_cpp.Llama(
        str(smollm2_path), n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS,
        seed=llama_cpp.LLAMA_DEFAULT_SEED, verbose=False,
    )  # fmt: skip
    try:
        answers = []
        for i in range(PROMPTS):
            llm.reset()
            out = llm.create_completion(_prompt(i), max_tokens=MAX_TOKENS, temperature=0)
            answers.append(out["choices"][0]["text"])
        return answers
    finally:
        llm.close()


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("logs") / "serve-load.log"
    proc = ServerProcess.skippy(
        smollm2_path, log, "--n-ctx", str(N_CTX), "--max-queue", str(MAX_QUEUE),
        "--memory-budget", BUDGET,
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _status(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.base + "/v1/kv-cache/status", timeout=60).json()


def _stream(client: httpx.Client, server: ServerProcess, prompt: str, max_tokens: int) -> Any:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    return client.stream("POST", server.base + "/v1/completions", json=body, timeout=600)


def _read_text(response: httpx.Response) -> str:
    text = ""
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        text += chunk["choices"][0]["text"] if chunk["choices"] else ""
    return text


def test_32_streams_get_an_answer_or_a_prompt_503_and_never_another_requests_tokens(
    server: ServerProcess, cold_answers: list[str]
) -> None:
    results: list[dict[str, Any]] = [
        {"answers": [], "busy": [], "other": []} for _ in range(CLIENTS)
    ]
    go = threading.Event()

    def client(k: int) -> None:
        mine = results[k]
        with httpx.Client() as http:
            go.wait(timeout=600)
            for _ in range(3):  # bounded: an answer, or up to three 503s
                with _stream(http, server, _prompt(k % PROMPTS), MAX_TOKENS) as response:
                    if response.status_code == 503:
                        response.read()
                        mine["busy"].append(response.headers.get("retry-after"))
                        time.sleep(min(int(response.headers.get("retry-after", "1")), 2))
                        continue
                    if response.status_code != 200:
                        mine["other"].append(response.status_code)
                        return
                    mine["answers"].append(_read_text(response))
                    return

    # one long stream holds the model while the 32 arrive, so the queue surely fills
    with httpx.Client() as blocker_http, _stream(blocker_http, server, _prompt(99), 160) as blocker:
        assert blocker.status_code == 200
        lines = blocker.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it holds the model
        threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        go.set()
        # before the blocker is read further, every client has an answer (queued ones) or a 503:
        # wait (bounded) until each has a first outcome or is queued behind the blocker
        for _ in range(600):
            line = _status(server)["server"]["queue"]
            if line["rejected"] >= CLIENTS - MAX_QUEUE:
                break
            time.sleep(0.1)
        for _ in lines:  # drain the blocker
            pass
        for t in threads:
            t.join(timeout=900)
    assert not any(t.is_alive() for t in threads)

    assert all(not r["other"] for r in results), [r["other"] for r in results]
    busy = [h for r in results for h in r["busy"]]
    assert busy, "32 streams against a queue of 8 were all admitted"
    assert all(h is not None and int(h) >= 1 for h in busy)  # every 503 says when to retry
    answered = 0
    for k, r in enumerate(results):
        assert len(r["answers"]) <= 1
        for text in r["answers"]:
            assert text == cold_answers[k % PROMPTS], k  # equal to a cold run: nobody else's
            answered += 1
    assert answered >= MAX_QUEUE  # at least the queued ones were served
    status = _status(server)
    queue = status["server"]["queue"]
    assert queue["running_or_waiting"] == 0 and queue["rejected"] == len(busy)
    assert status["process"]["requests"]["errors"] == 0
    # the cache ran: the prompts share their story, so most requests reused some of it
    assert status["process"]["requests"]["cached_tokens"] > 0
    # resident prefixes stay within the memory budget
    memory = status["server"]["memory"]
    assert memory["budget_bytes"] == 32 << 20 and memory["resident_bytes_max"] <= 32 << 20
    assert status["l1"]["tokens"] <= status["l1"]["budget_tokens"] == memory["budget_tokens"]


def test_a_client_that_disconnects_mid_stream_frees_the_model(
    server: ServerProcess, cold_answers: list[str]
) -> None:
    before = httpx.get(server.base + "/status.json", timeout=60).json()["totals"]["requests"]
    with httpx.Client() as http, _stream(http, server, _prompt(1) + " Tell more.", 1500) as gone:
        assert gone.status_code == 200
        seen = 0
        for line in gone.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 2:
                break  # the client goes away after two chunks of up to 1,500
    # bounded wait for the server to notice: the request ends as cancelled, far short of its
    # 1,500 tokens, and its queue place is free
    record = None
    for _ in range(600):
        page = httpx.get(server.base + "/status.json", timeout=60).json()
        if (
            page["totals"]["requests"] > before
            and page["server"]["queue"]["running_or_waiting"] == 0
        ):
            record = page["recent"][-1]
            break
        time.sleep(0.1)
    assert record is not None, "the abandoned stream never ended"
    assert record["outcome"] == "cancelled"
    assert record["completion_tokens"] < 1500
    # the model serves the next request as a cold run would
    with httpx.Client() as http, _stream(http, server, _prompt(2), MAX_TOKENS) as response:
        assert response.status_code == 200
        assert _read_text(response) == cold_answers[2]
