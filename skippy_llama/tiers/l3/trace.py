"""Opt-in trace of what L3 sees, as JSON lines, and its reader (pure: no diskcache, no model).

One line per lookup and one per record, written by the orchestrator when ``l3.trace_file`` (or the
``SKIPPY_TRACE`` environment variable) names a file. A trace must be safe to share, so it holds no
token ids and no text: only page keys (the first 8 bytes of each page's chained xxh3 key, which
depends on every token before it), token counts, page bytes, the live hit depth and the measured
costs. Pages are cut at page-aligned positions (``page_tokens``) on both lookups and records, so
the replay simulator matches a lookup against stored pages by key alone.

Line formats (``v`` is :data:`TRACE_VERSION`)::

    {"v":1,"ev":"lookup","t":..,"keys":[hex..],"tokens":[n..],"prompt_tokens":n,
     "hit_tokens":n,"tier":"l3","prefill_s_per_token":x|null,"restore_s_per_byte":x|null}
    {"v":1,"ev":"record","t":..,"keys":[hex..],"tokens":[n..],"bytes":[n..],"n_tokens":n}

``bytes`` are the serialized (uncompressed) page sizes, from the payload bytes per token learned
from the records this process captured. Models served from restore points (recurrent and hybrid,
issue 46) add ``"snapshot_bytes":n`` to a record (what the point at its end stores beside its
pages) and ``"points":true`` to a lookup (it is served only up to a page that ends at a stored
point); both are left out otherwise, so other traces read as before. A record line is written for every request that wants a
prefix recorded, also when L3 already holds it all (the live store then writes nothing, but a
replay under another policy may need the pages).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from ...costs import CostModel
from ...errors import ConfigError, SkippyError
from ...identity import chain_key
from .costs import TIER

TRACE_VERSION = 1
#: Hex characters kept of each 16-byte page key: 64 bits make a collision in a trace of a
#: billion pages unlikely (p ≈ 3 %), and a shorter key leaks less about the store it came from.
KEY_HEX = 16
#: ``SKIPPY_TRACE=FILE`` turns tracing on when ``l3.trace_file`` is not set.
TRACE_ENV = "SKIPPY_TRACE"


@dataclass(frozen=True)
class LookupEvent:
    """A prompt looked up in L3: its page-aligned chain (``keys``/``tokens`` per page)."""

    t: float
    keys: tuple[str, ...]
    tokens: tuple[int, ...]
    prompt_tokens: int
    hit_tokens: int = 0
    tier: str = "cold"
    prefill_s_per_token: float | None = None
    restore_s_per_byte: float | None = None
    #: served from restore points: only up to a page that ends where a point was stored
    points: bool = False


@dataclass(frozen=True)
class RecordEvent:
    """A prefix the runtime asked to record: its page-aligned chain and each page's bytes."""

    t: float
    keys: tuple[str, ...]
    tokens: tuple[int, ...]
    bytes: tuple[int, ...]
    n_tokens: int
    #: bytes of the restore point's snapshot at the end of the prefix (0: no restore point)
    snapshot_bytes: int = 0


TraceEvent = LookupEvent | RecordEvent


