"""Run a batch on a ``SkippyLlama``: prefix-sharing order, per-item output, progress, summary."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from ..runtime.llama import SkippyLlama
from .items import BatchItem
from .order import prefix_order
from .output import OutputFile
from .prefetch import NextItemPrefetch

#: prefills shorter than this say more about per-call overhead than about the prefill rate
MIN_RATE_TOKENS = 32


@dataclass
class BatchSummary:
    """What a batch did. ``est_cold_s`` adds back the prefill the reused tokens would have cost
    at the rate measured on this run's own prefills (None when no prefill was long enough)."""

    items: int
    already_done: int
    run: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    elapsed_s: float
    est_cold_s: float | None
    order: str

    @property
    def reused_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "reused_share": round(self.reused_share, 4)}

    def render(self) -> str:
        cold = "unknown" if self.est_cold_s is None else f"{self.est_cold_s:.1f} s"
        return (
            f"batch: {self.run} items run ({self.errors} failed), {self.already_done} already in "
            f"OUT, {self.items} in input; {self.prompt_tokens} prompt tokens, "
            f"{self.cached_tokens} reused ({100 * self.reused_share:.0f} %); "
            f"{self.elapsed_s:.1f} s (estimated without reuse: {cold}); order: {self.order}"
        )


class BatchProgress:
    """``batch [#####---] 12/50 reuse 83% ETA 0:42`` on stderr, in place on a terminal."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()

    def update(self, done: int, prompt_tokens: int, cached_tokens: int, label: str) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        eta = elapsed / done * (self.total - done) if done else 0.0
        width = 24
        filled = int(width * done / self.total)
        reuse = 100 * cached_tokens / prompt_tokens if prompt_tokens else 0.0
        line = (
            f"batch [{'#' * filled}{'-' * (width - filled)}] {done}/{self.total} "
            f"reuse {reuse:.0f}% ETA {int(eta // 60)}:{int(eta % 60):02d} {label}"
        )
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if done >= self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def order_items(llm: SkippyLlama, items: Sequence[BatchItem], keep_order: bool) -> list[int]:
    """Indices of ``items`` in run order (over all items, finished or not; see :mod:`.order`)."""
    if keep_order:
        return list(range(len(items)))
    keys = [llm.tokenize(item.order_text().encode("utf-8"), add_bos=False) for item in items]
    return prefix_order(keys)


def _call(llm: SkippyLlama, item: BatchItem, max_tokens: int, temperature: float) -> Any:
    kwargs: dict[str, Any] = {
        "max_tokens": item.max_tokens or max_tokens,
        "temperature": temperature if item.temperature is None else item.temperature,
    }
    if item.seed is not None:
        kwargs["seed"] = item.seed
    if item.prompt is not None:
        return llm.create_completion(item.prompt, **kwargs)
    return llm.create_chat_completion(messages=list(item.messages or ()), **kwargs)


def _output(item: BatchItem, result: Any) -> dict[str, Any]:
    # only what the model produced: a resumed batch then writes the same OUT as an
    # uninterrupted one (reuse differs between the two; it goes to the summary)
    choice = result["choices"][0]
    text = choice["text"] if item.prompt is not None else choice["message"]["content"]
    usage = result["usage"]
    return {
        "id": item.id,
        "text": text or "",
        "finish_reason": choice.get("finish_reason"),
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


def run_batch(
    llm: SkippyLlama,
    items: Sequence[BatchItem],
    out: OutputFile,
    *,
    keep_order: bool = False,
    max_tokens: int = 64,
    temperature: float = 0.0,
    progress: bool = True,
) -> BatchSummary:
    """Run every item not yet in ``out``, appending one record per item as it finishes.

    An item that fails gets ``{"id": ..., "error": "..."}`` and the batch goes on. With L2 and
    L3 on, the next item's stored pages are prefetched into L2 while an item runs
    (:mod:`.prefetch`).
    """
    done_ids = out.finished_ids({item.id for item in items})
    order = [i for i in order_items(llm, items, keep_order) if items[i].id not in done_ids]
    bar = BatchProgress(len(order), enabled=progress)
    started = time.perf_counter()
    prompt_tokens = cached_tokens = errors = 0
    rate_tokens, rate_ms, restore_ms = 0, 0.0, 0.0
    ahead = NextItemPrefetch(llm)
    try:
        for n, index in enumerate(order, start=1):
            item = items[index]
            ahead.wait()  # this item's own prefetch lands first: its request reads L2 then
            if n < len(order):
                # the next item's pages, while this one runs (less the prefix they share)
                ahead.start(items[order[n]], current=item)
            llm.last_cache_event = None
            try:
                record = _output(item, _call(llm, item, max_tokens, temperature))
            except Exception as exc:  # a failed item is recorded; the batch goes on
                errors += 1
                record = {"id": item.id, "error": f"{type(exc).__name__}: {exc}"}
            event = llm.last_cache_event
            if event is not None:
                prompt_tokens += event.prompt_tokens
                cached_tokens += event.cached_tokens
                restore_ms += event.restore_ms
                if event.suffix_tokens >= MIN_RATE_TOKENS:
                    rate_tokens += event.suffix_tokens
                    rate_ms += event.prefill_ms
            out.write(record)
            bar.update(n, prompt_tokens, cached_tokens, f"id {item.id}")
    finally:
        ahead.close()
        out.close()
    elapsed = time.perf_counter() - started
    est_cold = (
        elapsed + cached_tokens * rate_ms / rate_tokens / 1e3 - restore_ms / 1e3
        if rate_tokens
        else None
    )
    return BatchSummary(
        items=len(items),
        already_done=len(done_ids),
        run=len(order),
        errors=errors,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        elapsed_s=round(elapsed, 3),
        est_cold_s=None if est_cold is None else round(est_cold, 3),
        order="input" if keep_order else "prefix",
    )
