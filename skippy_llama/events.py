"""Typed results that cross layers: what one request got from the cache."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: a tier name: ``l1``, ``l2``, ``l3``, another tier's name (``remote`` ...) or ``cold``
Tier = str


@dataclass
class CacheEvent:
    """What the cache did for the latest request (``SkippyLlama.last_cache_event``).

    Attributes:
        tier: where the reused prefix came from: ``l1`` (live or resident sequence), ``l2``
            (host RAM), ``l3`` (disk) or ``cold`` (nothing reused).
        prompt_tokens: tokens in the prompt.
        cached_tokens: prompt tokens restored instead of prefilled.
        restored_bytes: state bytes loaded into the context (0 for L1 sequence copies).
        suffix_tokens: prompt tokens prefilled.
        l1_tokens / appended_tokens: for an L1 prefix continued by L2/L3 pages (append import,
            on a certified patched library), the tokens the L1 copy gave and those appended
            from pages; both 0 otherwise (``cached_tokens`` is their sum).
        repaired_tokens: generated tokens re-decoded as a batch after the reply, so that the next
            turn can reuse them bit-exactly (see ``l1.repair_generated``).
        park_ms: time spent keeping the previous prompt resident (and repairing its reply)
            before this one could use the working sequence.
        park_skipped: why the previous prompt was not kept resident although this one cut
            it (the tokens it lost are cheaper to prefill again than a park and a restore);
            None when nothing was cut or it was parked.
        lookup_ms / restore_ms / prefill_ms / ttft_ms: wall-clock timings of the steps.
        record_ms: wall-clock time the request spent after its last token recording the
            prompt for the record-taking tiers (choosing its new pages, capturing their cells
            and handing them to the L3 writer, which writes them off the request path); near 0
            when nothing is recorded (L3 off) or the record waits (GPU builds).
        fallbacks: reasons a deeper tier was tried and abandoned (fail-open), if any.
        codec: the codec of the cache identity whose pages a hit restored: ``native`` (exact)
            or ``cachegen/<version>`` (lossy: the restored cells are not bit-identical to a
            cold prefill's); the cache identity's ``codec_name``.
    """

    tier: Tier = "cold"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    restored_bytes: int = 0
    suffix_tokens: int = 0
    l1_tokens: int = 0
    appended_tokens: int = 0
    repaired_tokens: int = 0
    park_ms: float = 0.0
    park_skipped: str | None = None
    lookup_ms: float = 0.0
    restore_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    record_ms: float = 0.0
    fallbacks: list[str] = field(default_factory=list)
    codec: str = "native"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