def page_keys(
    root: bytes, tokens: npt.NDArray[np.int32], n: int, page_tokens: int
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Keys (shortened hex) and token counts of the page-aligned chain of ``tokens[:n]``."""
    keys: list[str] = []
    counts: list[int] = []
    parent = root
    for start in range(0, max(n, 0), page_tokens):
        end = min(start + page_tokens, n)
        parent = chain_key(parent, tokens[start:end])
        keys.append(parent.hex()[:KEY_HEX])
        counts.append(end - start)
    return tuple(keys), tuple(counts)


def _line(event: TraceEvent) -> dict[str, Any]:
    line: dict[str, Any]
    if isinstance(event, LookupEvent):
        line = {
            "v": TRACE_VERSION,
            "ev": "lookup",
            "t": event.t,
            "keys": list(event.keys),
            "tokens": list(event.tokens),
            "prompt_tokens": event.prompt_tokens,
            "hit_tokens": event.hit_tokens,
            "tier": event.tier,
            "prefill_s_per_token": event.prefill_s_per_token,
            "restore_s_per_byte": event.restore_s_per_byte,
        }
        if event.points:
            line["points"] = True
        return line
    line = {
        "v": TRACE_VERSION,
        "ev": "record",
        "t": event.t,
        "keys": list(event.keys),
        "tokens": list(event.tokens),
        "bytes": list(event.bytes),
        "n_tokens": event.n_tokens,
    }
    if event.snapshot_bytes:
        line["snapshot_bytes"] = event.snapshot_bytes
    return line


def dumps(event: TraceEvent) -> str:
    """One trace line (no newline)."""
    return json.dumps(_line(event), separators=(",", ":"))


class TraceWriter:
    """Appends trace lines to a file; thread-safe, line-buffered, never raises on the hot path.

    A record line waits until its page bytes are known: the bytes per token come from the
    payloads :meth:`learn_payloads` sees, which the orchestrator reports right after planning.
    """

    def __init__(self, path: Path | str, page_tokens: int) -> None:
        self.path = Path(path)
        self.page_tokens = page_tokens
        self.bytes_per_token: float | None = None
        self.errors = 0
        self._lock = threading.Lock()
        self._pending: tuple[float, tuple[str, ...], tuple[int, ...], int] | None = None
        self._file: IO[str] | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        except OSError as exc:
            raise ConfigError(
                f"invalid setting l3.trace_file = {str(self.path)!r}: cannot open it for "
                f"appending ({exc.strerror}); give a writable file, e.g. /tmp/skippy-trace.jsonl"
            ) from None

    @classmethod
    def from_settings(cls, trace_file: Path | None, page_tokens: int) -> TraceWriter | None:
        """The writer ``l3.trace_file`` or, failing that, ``SKIPPY_TRACE`` asks for (or None)."""
        path = trace_file or (Path(os.environ[TRACE_ENV]) if os.environ.get(TRACE_ENV) else None)
        return None if path is None else cls(path, page_tokens)

    def _write(self, event: TraceEvent) -> None:
        if self._file is None:
            return
        try:
            self._file.write(dumps(event) + "\n")
        except (OSError, ValueError):
            self.errors += 1  # tracing is diagnostics: a full disk must not fail a request

    def _flush_pending(self) -> None:
        if self._pending is None:
            return
        t, keys, counts, n = self._pending
        self._pending = None
        per_token = self.bytes_per_token or 0.0
        sizes = tuple(math.ceil(c * per_token) for c in counts)
        self._write(RecordEvent(t, keys, counts, sizes, n))

    def lookup(
        self,
        root: bytes,
        tokens: npt.NDArray[np.int32],
        limit: int,
        hit_tokens: int,
        tier: str,
        costs: CostModel | None = None,
    ) -> None:
        """Trace a lookup of ``tokens[:limit]`` that the live tiers answered with ``hit_tokens``,
        with the cost model's current rates."""
        keys, counts = page_keys(root, tokens, limit, self.page_tokens)
        prefill = costs.prefill_seconds_per_token if costs is not None else None
        restore = costs.restore_rate(TIER) if costs is not None else None
        event = LookupEvent(
            time.time(), keys, counts, len(tokens), hit_tokens, tier, prefill, restore
        )
        with self._lock:
            self._flush_pending()
            self._write(event)

    def record(self, root: bytes, tokens: npt.NDArray[np.int32], point: int) -> None:
        """Trace the wish to record ``tokens[:point]`` (its bytes are filled in later)."""
        keys, counts = page_keys(root, tokens, point, self.page_tokens)
        with self._lock:
            self._flush_pending()
            self._pending = (time.time(), keys, counts, point)

    def point_lookup(
        self, root: bytes, tokens: npt.NDArray[np.int32], hit_tokens: int, tier: str
    ) -> None:
        """Trace a lookup served from restore points (``hit_tokens``: the point's depth)."""
        n = len(tokens) - 1  # the last prompt token is always decoded
        keys, counts = page_keys(root, tokens, n, self.page_tokens)
        event = LookupEvent(
            time.time(), keys, counts, len(tokens), hit_tokens, tier, None, None, True
        )
        with self._lock:
            self._flush_pending()
            self._write(event)

    def point_record(
        self, root: bytes, tokens: npt.NDArray[np.int32], page_bytes: int, snapshot_bytes: int
    ) -> None:
        """Trace a restore point after ``tokens``: ``page_bytes`` in all for its attention pages
        (0 when it is kept whole) and ``snapshot_bytes`` beside them."""
        keys, counts = page_keys(root, tokens, len(tokens), self.page_tokens)
        n = len(tokens)
        # at least a byte a page: the policies weigh a page's benefit per byte
        sizes = tuple(max(math.ceil(c * page_bytes / n), 1) for c in counts) if n else ()
        event = RecordEvent(time.time(), keys, counts, sizes, n, snapshot_bytes)
        with self._lock:
            self._flush_pending()
            self._write(event)

    def learn_payloads(self, payload_bytes: int, n_tokens: int) -> None:
        """Payload bytes of ``n_tokens`` freshly cut tokens: the bytes per token of this layout."""
        if n_tokens > 0 and payload_bytes > 0:
            with self._lock:
                self.bytes_per_token = payload_bytes / n_tokens

    def close(self) -> None:
        """Write a waiting record line and close the file (idempotent)."""
        with self._lock:
            self._flush_pending()
            if self._file is not None:
                self._file.close()
                self._file = None


class TraceFormatError(SkippyError, ValueError):
    """A trace line is not valid JSON of a known version and shape (names the line)."""


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f"{what} must be a list of non-negative integers")
    return tuple(value)


