"""``skippy-llama serve`` as a real process on 127.0.0.1, driven by the official ``openai`` client.

Every answer is compared with ``SkippyLlama`` called directly with the kwargs the server passes
(greedy decoding), and every test that claims reuse checks ``cached_tokens`` > 0.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import openai
import pytest
from modelhelpers import TEXT
from prometheus_client.parser import text_string_to_metric_families
from serverproc import THREADS, ServerProcess, free_port

from skippy_llama.cli.serve import SERVE_L1_DEFAULTS
from skippy_llama.config import load_settings
from skippy_llama.counters import CacheCounters
from skippy_llama.runtime import native_ext
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.server.routes import _NOT_MODEL_ARGS, ChatBody, CompletionBody

pytestmark = pytest.mark.model

SYSTEM = "You are a concise assistant. Answer in one short sentence. " + TEXT
L3_FLAGS = ("--l3-mode", "fixed", "--l3-budget", "1GiB", "--l3-minimum-free", "1GiB")


def _client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=server.api_key or "unused")


def _get(server: ServerProcess, path: str, key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(server.base + path, headers=headers)) as r:
        body = r.read().decode()
    return body if path == "/metrics" else json.loads(body)


def _post(server: ServerProcess, path: str, body: dict[str, Any], key: str | None = None) -> Any:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(
        server.base + path, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def l3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("l3")


@pytest.fixture(scope="module")
def server(
    smollm2_path: Path, l3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    proc = ServerProcess.skippy(smollm2_path, log, *L3_FLAGS, "--l3-dir", str(l3_dir))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def direct(smollm2_path: Path) -> Iterator[SkippyLlama]:
    """The same model called in-process, with the server's model settings (L1 only)."""
    llm = SkippyLlama(str(smollm2_path), **_server_model_kwargs())
    yield llm
    llm.close()


def _server_model_kwargs() -> dict[str, Any]:
    """What the served model is built with (beyond its path), for in-process comparisons."""
    import llama_cpp

    return {
        "cache_settings": load_settings().settings,
        "n_ctx": 4096,
        "n_threads": THREADS,
        "n_threads_batch": THREADS,
        "seed": llama_cpp.LLAMA_DEFAULT_SEED,
        "verbose": False,
    }


def _direct_completion(llm: SkippyLlama, **request: Any) -> Any:
    kwargs = CompletionBody(**request).model_dump(exclude=_NOT_MODEL_ARGS)
    return llm.create_completion(**kwargs)


def _direct_chat(llm: SkippyLlama, **request: Any) -> Any:
    kwargs = ChatBody(**request).model_dump(exclude=_NOT_MODEL_ARGS)
    return llm.create_chat_completion(**kwargs)


def _chat_turn(
    client: Any, direct: SkippyLlama, history: list[dict[str, str]], question: str
) -> Any:
    """One chat turn through the server, checked against the same turn called directly; the
    reply joins ``history``. Returns the server's usage."""
    history.append({"role": "user", "content": question})
    got = client.chat.completions.create(model="m", messages=history, max_tokens=12, temperature=0)
    want = _direct_chat(direct, messages=history, max_tokens=12, temperature=0)
    text = got.choices[0].message.content
    assert text == want["choices"][0]["message"]["content"]
    history.append({"role": "assistant", "content": text})
    return got.usage


def test_models_lists_the_served_model(server: ServerProcess) -> None:
    ids = [m.id for m in _client(server).models.list().data]
    assert ids == ["SmolLM2-135M-Instruct.Q4_1"]


