"""IEC byte sizes (``512MiB``, ``32GiB``): parsing and formatting.

Bare numbers and decimal units (``GB``) are rejected on purpose: a cache budget off by a factor of
1,000 or 1,073,741,824 is the kind of mistake that fills a disk.
"""

from __future__ import annotations

import re

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)\s*$")


def parse_size(text: object) -> int:
    """Parse an IEC size string into bytes.

    Raises:
        ValueError: the text is not a positive number followed by B, KiB, MiB, GiB or TiB.
    """
    if isinstance(text, bool) or not isinstance(text, str):
        raise ValueError(
            f"size {text!r} needs an explicit IEC unit (B, KiB, MiB, GiB, TiB), e.g. '512MiB'"
        )
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(
            f"size {text!r} is not a number with an IEC unit (B, KiB, MiB, GiB, TiB), "
            "e.g. '512MiB' or '32GiB'; bare numbers and decimal units like 'GB' are rejected"
        )
    value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise ValueError(f"size {text!r} must be greater than zero, e.g. '512MiB'")
    return value


def format_size(n_bytes: int) -> str:
    """Format bytes as the largest IEC unit that divides them exactly (``format_size(2**30) == '1GiB'``)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit]
        if n_bytes and n_bytes % scale == 0:
            return f"{n_bytes // scale}{unit}"
    return f"{n_bytes}B"


def human_size(n_bytes: float) -> str:
    """Format bytes approximately for people (``'1.5 MiB'``)."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
