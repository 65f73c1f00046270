"""``skippy-llama serve`` under load: a real server process, real HTTP clients on 127.0.0.1.

32 clients stream at once against a queue of 8: each gets an answer equal to a cold run's or a
503 with ``Retry-After``; a client that goes away mid-stream frees the model at once; resident
prefixes stay within the memory budget. Every loop is bounded (attempts, polls), and nothing
asserts a duration.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from modelhelpers import TEXT
from serverproc import THREADS, ServerProcess

from skippy_llama.server.routes import _NOT_MODEL_ARGS, CompletionBody

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
    """Each prompt answered by plain ``llama_cpp.Llama`` with the kwargs the server passes, one
    at a time, nothing cached."""
    llm = llama_cpp.Llama(
        str(smollm2_path), n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS,
        seed=llama_cpp.LLAMA_DEFAULT_SEED, verbose=False,
    )  # fmt: skip
    try:
        answers = []
        for i in range(PROMPTS):
            llm.reset()
            # the server's request defaults (llama_cpp.server's repeat_penalty among them)
            request = CompletionBody(prompt=_prompt(i), max_tokens=MAX_TOKENS, temperature=0)
            out = llm.create_completion(**request.model_dump(exclude=_NOT_MODEL_ARGS))
            assert isinstance(out, dict)
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


def _get(server: ServerProcess, path: str) -> Any:
    with urllib.request.urlopen(server.base + path, timeout=60) as r:
        return json.loads(r.read())


def _status(server: ServerProcess) -> dict[str, Any]:
    return _get(server, "/v1/kv-cache/status")  # type: ignore[no-any-return]


@contextlib.contextmanager
def _stream(server: ServerProcess, prompt: str, max_tokens: int) -> Iterator[Any]:
    """A streamed completion's response (status, headers, SSE lines); closing the connection
    on exit is the client going away."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        yield conn.getresponse()
    finally:
        conn.close()


def _lines(response: Any) -> Iterator[str]:
    for raw in iter(response.readline, b""):
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line


def _read_text(response: Any) -> str:
    text = ""
    for line in _lines(response):
        if line == "data: [DONE]":
            break
        chunk = json.loads(line.removeprefix("data: "))
        text += chunk["choices"][0]["text"] if chunk["choices"] else ""
    return text


@pytest.mark.slow
def test_32_streams_get_an_answer_or_a_prompt_503_and_never_another_requests_tokens(
    server: ServerProcess, cold_answers: list[str]
) -> None:
    results: list[dict[str, Any]] = [
        {"answers": [], "busy": [], "other": []} for _ in range(CLIENTS)
    ]
    go = threading.Event()

    def client(k: int) -> None:
        mine = results[k]
        go.wait(timeout=600)
        for _ in range(3):  # bounded: an answer, or up to three 503s
            with _stream(server, _prompt(k % PROMPTS), MAX_TOKENS) as response:
                if response.status == 503:
                    response.read()
                    retry = response.getheader("Retry-After")
                    mine["busy"].append(retry)
                    time.sleep(min(int(retry or "1"), 2))
                    continue
                if response.status != 200:
                    mine["other"].append(response.status)
                    return
                mine["answers"].append(_read_text(response))
                return

    # one long stream holds the model while the 32 arrive, so the queue surely fills
    with _stream(server, _prompt(99), 160) as blocker:
        assert blocker.status == 200
        lines = _lines(blocker)
        assert next(lines)  # its first chunk: it holds the model
        threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        go.set()
        # bounded wait until the line has filled and refused the rest
        for _ in range(600):
            if _status(server)["server"]["queue"]["rejected"] >= CLIENTS - MAX_QUEUE:
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
    before = _get(server, "/status.json")["totals"]["requests"]
    with _stream(server, _prompt(1) + " Tell more.", 1500) as gone:
        assert gone.status == 200
        lines = _lines(gone)
        next(lines), next(lines)  # the client goes away after two chunks of up to 1,500
    # bounded wait for the server to notice: the request ends as cancelled, far short of its
    # 1,500 tokens, and its queue place is free
    record = None
    for _ in range(600):
        page = _get(server, "/status.json")
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
    with _stream(server, _prompt(2), MAX_TOKENS) as response:
        assert response.status == 200
        assert _read_text(response) == cold_answers[2]