def test_completions_equal_direct_calls_and_reuse_the_prefix(
    server: ServerProcess, direct: SkippyLlama
) -> None:
    client = _client(server)
    for question in ("Who kept the light?", "How many steps were there?"):
        prompt = TEXT + "\nQuestion: " + question + "\nAnswer:"
        got = client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0)
        want = _direct_completion(direct, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want["choices"][0]["text"]
        assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
        assert got.usage.completion_tokens == want["usage"]["completion_tokens"]
    # the second question shares the whole story with the first
    assert got.usage.prompt_tokens_details.cached_tokens > 100


@pytest.mark.slow
def test_chat_turns_grow_cached_tokens_and_equal_direct_calls(
    server: ServerProcess, direct: SkippyLlama
) -> None:
    client = _client(server)
    questions = ["Who climbs the stairs?", "What does he polish?", "What did he write about?"]
    users: dict[str, list[dict[str, str]]] = {
        u: [{"role": "system", "content": SYSTEM}] for u in ("ann", "bob")
    }
    cached: dict[str, list[int]] = {"ann": [], "bob": []}
    for question in questions:
        for user, history in users.items():  # two users interleaved turn by turn
            usage = _chat_turn(client, direct, history, f"{user}: {question}")
            cached[user].append(usage.prompt_tokens_details.cached_tokens)
    skipped = _get(server, "/v1/kv-cache/status")["process"]["restores_skipped"]
    assert not skipped or direct.granule > 1  # never on the CPU with flash attention off
    for user, seen in cached.items():
        if skipped:
            # a GPU build declined a checkpoint restore that its fast prefill beats
            continue
        assert seen[0] < seen[1] <= seen[2], (user, seen)
        # reuse ends on whole granules on GPU builds: one short turn may not reach the next
        assert seen[2] > seen[1] or direct.granule > 1, (user, seen)


def test_a_pause_after_a_reply_lets_the_next_turn_reuse_it(
    server: ServerProcess, direct: SkippyLlama
) -> None:
    """The server re-decodes the last reply while no request comes (``--idle-repair-after``
    0.2 s by default), so the chat's next turn reuses the reply; answers do not change."""
    client = _client(server)
    history = [{"role": "system", "content": SYSTEM}]
    before = _get(server, "/v1/kv-cache/status")["process"]["turns_prepared"]
    usages = []
    for question in ("Who climbs the stairs?", "Why at night?"):
        usages.append(_chat_turn(client, direct, history, f"cyd: {question}"))
        time.sleep(1.5)  # the user reads the reply and types
    process = _get(server, "/v1/kv-cache/status")["process"]
    # where reuse ends on whole granules (GPU builds), a short reply inside one granule has
    # nothing to gain from re-decoding and is left as it is
    if direct.granule == 1:
        assert process["turns_prepared"] >= before + 2, process
        assert process["tokens_prepared"] > 0
    metrics = _families(_get(server, "/metrics"))
    assert _value(metrics, "skippy_turns_prepared") >= process["turns_prepared"]
    # the second turn reused the first turn's prompt and its reply, not only the prompt (on
    # GPU builds reuse ends on whole granules, which a 12-token reply may not complete)
    first, second = usages
    reused = second.prompt_tokens_details.cached_tokens
    assert reused > first.prompt_tokens or direct.granule > 1, usages


def test_streaming_equals_non_streaming_with_usage_chunk(server: ServerProcess) -> None:
    client = _client(server)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Describe the signal of the light."},
    ]
    plain = client.chat.completions.create(
        model="m", messages=messages, max_tokens=14, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="m", messages=messages, max_tokens=14, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == plain.usage.completion_tokens
    # the same messages again: the stream reused what the plain request left resident
    assert usage.prompt_tokens_details.cached_tokens > 0
    # without stream_options no chunk carries usage
    bare = list(
        client.completions.create(
            model="m", prompt=TEXT + "\nThe keeper", max_tokens=8, temperature=0, stream=True
        )
    )
    assert all(c.usage is None for c in bare)
    whole = client.completions.create(
        model="m", prompt=TEXT + "\nThe keeper", max_tokens=8, temperature=0
    )
    assert "".join(c.choices[0].text for c in bare) == whole.choices[0].text


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], name: str, **labels: str) -> float:
    total = 0.0
    for sample in families[name].samples:
        named = sample.name in (name, name + "_total")
        if named and all(sample.labels.get(k) == v for k, v in labels.items()):
            total += sample.value
    return total


