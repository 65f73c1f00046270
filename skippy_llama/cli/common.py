"""What several ``kv-cache`` commands share: opening L3 to change it, asking before a change,
and checking that an optional package is installed."""

from __future__ import annotations

import importlib.util
import sys

from ..config import LoadedSettings
from ..errors import ConfigError, SkippyError
from ..tiers.disk import DiskTier

#: How to install the optional packages of the handoff and ``--remote`` commands.
EXTRA_HINT = "pip install 'skippy-llama[remote]'"


def need(module: str) -> None:
    """Raise ConfigError naming the extra when ``module`` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"this command needs the {module!r} package: {EXTRA_HINT}")


def open_l3_for_change(loaded: LoadedSettings, what: str) -> DiskTier:
    """The L3 store of the settings, for a command that changes it (``what``: prune, clear,
    import ...); ConfigError when L3 is off or its storage is unavailable."""
    l3 = loaded.settings.l3
    if l3.mode == "off":
        source = loaded.sources.get("l3.mode", "default")
        raise ConfigError(
            f"L3 is off (l3.mode = 'off', from {source}): nothing to {what}; pass --l3-mode "
            "auto (or fixed with --l3-budget) and --l3-dir, or set SKIPPY_L3__MODE"
        )
    tier = DiskTier(l3, close_at_exit=False)
    if tier.state == "degraded" and tier.reason == "storage_unavailable":
        tier.close()
        raise ConfigError(
            f"cannot {what}: L3 storage at {l3.directory} is unavailable: {tier.error}"
        )
    return tier


def confirm(question: str, yes: bool) -> bool:
    """True to go ahead. Without --yes, ask on a terminal; refuse when there is none."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise SkippyError(
            f"{question.rstrip('?')}: needs confirmation; stdin is not a terminal, pass --yes"
        )
    try:
        answer = input(f"{question} [y/N] ")
    except EOFError:
        answer = ""
    return answer.strip().lower() in ("y", "yes")