def _keys(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError("keys must be a list of non-empty strings")
    return tuple(value)


def _rate(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number or null")
    return float(value) if value >= 0 else None


def parse_line(raw: str) -> TraceEvent:
    """Parse one trace line; raises ValueError (with the reason) for anything malformed."""
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError("a trace line must be a JSON object")
    if obj.get("v") != TRACE_VERSION:
        raise ValueError(
            f"unknown trace version {obj.get('v')!r} (this build reads {TRACE_VERSION})"
        )
    t = _rate(obj.get("t"), "t")
    keys = _keys(obj.get("keys"))
    tokens = _ints(obj.get("tokens"), "tokens")
    if len(tokens) != len(keys):
        raise ValueError("keys and tokens differ in length")
    kind = obj.get("ev")
    if kind == "lookup":
        (prompt, hit) = _ints([obj.get("prompt_tokens"), obj.get("hit_tokens", 0)], "token counts")
        tier = obj.get("tier", "cold")
        if not isinstance(tier, str):
            raise ValueError("tier must be a string")
        points = obj.get("points", False)
        if not isinstance(points, bool):
            raise ValueError("points must be true or false")
        return LookupEvent(
            t or 0.0,
            keys,
            tokens,
            prompt,
            hit,
            tier,
            _rate(obj.get("prefill_s_per_token"), "prefill_s_per_token"),
            _rate(obj.get("restore_s_per_byte"), "restore_s_per_byte"),
            points,
        )
    if kind == "record":
        sizes = _ints(obj.get("bytes"), "bytes")
        if len(sizes) != len(keys):
            raise ValueError("keys and bytes differ in length")
        (n, snapshot) = _ints([obj.get("n_tokens"), obj.get("snapshot_bytes", 0)], "counts")
        return RecordEvent(t or 0.0, keys, tokens, sizes, n, snapshot)
    raise ValueError(f"unknown event {kind!r} (lookup or record)")


def read_trace(path: Path | str) -> Iterator[TraceEvent]:
    """Events of a trace file, in order.

    Raises:
        TraceFormatError: a line is malformed (the message names the file and line number).
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                yield parse_line(raw)
            except ValueError as exc:  # json.JSONDecodeError is a ValueError too
                raise TraceFormatError(f"{path}:{number}: {exc}") from None


def write_trace(path: Path | str, events: Sequence[TraceEvent]) -> None:
    """Write ``events`` as a trace file (synthetic traces, tests)."""
    with open(path, "w", encoding="utf-8") as handle:
        for event in events:
            handle.write(dumps(event) + "\n")
