"""The matrix's architecture-family rows (issue 46) on the synthetic recurrent and hybrid
models, with a real ``redis-server`` for the remote column: every tier serves the document from
a restore point and every answer equals a cold plain ``Llama`` bit for bit; the report renders
the rows; ``--families`` is checked before anything runs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("redis") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (redis) is not installed", allow_module_level=True)

from redisserver import RedisServer
from test_remote_tier import secret_file
from test_restore_points import PROMISED

from skippy_llama.cli.main import main
from skippy_llama.matrix.families import FAMILY_TIERS, available_families, run_families
from skippy_llama.matrix.report import families_markdown

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> dict[str, Any]:
    redis_server.reset()
    work = tmp_path_factory.mktemp("families")
    families = [f for f in available_families(work / "models") if f.name != "gemma3"]
    remote = (redis_server.url, secret_file(work))
    return run_families(families, work, remote=remote, say=lambda _: None)


def test_every_family_is_served_exactly_from_every_tier(report: dict[str, Any]) -> None:
    assert report["errors"] == []
    rows = report["rows"]
    families = {r["family"] for r in rows}
    assert families == {"mamba2", "qwen35", "granitehybrid", "lfm2"}
    for family in families:
        mine = {r["tier"]: r for r in rows if r["family"] == family}
        assert list(mine) == ["cold", *FAMILY_TIERS]
        assert all(r["exact"] is not False for r in mine.values()), mine
        if not PROMISED:
            continue
        assert mine["cold"]["served"] == "cold"
        # the document's prefill points (256, 512) and each prompt's end: 512 is the deepest
        # the next question shares; the l1 question after q1 finds it in the process
        for tier in FAMILY_TIERS:
            assert mine[tier]["exact"] is True, (family, tier)
            # a bundle is imported into L3, which serves it
            assert mine[tier]["served"] == ("l3" if tier == "bundle" else tier), (family, tier)
            assert mine[tier]["cached_tokens"] == 512, (family, tier)


def test_the_report_renders_the_family_rows(report: dict[str, Any]) -> None:
    text = "\n".join(families_markdown(report))
    assert "## Architecture families (restore points)" in text
    assert "| qwen35 |" in text and "| remote | remote |" in text
    assert families_markdown(None)[-1] == "Not run (pass `--families`)."


def test_families_flags_are_checked(tmp_path: Path) -> None:
    out = ["matrix", "--out", str(tmp_path / "out"), "--small"]
    assert main([*out, "--families", "mamba3"]) == 2
    assert main([*out, "--families", "mamba2", "--remote-url", "redis://x:1/0"]) == 2
