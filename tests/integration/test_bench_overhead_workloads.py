"""The overhead benchmark's workload builders make prompts of the sizes it claims (real tokenizer)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import llama_cpp
import pytest

pytestmark = pytest.mark.model

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_overhead.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_overhead", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_workloads_have_the_stated_sizes_and_no_shared_prefix(smollm2_path: Path) -> None:
    bench = _bench()
    vocab = llama_cpp.Llama(str(smollm2_path), vocab_only=True, verbose=False)

    def tokenize(text: str) -> list[int]:
        return list(vocab.tokenize(text.encode(), add_bos=False, special=False))

    sizes = bench.SIZES
    messages = bench.chat_messages(tokenize, sizes.chat_turns)
    assert len(messages) == sizes.chat_turns
    for message in messages:
        assert sizes.user_tokens <= len(tokenize(message)) <= sizes.user_tokens + 40
    # the whole chat (user messages and replies) grows past 3,000 tokens at the full size
    if not bench.QUICK:
        assert (
            sum(len(tokenize(m)) for m in messages) + sizes.chat_turns * sizes.reply_tokens > 3000
        )

    docs = [tokenize(d) for d in bench.documents(tokenize)]
    assert len(docs) == sizes.documents
    assert all(sizes.document_tokens <= len(d) <= sizes.document_tokens + 40 for d in docs)
    firsts = {d[0] for d in docs}
    assert len(firsts) == len(docs), "one-shot documents must not share a prefix"

    parts = bench.continuation_parts(tokenize)
    assert len(parts) == 1 + sizes.continuations
    assert len(tokenize(parts[0])) >= sizes.long_prompt_tokens
    assert all(len(tokenize(p)) <= sizes.continuation_tokens + 40 for p in parts[1:])
