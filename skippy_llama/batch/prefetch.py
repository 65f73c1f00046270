"""Prefetch the next batch item's L3 pages into L2 while the current item runs.

The trie order (:mod:`.order`) says which prompt comes next, so while item *i* decodes, a
background thread copies item *i + 1*'s stored pages from L3 into L2
(:meth:`~skippy_llama.cache.PrefixCache.prefetch`, which touches neither llama.cpp nor the
working sequence); item *i + 1* then restores from RAM. Only with L2 and L3 both on. One
prefetch is outstanding at most: the next item's request waits for its own prefetch to land
rather than reading the same pages beside it. Outputs never change: a prefetch only decides
which tier serves pages that would be restored anyway.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..prefetch import PrefetchResult
from ..runtime.llama import SkippyLlama
from ..runtime.prompt_tokens import chat_tokens, completion_tokens
from ..tiers.base import common_prefix
from .items import BatchItem

log = logging.getLogger("skippy_llama")


def item_tokens(llm: SkippyLlama, item: BatchItem) -> list[int] | None:
    """The tokens ``item``'s request will prefill, or None where they cannot be told ahead
    (a chat whose template is not the model's own)."""
    if item.prompt is not None:
        return completion_tokens(llm, item.prompt)
    return chat_tokens(llm, list(item.messages or ()))


class NextItemPrefetch:
    """A background thread that prefetches one item ahead (a no-op unless the cache can
    prefetch: ``PrefixCache.can_prefetch``, L2 over L3 or the remote tier).

    Use as a context manager: leaving it cancels an unfinished prefetch (between L3 reads) and
    joins the thread.
    """

    def __init__(self, llm: SkippyLlama) -> None:
        self.llm = llm
        self.enabled = llm.caching and llm.prefix_cache.can_prefetch
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="skippy-prefetch") if self.enabled else None
        )
        self._pending: Future[PrefetchResult] | None = None
        self._cancel = threading.Event()
        #: what every finished prefetch did, in order
        self.results: list[PrefetchResult] = []

    def start(self, item: BatchItem, current: BatchItem | None = None) -> None:
        """Prefetch ``item``'s pages in the background (tokenized here, on the caller's thread:
        the thread itself never calls into llama.cpp), less those of the prefix it shares with
        ``current`` (the item about to run): the live sequence will hold them."""
        if self._pool is None:
            return
        self.wait()
        try:
            tokens = item_tokens(self.llm, item)
            live = item_tokens(self.llm, current) if current is not None else None
        except Exception as exc:  # the item's own request reports a prompt it cannot tokenize
            log.debug("skippy-llama: no prefetch for item %s (%s)", item.id, exc)
            return
        if tokens:
            self._pending = self._pool.submit(
                self.llm.prefix_cache.prefetch,
                tokens,
                stop=self._cancel.is_set,
                skip=common_prefix(np.asarray(tokens), np.asarray(live or [])),
            )

    def wait(self) -> None:
        """Wait for the outstanding prefetch, if any (it never raises)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.results.append(pending.result())

    def close(self) -> None:
        """Cancel the outstanding prefetch at its next L3 read and join the thread."""
        if self._pool is None:
            return
        self._cancel.set()
        self.wait()
        self._pool.shutdown(wait=True)
        self._pool = None

    def __enter__(self) -> NextItemPrefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
