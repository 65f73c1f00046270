"""The L3 status report that ``kv-cache status --json`` prints and ``/v1/kv-cache/status`` serves."""

from __future__ import annotations

from typing import Any

from ...config import LoadedSettings, redact_url
from ..records import DiskStatus
from .tier import DiskTier

__all__ = ["configured", "status_report"]


def configured(loaded: LoadedSettings) -> dict[str, dict[str, Any]]:
    """Every settings field as ``{"l3.mode": {"value": "fixed", "source": "cli"}, ...}``."""
    dumped = loaded.settings.model_dump(mode="json")
    out: dict[str, dict[str, Any]] = {}
    for name, source in sorted(loaded.sources.items()):
        value: Any = dumped
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if name == "remote.url" and isinstance(value, str):
            value = redact_url(value)  # a password in the URL is not printed
        out[name] = {"value": value, "source": source}
    return out


def status_report(loaded: LoadedSettings, status: DiskStatus, tier: DiskTier) -> dict[str, Any]:
    """The ``status --json`` object: configured, effective, usage, activity, reconciliation,
    inventory, the page codec (plus this process's activity, empty for the CLI)."""
    body = status.to_json()
    body["effective"]["mode"] = loaded.settings.l3.mode
    if tier.error:
        body["effective"]["detail"] = tier.error
    return {
        "configured": configured(loaded),
        "config_file": str(loaded.config_file) if loaded.config_file else None,
        **body,
        "codec": tier.codec_summary(),
    }
