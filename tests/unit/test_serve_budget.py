"""``skippy-llama serve``'s memory budget and bounded queue, without a model."""

from __future__ import annotations

import pytest

from skippy_llama.cli.serve import SERVE_L1_DEFAULTS, memory_budget_arg, serving_defaults
from skippy_llama.config import Settings, load_settings
from skippy_llama.errors import ConfigError
from skippy_llama.server.memory import (
    DEFAULT_BUDGET,
    SLOT_CAP,
    SLOT_FLOOR,
    available_memory,
    plan_memory,
)
from skippy_llama.server.queue import RequestQueue

GiB = 1 << 30
SMOLLM2 = 23_040  # K/V bytes per token of SmolLM2-135M with F16 K/V (30 x 3 x 2 x 64 x 2)


def test_the_default_budget_is_2gib_and_holds_many_conversations_of_n_ctx() -> None:
    plan = plan_memory(None, kv_bytes_per_token=SMOLLM2, n_ctx=2048, page_tokens=128,
                       available=64 * GiB)  # fmt: skip
    assert plan.budget_bytes == DEFAULT_BUDGET == 2 * GiB and plan.source == "default"
    assert plan.budget_tokens == 2 * GiB // SMOLLM2  # 93,206
    assert plan.conversations == 45  # of 2,048 tokens
    assert plan.max_prefixes == SLOT_CAP  # one slot per conversation, more for short ones
    assert plan.resident_bytes <= plan.budget_bytes
    assert "about 45 conversations of this length" in plan.describe()
    assert plan.to_json()["conversations"] == 45 and not plan.capped


def test_the_budget_is_capped_at_half_the_available_memory() -> None:
    plan = plan_memory(8 * GiB, kv_bytes_per_token=SMOLLM2, n_ctx=2048, page_tokens=128,
                       available=4 * GiB)  # fmt: skip
    assert plan.budget_bytes == 2 * GiB and plan.requested_bytes == 8 * GiB
    assert plan.capped and plan.source == "cli"
    assert "capped at 50%" in plan.describe()
    unknown = plan_memory(8 * GiB, kv_bytes_per_token=SMOLLM2, n_ctx=2048, page_tokens=128,
                          available=None)  # fmt: skip
    assert unknown.budget_bytes == 8 * GiB and not unknown.capped


def test_a_small_budget_keeps_the_slot_floor_and_counts_what_fits() -> None:
    plan = plan_memory(64 << 20, kv_bytes_per_token=SMOLLM2, n_ctx=2048, page_tokens=128,
                       available=None)  # fmt: skip
    assert plan.budget_tokens == (64 << 20) // SMOLLM2  # 2,912 tokens
    assert plan.conversations == 1
    assert plan.max_prefixes == SLOT_FLOOR == SERVE_L1_DEFAULTS["max_prefixes"]


def test_a_budget_below_one_page_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--memory-budget 1MiB holds 45 tokens.*at least 3MiB"):
        plan_memory(1 << 20, kv_bytes_per_token=SMOLLM2, n_ctx=2048, page_tokens=128,
                    available=None)  # fmt: skip


@pytest.mark.parametrize("text", ["2GB", "2048", "-1GiB", "lots"])
def test_memory_budget_needs_an_iec_size(text: str) -> None:
    with pytest.raises(ConfigError, match="--memory-budget"):
        memory_budget_arg(text)
    assert memory_budget_arg("512MiB") == 512 << 20 and memory_budget_arg(None) is None


def test_the_budget_sizes_l1_unless_a_setting_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SKIPPY_L1__MAX_PREFIXES", raising=False)
    monkeypatch.delenv("SKIPPY_L1__BUDGET_TOKENS", raising=False)
    plan = plan_memory(None, kv_bytes_per_token=SMOLLM2, n_ctx=2048, page_tokens=128,
                       available=None)  # fmt: skip
    served = serving_defaults(load_settings(), plan)
    l1 = served.settings.l1
    assert (l1.budget_tokens, l1.max_prefixes) == (plan.budget_tokens, plan.max_prefixes)
    assert served.sources["l1.budget_tokens"] == "serve default (default budget)"
    assert l1.repair_generated == "never"
    assert Settings().l1.budget_tokens is None  # the library's default does not change
    monkeypatch.setenv("SKIPPY_L1__BUDGET_TOKENS", "4096")
    told = serving_defaults(load_settings(), plan)
    assert told.settings.l1.budget_tokens == 4096 and told.sources["l1.budget_tokens"] == "env"
    assert told.settings.l1.max_prefixes == plan.max_prefixes
    resolved = plan.resolved(4096, plan.max_prefixes)
    assert resolved.overridden == ("l1.budget_tokens",) and resolved.conversations == 2
    assert "l1.budget_tokens set" in resolved.describe()


def test_available_memory_is_read_on_linux() -> None:
    free = available_memory()
    assert free is None or free > 0


def test_the_queue_admits_one_running_plus_max_queue_and_refuses_the_rest() -> None:
    queue = RequestQueue(2)
    tickets = [queue.enter() for _ in range(3)]
    assert all(t is not None for t in tickets)
    assert queue.enter() is None  # full: 1 running + 2 waiting
    status = queue.status()
    assert (status.inflight, status.admitted, status.rejected) == (3, 3, 1)
    first = tickets[0]
    assert first is not None
    first.release()
    first.release()  # a ticket goes back once, however often it is released
    assert queue.status().inflight == 2
    assert queue.enter() is not None and queue.enter() is None


def test_retry_after_grows_with_the_line_and_stays_bounded() -> None:
    queue = RequestQueue(100)
    assert queue.retry_after() == 1  # nothing measured, nobody ahead
    for _ in range(10):
        assert queue.enter() is not None
    queue.observe(2.0)
    assert queue.retry_after() == 20  # ten requests of about 2 s ahead
    queue.observe(100.0)
    assert queue.retry_after() == 60
    with pytest.raises(ValueError):
        RequestQueue(-1)
