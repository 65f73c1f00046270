"""The remote tier's settings (``remote.*``): off by default, fail-closed, every rejection names
the field; ``serve``, ``batch``, ``run`` and ``kv-cache`` take them as flags like every other."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from skippy_llama.cli.main import build_parser
from skippy_llama.cli.options import add_settings_arguments, settings_from_args
from skippy_llama.config import load_settings
from skippy_llama.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SKIPPY_"):
            monkeypatch.delenv(name)


KEY = "/etc/skippy-llama/remote.key"

REJECTIONS = [
    # (remote overrides, field named in the message, fragment of the message)
    ({"url": "http://cache:6379/0", "secret_file": KEY}, "remote.url", "scheme 'http'"),
    ({"url": "redis:///0", "secret_file": KEY}, "remote.url", "names no host"),
    ({"url": "redis://cache:99999/0", "secret_file": KEY}, "remote.url", "does not parse"),
    ({"url": "redis://cache:6379/zero", "secret_file": KEY}, "remote.url", "not a number"),
    ({"url": "redis://cache/0?ssl=1", "secret_file": KEY}, "remote.url", "unknown query"),
    ({"url": "unix://relative.sock", "secret_file": KEY}, "remote.url", "absolute socket"),
    ({"url": "redis://cache:6379/0"}, "remote.secret_file", "is not"),
    ({"secret_file": "remote.key"}, "remote.secret_file", "absolute"),
    ({"timeout_ms": 0}, "remote.timeout_ms", "greater than or equal to 1"),
    ({"namespace": "a:b"}, "remote.namespace", "letters, digits"),
    ({"namespace": "skippy*"}, "remote.namespace", "letters, digits"),
    ({"ttl": 0}, "remote.ttl", "greater than or equal to 1"),
    ({"breaker_failures": 0}, "remote.breaker_failures", "greater than or equal to 1"),
    ({"breaker_backoff_s": 0}, "remote.breaker_backoff_s", "greater than 0"),
    ({"hosts": "a,b"}, "remote.hosts", "Extra inputs"),
]


@pytest.mark.parametrize(("overrides", "field", "fragment"), REJECTIONS)
def test_rejections_name_the_field(overrides: dict[str, object], field: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"remote": overrides})
    message = str(info.value)
    assert field in message and fragment in message


def test_off_by_default() -> None:
    remote = load_settings().settings.remote
    assert remote.url is None and not remote.enabled and remote.namespace == "skippy"


@pytest.mark.parametrize(
    "url",
    ["redis://cache:6379/0", "redis://:pw@cache/3", "rediss://cache:6380", "unix:///run/r.sock",
     "unix:///run/r.sock?db=2"],
)  # fmt: skip
def test_accepted_urls(url: str) -> None:
    remote = load_settings({"remote": {"url": url, "secret_file": KEY}}).settings.remote
    assert remote.url == url and remote.enabled


def test_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKIPPY_REMOTE__URL", "redis://from-env:6379/0")
    monkeypatch.setenv("SKIPPY_REMOTE__SECRET_FILE", KEY)
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    args = parser.parse_args(["--remote-ttl", "600", "--remote-namespace", "team-a"])
    loaded = settings_from_args(args)
    remote = loaded.settings.remote
    assert (remote.url, str(remote.secret_file)) == ("redis://from-env:6379/0", KEY)
    assert (remote.ttl, remote.namespace) == (600, "team-a")
    assert loaded.sources["remote.url"] == "env" and loaded.sources["remote.ttl"] == "cli"
    bad = parser.parse_args(["--remote-timeout-ms", "-5"])
    with pytest.raises(ConfigError, match=r"remote\.timeout_ms"):
        settings_from_args(bad)


@pytest.mark.parametrize("command", ["serve", "batch", "run"])
def test_serve_batch_and_run_take_the_remote_flags(command: str, tmp_path: Path) -> None:
    required = {"serve": ["--model", "m.gguf"], "batch": ["in.jsonl", "out.jsonl"], "run": []}
    argv = [command, *required[command], "--remote-url", "redis://cache:6379/0"]
    argv += ["--remote-secret-file", str(tmp_path / "k"), "--remote-timeout-ms", "100"]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:  # a command needing other positionals: say which
        pytest.fail(f"{command} rejected {argv}")
    remote = settings_from_args(args).settings.remote
    assert remote.url == "redis://cache:6379/0" and remote.timeout_ms == 100
