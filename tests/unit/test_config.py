"""Settings: every rejection names the field; precedence CLI > env > file > default per field."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from skippy_llama.cli.options import add_settings_arguments, settings_from_args
from skippy_llama.config import GiB, Settings, load_settings
from skippy_llama.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("SKIPPY_"):
            monkeypatch.delenv(name)


REJECTIONS = [
    # (overrides, field named in the message, fragment of the message)
    ({"l3": {"budget": "100"}}, "l3.budget", "bare numbers"),
    ({"l3": {"budget": "10GB"}}, "l3.budget", "'GB'"),
    ({"l3": {"budget": "0MiB"}}, "l3.budget", "greater than zero"),
    ({"l3": {"budget": "-1GiB"}}, "l3.budget", "IEC unit"),
    ({"l2": {"budget": "512"}}, "l2.budget", "IEC unit"),
    ({"l3": {"minimum_free": "0GiB"}}, "l3.minimum_free", "greater than zero"),
    ({"l3": {"directory": "relative/cache"}}, "l3.directory", "absolute"),
    ({"l3": {"mode": "fixed"}}, "l3.budget", "'fixed' needs l3.budget"),
    ({"l3": {"minimum_free": "512MiB"}}, "l3.minimum_free", "below the 1GiB floor"),
    ({"l3": {"mode": "sometimes"}}, "l3.mode", "sometimes"),
    ({"l3": {"compression": "lz4"}}, "l3.compression", "lz4"),
    ({"l1": {"repair_generated": "sometimes"}}, "l1.repair_generated", "sometimes"),
]


@pytest.mark.parametrize(
    ("value", "mode"),
    [("auto", "auto"), ("always", "always"), ("never", "never"), (True, "always"),
     (False, "never"), ("true", "always"), ("False", "never")],
)  # fmt: skip
def test_repair_generated_takes_modes_and_booleans(value: object, mode: str) -> None:
    assert load_settings({"l1": {"repair_generated": value}}).settings.l1.repair_generated == mode


def test_defaults_repair_chat_replies_and_compress_pages() -> None:
    settings = load_settings().settings
    assert settings.l1.repair_generated == "auto" and settings.l3.compression == "auto"


@pytest.mark.parametrize(("overrides", "field", "fragment"), REJECTIONS)
def test_rejections_name_the_field_and_value(
    overrides: dict[str, dict[str, str]], field: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides)
    message = str(info.value)
    assert field in message and fragment in message
    value = next(iter(next(iter(overrides.values())).values()))
    if field != "l3.budget" or "fixed" not in fragment:
        assert repr(value) in message or value in message


@pytest.mark.parametrize(
    ("env", "value", "field"),
    [
        ("SKIPPY_L3__BUDGET", "100", "l3.budget"),
        ("SKIPPY_L3__BUDGET", "10GB", "l3.budget"),
        ("SKIPPY_L3__DIRECTORY", "cache", "l3.directory"),
        ("SKIPPY_L3__MINIMUM_FREE", "100MiB", "l3.minimum_free"),
    ],
)
def test_rejections_from_env(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, field: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_settings()


def test_examples_of_valid_values_are_given() -> None:
    with pytest.raises(ConfigError, match=r"example of a valid value: '32GiB'"):
        load_settings({"l3": {"budget": "12"}})
    with pytest.raises(ConfigError, match=r"SKIPPY_L3__BUDGET=32GiB"):
        load_settings({"l3": {"mode": "fixed"}})


def test_defaults() -> None:
    loaded = load_settings()
    s = loaded.settings
    assert s.l3.mode == "off" and s.l3.minimum_free == 16 * GiB and s.l2.budget is None
    assert set(loaded.sources.values()) == {"default"}
    assert "l3.minimum_free" in loaded.sources and "l2.budget" in loaded.sources


def test_precedence_per_field(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "skippy.toml"
    config.write_text(
        'namespace = "file"\npage_tokens = 64\n\n[l3]\nmode = "auto"\nminimum_free = "2GiB"\n'
        'budget = "4GiB"\n'
    )
    monkeypatch.setenv("SKIPPY_NAMESPACE", "env")
    monkeypatch.setenv("SKIPPY_L3__MINIMUM_FREE", "3GiB")
    loaded = load_settings({"namespace": "cli"}, config_file=config)
    s = loaded.settings
    assert s.namespace == "cli" and loaded.sources["namespace"] == "cli"
    assert s.l3.minimum_free == 3 * GiB and loaded.sources["l3.minimum_free"] == "env"
    assert s.l3.mode == "auto" and loaded.sources["l3.mode"] == "file"
    assert s.page_tokens == 64 and loaded.sources["page_tokens"] == "file"
    assert s.l3.budget == 4 * GiB and loaded.sources["l3.budget"] == "file"
    assert loaded.sources["l3.directory"] == "default"
    assert loaded.config_file == config


def test_config_file_from_env_and_missing_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[l3]\nmode = "auto"\n')
    monkeypatch.setenv("SKIPPY_CONFIG", str(config))
    loaded = load_settings()
    assert loaded.settings.l3.mode == "auto" and loaded.sources["l3.mode"] == "file"
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(config_file=tmp_path / "missing.toml")


def test_settings_flags_only_given_flags_are_cli(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    monkeypatch.setenv("SKIPPY_L3__BUDGET", "8GiB")
    args = parser.parse_args(
        [
            "--l3-mode",
            "fixed",
            "--l3-dir",
            str(tmp_path),
            "--l2-budget",
            "1GiB",
            "--page-tokens",
            "32",
            "--l3-compression",
            "none",
            "--repair-generated",
            "never",
        ]
    )
    loaded = settings_from_args(args)
    s = loaded.settings
    assert (s.l3.mode, s.l3.directory, s.l2.budget, s.page_tokens) == ("fixed", tmp_path, GiB, 32)
    assert (s.l3.compression, s.l1.repair_generated) == ("none", "never")
    assert loaded.sources["l3.compression"] == loaded.sources["l1.repair_generated"] == "cli"
    assert loaded.sources["l3.mode"] == "cli" and loaded.sources["l3.directory"] == "cli"
    assert loaded.sources["l3.budget"] == "env" and s.l3.budget == 8 * GiB
    assert loaded.sources["l3.minimum_free"] == "default"
    bad = parser.parse_args(["--l3-minimum-free", "512MiB"])
    with pytest.raises(ConfigError, match=r"l3\.minimum_free"):
        settings_from_args(bad)


def test_l3_budget_below_floor_policy_and_trace_file() -> None:
    """Issue 15: an L3 budget under the 64 MiB floor is rejected at start-up naming l3.budget;
    l3.policy and l3.trace_file are validated and named too."""
    from skippy_llama.config import L3_BUDGET_FLOOR

    with pytest.raises(ConfigError, match=r"l3\.budget = '16MiB'.*below the 64MiB floor"):
        load_settings({"l3": {"mode": "fixed", "budget": "16MiB"}})
    ok = load_settings({"l3": {"mode": "fixed", "budget": "64MiB"}}).settings.l3
    assert ok.budget == L3_BUDGET_FLOOR and ok.policy == "reuse" and ok.trace_file is None
    with pytest.raises(ConfigError, match=r"l3\.policy = 'fifo'.*'reuse'"):
        load_settings({"l3": {"policy": "fifo"}})
    with pytest.raises(ConfigError, match=r"l3\.trace_file = 'trace\.jsonl'.*absolute"):
        load_settings({"l3": {"trace_file": "trace.jsonl"}})
    traced = load_settings({"l3": {"policy": "lru", "trace_file": "/tmp/t.jsonl"}})
    assert str(traced.settings.l3.trace_file) == "/tmp/t.jsonl"
    assert traced.sources["l3.policy"] == "cli"


def test_serve_keeps_a_prefix_per_conversation_and_skips_repairs_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from skippy_llama.cli.serve import SERVE_L1_DEFAULTS, serving_defaults

    monkeypatch.delenv("SKIPPY_L1__MAX_PREFIXES", raising=False)
    monkeypatch.delenv("SKIPPY_L1__REPAIR_GENERATED", raising=False)
    served = serving_defaults(load_settings())
    assert served.settings.l1.max_prefixes == SERVE_L1_DEFAULTS["max_prefixes"] > 4
    assert served.settings.l1.repair_generated == "never" != Settings().l1.repair_generated
    assert served.sources["l1.max_prefixes"] == served.sources["l1.repair_generated"]
    assert served.sources["l1.max_prefixes"] == "serve default"
    assert served.settings.l1.budget_tokens is None  # memory stays bounded by n_ctx tokens
    monkeypatch.setenv("SKIPPY_L1__MAX_PREFIXES", "3")
    monkeypatch.setenv("SKIPPY_L1__REPAIR_GENERATED", "always")
    told = serving_defaults(load_settings()).settings.l1
    assert (told.max_prefixes, told.repair_generated) == (3, "always")
    cli = serving_defaults(load_settings({"l1": {"max_prefixes": 5}}))
    assert cli.settings.l1.max_prefixes == 5


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_serve_refuses_a_negative_idle_repair_delay_before_loading_anything(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from skippy_llama.cli.main import main

    assert main(["serve", "--model", "/nonexistent.gguf", "--idle-repair-after", value]) == 2
    err = capsys.readouterr().err
    assert "--idle-repair-after" in err and "0 for off" in err
