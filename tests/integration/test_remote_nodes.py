"""Two nodes, one server: a document SmolLM2 prefilled on node A restores on node B through the
remote tier, on the real request path, with output equal to a cold run.

Each node is its own process (``l3_worker.py``) with its own L3 directory and the settings a user
gives (``SKIPPY_REMOTE__*``). A's L3 writer pushes the pages after L3 stored them; B's first
request misses L1/L2/L3, the planner matches the prompt's page keys on the server in one round
trip, and B restores from the remote tier. B then records the prefix into its own L3, whose
writer finds every page on the server already: nothing is sent again. With the server down,
every request still succeeds, cold, and the tier says why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("redis") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (redis) is not installed", allow_module_level=True)

from redisserver import RedisServer

from skippy_llama.runtime.baseline import ColdLlama

pytestmark = pytest.mark.model

WORKER = Path(__file__).with_name("l3_worker.py")
DOC = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had done before him. There were one hundred and twelve of them, worn smooth "
    "in the middle by generations of boots. At the top he trimmed the wick, polished the great "
    "lens until it shone, and wound the clockwork that turned the light. "
) * 6
PROMPT = DOC + "In the logbook that night the keeper wrote that"


def node(model: Path, store: Path, url: str, secret: Path) -> dict[str, Any]:
    """One process answering PROMPT with L3 in ``store`` and the remote tier at ``url``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKIPPY_")}
    env.update(
        SKIPPY_L3__MODE="fixed",
        SKIPPY_L3__BUDGET="1GiB",
        SKIPPY_L3__DIRECTORY=str(store),
        SKIPPY_L3__MINIMUM_FREE="1GiB",
        SKIPPY_REMOTE__URL=url,
        SKIPPY_REMOTE__SECRET_FILE=str(secret),
        SKIPPY_REMOTE__TIMEOUT_MS="500",
    )
    spec = {
        "model": str(model),
        "prompts": [PROMPT],
        "n_ctx": 1024,
        "max_tokens": 8,
        "always_restore": True,  # a GPU build's costs may prefill this short prompt instead
    }
    done = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["flushed"] is True
    return result


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "remote.key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> str:
    cold = ColdLlama(str(smollm2_path), n_ctx=1024, verbose=False)
    try:
        done = cold.create_completion(PROMPT, max_tokens=8, temperature=0.0)
    finally:
        cold.close()
    assert isinstance(done, dict)
    return str(done["choices"][0]["text"])


def test_node_b_restores_node_a_document_from_the_remote_tier(
    redis_clean: RedisServer, tmp_path: Path, smollm2_path: Path, secret: Path, reference: str
) -> None:
    a = node(smollm2_path, tmp_path / "a", redis_clean.url, secret)
    assert a["outputs"] == [reference] and a["events"][0]["tier"] == "cold"
    pushed = a["tiers"]["remote"]["activity"]
    assert pushed["pages_sent"] >= 2 and pushed["bytes_out"] > 0

    b = node(smollm2_path, tmp_path / "b", redis_clean.url, secret)
    event = b["events"][0]
    assert b["outputs"] == [reference]
    assert event["tier"] == "remote" and event["cached_tokens"] >= 2 * 128
    # the prompt's tail page too (found in the server's child index), not only its whole pages
    assert event["cached_tokens"] > event["prompt_tokens"] // 128 * 128
    assert b["counters"]["hits"] == {"remote": 1}
    remote = b["tiers"]["remote"]["activity"]
    assert remote["pages_fetched"] >= 2 and remote["bytes_in"] > 0
    # B recorded the prefix into its own L3 (written there), and the push that followed found
    # every page on the server: a repeat push sends no page bytes
    assert b["status"]["process_activity"]["writes"] >= 2
    assert remote["pages_present"] >= 2 and remote["bytes_out"] == 0


def test_a_node_whose_server_is_down_answers_every_request_cold(
    redis_server: RedisServer, tmp_path: Path, smollm2_path: Path, secret: Path, reference: str
) -> None:
    redis_server.kill()
    try:
        down = node(smollm2_path, tmp_path / "c", redis_server.url, secret)
    finally:
        redis_server.restart()
    assert down["outputs"] == [reference] and down["events"][0]["tier"] == "cold"
    remote = down["tiers"]["remote"]
    assert remote["failures"].get("connection", 0) >= 1
    assert remote["activity"]["bytes_out"] == 0


def test_a_wrong_secret_matches_nothing(
    redis_clean: RedisServer, tmp_path: Path, smollm2_path: Path, secret: Path, reference: str
) -> None:
    node(smollm2_path, tmp_path / "a", redis_clean.url, secret)
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    b = node(smollm2_path, tmp_path / "b", redis_clean.url, other)
    assert b["outputs"] == [reference] and b["events"][0]["tier"] == "cold"
    assert b["tiers"]["remote"]["activity"]["pages_fetched"] == 0


def test_serve_reports_the_remote_tier_in_its_status_and_metrics(
    redis_clean: RedisServer, tmp_path: Path, smollm2_path: Path, secret: Path
) -> None:
    import urllib.request

    from serverproc import ServerProcess

    server = ServerProcess.skippy(
        smollm2_path,
        tmp_path / "serve.log",
        "--l3-mode", "fixed", "--l3-budget", "1GiB", "--l3-dir", str(tmp_path / "l3"),
        "--remote-url", redis_clean.url, "--remote-secret-file", str(secret),
    ).wait_ready()  # fmt: skip
    try:
        with urllib.request.urlopen(server.base + "/v1/kv-cache/status", timeout=30) as reply:
            status = json.loads(reply.read())
        with urllib.request.urlopen(server.base + "/metrics", timeout=30) as reply:
            metrics = reply.read().decode()
    finally:
        server.stop()
    remote = status["tiers"]["remote"]
    assert remote["state"] == "on" and remote["breaker"]["state"] == "closed"
    assert 'skippy_remote_breaker{state="closed"} 1.0' in metrics
    assert "skippy_remote_activity_total" in metrics