def test_metrics_parse_and_count_requests_tokens_and_tiers(server: ServerProcess) -> None:
    client = _client(server)
    before = _families(_get(server, "/metrics"))
    prompt = TEXT + "\nQuestion: What turns the light?\nAnswer:"
    for _ in range(2):
        client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    after = _families(_get(server, "/metrics"))
    done = _value(after, "skippy_requests", endpoint="completions", outcome="ok")
    assert done - _value(before, "skippy_requests", endpoint="completions", outcome="ok") == 2
    assert _value(after, "skippy_prompt_tokens") > _value(before, "skippy_prompt_tokens")
    assert _value(after, "skippy_cached_tokens", tier="l1") > _value(
        before, "skippy_cached_tokens", tier="l1"
    )
    ttft = {s.labels["tier"]: s.value for s in after["skippy_ttft_seconds"].samples
            if s.name == "skippy_ttft_seconds_count"}  # fmt: skip
    assert sum(ttft.values()) == sum(
        _value(after, "skippy_requests", endpoint=e, outcome="ok") for e in ("completions", "chat")
    )
    for name in (
        "skippy_restored_bytes", "skippy_restore_seconds", "skippy_fallbacks",
        "skippy_l1_resident_prefixes", "skippy_l2_used_bytes", "skippy_l3_used_bytes",
        "skippy_l3_pages", "skippy_l3_prefixes", "skippy_cache_hits",
    ):  # fmt: skip
        assert name in after, name
    assert _value(after, "skippy_l3_state", state="active") == 1
    assert _value(after, "skippy_l1_resident_prefixes") >= 1
    # every cache counter is in the status JSON and is a metric (one asdict feeds both)
    process = _get(server, "/v1/kv-cache/status")["process"]
    assert {f.name for f in fields(CacheCounters)} <= set(process)
    for name in ("park_skipped", "records_skipped", "records_deferred", "lookups"):
        assert _value(after, f"skippy_cache_{name}") <= process[name], name
    deadline = time.monotonic() + 30  # L3 writes happen off the request path
    while _value(_families(_get(server, "/metrics")), "skippy_l3_pages") == 0:
        assert time.monotonic() < deadline, "no page reached L3"
        time.sleep(0.5)


