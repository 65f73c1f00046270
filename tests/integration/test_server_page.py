"""The status page in headless Chromium (Debian's ``chromium``) against a real server.

The page must show the server's live numbers after a few requests; a screenshot is kept in
``$SKIPPY_TEST_ARTIFACTS`` (default ``test-artifacts/`` at the repository root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import openai
import pytest
from modelhelpers import TEXT
from serverproc import ServerProcess

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--window-size=1200,1500",
    # the page polls /status.json; virtual time lets that fetch finish before the capture
    "--virtual-time-budget=5000",
)  # fmt: skip


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    message = "headless Chromium not found: apt-get install -y chromium (.ci/run does)"
    if os.environ.get("CI"):
        pytest.fail(message)  # CI must run the browser test, not skip it
    pytest.skip(message)


class _Texts(HTMLParser):
    """Text of every element with an id, and the body's attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: dict[str, str] = {}
        self.body: dict[str, str | None] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "body":
            self.body = found
        if tag in ("meta", "link", "br", "img", "input", "line", "circle", "polyline"):
            return
        self._open.append(found.get("id"))
        if found.get("id"):
            self.texts[str(found["id"])] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag in ("meta", "link", "br", "img", "input", "line", "circle", "polyline"):
            return
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for element in self._open:
            if element:
                self.texts[element] += data


def _browser(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_status_page_shows_live_numbers(smollm2_path: Path, tmp_path: Path) -> None:
    chromium = _chromium()
    server = ServerProcess.skippy(
        smollm2_path, tmp_path / "serve.log", "--l3-mode", "fixed", "--l3-budget", "1GiB",
        "--l3-minimum-free", "1GiB", "--l3-dir", str(tmp_path / "l3"),
    ).wait_ready()  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
        for question in ("Who keeps the light?", "What is the signal?", "When does he climb?"):
            client.completions.create(
                model="m", prompt=f"{TEXT}\nQ: {question}\nA:", max_tokens=4, temperature=0
            )
        history: list[Any] = [{"role": "user", "content": "Tell me about lighthouses."}]
        for _ in range(2):
            reply = client.chat.completions.create(
                model="m", messages=history, max_tokens=6, temperature=0
            )
            history += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": "And then?"},
            ]
        with urllib.request.urlopen(server.base + "/status.json") as r:
            data = json.loads(r.read())
        dom = _browser(chromium, tmp_path / "profile-dom", "--dump-dom", server.base + "/")
        assert dom.returncode == 0, dom.stderr[-2000:]
        artifacts = Path(os.environ.get("SKIPPY_TEST_ARTIFACTS", ROOT / "test-artifacts"))
        artifacts.mkdir(parents=True, exist_ok=True)
        shot = artifacts / "status-page.png"
        shot.unlink(missing_ok=True)
        snap = _browser(
            chromium, tmp_path / "profile-shot", f"--screenshot={shot}", server.base + "/"
        )
        assert snap.returncode == 0, snap.stderr[-2000:]
    finally:
        assert server.stop() == 0, server.log()

    page = _Texts()
    page.feed(dom.stdout)
    totals = data["totals"]
    assert totals["requests"] == 5
    assert page.body.get("data-loaded") == "5"  # the script rendered the server's data
    assert page.texts["requests"].strip() == "5"
    assert page.texts["model"].strip() == "SmolLM2-135M-Instruct.Q4_1"
    assert page.texts["hit-rate"].strip() == f"{100 * totals['hit_rate']:.1f} %"
    # the page says what a hit is, and counts the shorter matches apart
    short = totals["short_matches"]
    assert totals["hits"] + short <= totals["requests"]
    assert page.texts["hit-rule"].strip() == (
        f"a hit reused ≥ 25 % of its prompt; {short} shorter match{'' if short == 1 else 'es'}"
    )
    assert (
        page.texts["memory-detail"].startswith("≈ ")
        and "conversations" in page.texts["memory-detail"]
    )
    assert "refused (503)" in page.texts["queue-detail"]
    assert page.texts["cached-share"].strip() == f"{100 * totals['cached_share']:.1f} %"
    assert int(page.texts["cached-tokens"]) == totals["cached_tokens"] > 0
    # replies are prepared in the gaps between requests; the browser came later than status.json
    assert int(page.texts["prepared"]) >= data["counters"]["turns_prepared"]
    assert "L3 disk" in page.texts["tiers"] and "active" in page.texts["tiers"]
    assert "prefixes" in page.texts["tiers"]
    assert "l1" in page.texts["sources"] and "cold" in page.texts["sources"]
    assert page.texts["recent"].count("completions") == 3
    assert page.texts["recent"].count("chat") == 2
    assert "points=" in dom.stdout  # the chart was drawn
    # with its scale: 0 to 100 % on the y axis, the requests' times on the x axis
    chart = page.texts["chart"]
    for tick in ("0 %", "25 %", "50 %", "75 %", "100 %"):
        assert tick in chart
    assert "when each request finished (5 requests)" in chart
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
