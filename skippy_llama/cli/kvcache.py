"""Placeholder: filled in by its own issue's work."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    """Register the `kvcache` subcommand (not built yet)."""
    del sub