@pytest.mark.certified_backend
def test_kv_cache_status_is_the_cli_status_plus_l1_l2(server: ServerProcess, l3_dir: Path) -> None:
    status = _get(server, "/v1/kv-cache/status")
    cli = subprocess.run(
        [sys.executable, "-m", "skippy_llama.cli.main", "kv-cache", "status", "--json",
         *L3_FLAGS, "--l3-dir", str(l3_dir)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    want = json.loads(cli.stdout)
    assert set(want) <= set(status)
    # the same settings, but for the server's own L1: sized by its memory budget (2GiB unless
    # capped by the memory available)
    memory = status["server"]["memory"]
    sized = "serve default (default budget)"
    served = want["configured"] | {
        "l1.repair_generated": {"value": SERVE_L1_DEFAULTS["repair_generated"],
                                "source": "serve default"},
        "l1.budget_tokens": {"value": memory["budget_tokens"], "source": sized},
        "l1.max_prefixes": {"value": memory["max_prefixes"], "source": sized},
    }  # fmt: skip
    assert status["configured"] == served
    assert memory["source"] == "default" and memory["requested_bytes"] == 2 << 30
    assert memory["budget_tokens"] * memory["kv_bytes_per_token"] <= memory["budget_bytes"]
    assert memory["kv_bytes_per_token"] == 23_040  # SmolLM2: 30 layers x 3 KV heads x 2 x 64 x 2
    assert status["l1"]["budget_tokens"] == memory["budget_tokens"] > 4096  # more than n_ctx
    assert status["effective"]["state"] == "active"
    assert status["effective"]["directory"] == want["effective"]["directory"]
    assert status["l1"]["enabled"] and status["l1"]["prefixes"] >= 1
    assert status["l2"] == {"enabled": False}
    assert status["process"]["requests"]["requests"] >= 1
    assert status["kv_dtype"]["type_k"] == "F16"
    # the served SmolLM2's verdict (decided at load); the CLI without --model has none
    assert want["native"]["verdict"] is None
    assert status["native"]["library"] == want["native"]["library"]
    served = status["native"]["verdict"]
    if native_ext.abi_version() is None:
        assert served["verdict"] == "stock" and served["lanes"] == []
    else:
        assert served["verdict"] == "certified" and "append_import_exact" in served["lanes"]


def test_prune_and_clear_from_loopback(server: ServerProcess) -> None:
    code, body = _post(server, "/v1/kv-cache/prune", {"target": "12 GB"})
    assert code == 400 and "12 GB" in body["detail"]
    code, body = _post(server, "/v1/kv-cache/clear", {"model_identity": "nope"})
    assert code == 400 and "nope" in body["detail"]
    code, body = _post(server, "/v1/kv-cache/prune", {"target": "1GiB"})
    assert code == 200 and body["bytes_after"] <= body["bytes_before"]
    code, body = _post(server, "/v1/kv-cache/clear", {})
    assert code == 200
    assert _get(server, "/v1/kv-cache/status")["usage"]["manifests"] == 0


def _outward_address() -> str | None:
    """A non-loopback IPv4 address of this machine (no packet leaves it), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the outgoing interface
            address = str(sock.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_prune_and_clear_refuse_other_hosts_without_a_key(
    smollm2_path: Path, tmp_path: Path
) -> None:
    address = _outward_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    server = ServerProcess.skippy(smollm2_path, tmp_path / "log", "--host", address)
    server.base = f"http://{address}:{server.port}"
    server.wait_ready()
    try:
        code, body = _post(server, "/v1/kv-cache/clear", {})
        assert code == 403 and "loopback" in body["detail"]
        assert _post(server, "/v1/kv-cache/prune", {})[0] == 403
        assert _get(server, "/v1/kv-cache/status")["effective"]["state"] == "off"
    finally:
        assert server.stop() == 0


def test_api_key(smollm2_path: Path, tmp_path: Path) -> None:
    server = ServerProcess.skippy(smollm2_path, tmp_path / "log", api_key="sekrit").wait_ready()
    try:
        wrong = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong")
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="m", prompt="Hello", max_tokens=2)
        ok = _client(server).completions.create(model="m", prompt="Hello", max_tokens=2)
        assert ok.usage.prompt_tokens_details.cached_tokens == 0
        assert _post(server, "/v1/kv-cache/clear", {})[0] == 401  # loopback is not enough
        code, body = _post(server, "/v1/kv-cache/clear", {}, key="sekrit")
        assert code == 409 and "L3 is not in use" in body["detail"]
        with pytest.raises(urllib.error.HTTPError) as info:
            _get(server, "/v1/kv-cache/status")
        assert info.value.code == 401
        assert _get(server, "/v1/kv-cache/status", key="sekrit")["effective"]["state"] == "off"
    finally:
        assert server.stop() == 0


def test_shutdown_flushes_l3_and_a_restart_restores_from_it(
    smollm2_path: Path, tmp_path: Path
) -> None:
    flags = (*L3_FLAGS, "--l3-dir", str(tmp_path / "l3"))
    prompt = SYSTEM + "\nQuestion: How often did the light flash?\nAnswer:"
    first = ServerProcess.skippy(smollm2_path, tmp_path / "a.log", *flags).wait_ready()
    try:
        cold = _client(first).completions.create(
            model="m", prompt=prompt, max_tokens=8, temperature=0
        )
    finally:
        assert first.stop() == 0, first.log()
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    second = ServerProcess.skippy(smollm2_path, tmp_path / "b.log", *flags).wait_ready()
    try:
        warm = _client(second).completions.create(
            model="m", prompt=prompt, max_tokens=8, temperature=0
        )
        recent = _get(second, "/status.json")["recent"]
    finally:
        assert second.stop() == 0, second.log()
    assert warm.choices[0].text == cold.choices[0].text
    assert warm.usage.prompt_tokens_details.cached_tokens > 100
    assert recent[-1]["tier"] == "l3"


@pytest.mark.slow
def test_serve_a_package_uses_its_kv_dtype_and_equals_direct_calls(
    smollm2_path: Path, tmp_path: Path
) -> None:
    from test_package_cli import SMOL_CONFIG
    from test_package_runtime import _package

    pkg = _package(tmp_path, smollm2_path, {**SMOL_CONFIG, "kv_cache_dtype": "int8"})
    port = free_port()
    argv = [sys.executable, "-m", "skippy_llama.cli.main", "serve", "--package", str(pkg),
            "--port", str(port), "--threads", str(THREADS), "--log-level", "warning"]  # fmt: skip
    server = ServerProcess(argv, port, tmp_path / "serve.log").wait_ready()
    try:
        status = _get(server, "/v1/kv-cache/status")
        messages = [{"role": "user", "content": "Name three colors."}]
        got = _client(server).chat.completions.create(
            model="m", messages=messages, max_tokens=12, temperature=0
        )
        models = [m.id for m in _client(server).models.list().data]
    finally:
        server.stop()
    assert status["kv_dtype"]["rule"] == "publisher_kv_declaration"
    assert (status["kv_dtype"]["type_k"], status["kv_dtype"]["type_v"]) == ("Q8_0", "Q8_0")
    assert len(models) == 1
    direct = SkippyLlama.from_package(pkg, **_server_model_kwargs())
    try:
        want = _direct_chat(direct, messages=messages, max_tokens=12, temperature=0)
    finally:
        direct.close()
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
