"""Two nodes, one server: a document SmolLM2 prefilled on node A restores on node B through the
remote tier, with output equal to a cold run.

The request path does not consult the remote tier yet (the planner wires it); this test does by
hand what it will do, so the storage half is proven end to end on real K/V: A's writer pushes
the prefix L3 recorded; B matches its own prompt's chain keys (computed from B's own cache
identity), fetches and verifies the pages, promotes them into its own L3, and restores.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("redis") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (redis) is not installed", allow_module_level=True)

from redisserver import RedisServer

from skippy_llama.config import L3Settings, RemoteSettings, Settings
from skippy_llama.handoff.l3 import prefix_record, read_prefix
from skippy_llama.identity import page_keys, token_bytes
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.records import PageBlob, PrefixRecord
from skippy_llama.tiers.remote import RemoteTier

pytestmark = pytest.mark.model

DOC = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had done before him. There were one hundred and twelve of them, worn smooth "
    "in the middle by generations of boots. At the top he trimmed the wick, polished the great "
    "lens until it shone, and wound the clockwork that turned the light. Ships far out at sea "
    "watched for its pulse: two long flashes and one short, the signature of this rock and no "
    "other. "
) * 3
PROMPT = DOC + "In the logbook that night the keeper wrote that"


def l3(directory: Path) -> L3Settings:
    return L3Settings(mode="fixed", budget="1GiB", directory=directory, minimum_free="1GiB")


def test_node_b_restores_node_a_document_from_the_remote_tier(
    redis_clean: RedisServer, tmp_path: Path, smollm2_path: Path
) -> None:
    import llama_cpp

    from skippy_llama.runtime.llama import SkippyLlama

    secret = tmp_path / "remote.key"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    remote = RemoteSettings(url=redis_clean.url, secret_file=secret)

    def complete(directory: Path) -> tuple[str, object, bytes, list[int], int]:
        llm = SkippyLlama(
            str(smollm2_path),
            n_ctx=1024,
            verbose=False,
            cache_settings=Settings(l3=l3(directory)),
        )
        try:
            done = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)
            tokens = llm.tokenize(PROMPT.encode())
            page_tokens = llm.prefix_cache.page_tokens
            return (
                str(done["choices"][0]["text"]),
                llm.last_cache_event,
                llm.prefix_cache.root,
                tokens,
                page_tokens,
            )
        finally:
            llm.close()

    cold = llama_cpp.Llama(str(smollm2_path), n_ctx=1024, verbose=False)
    try:
        reference = str(
            cold.create_completion(PROMPT, max_tokens=8, temperature=0.0)["choices"][0]["text"]
        )
    finally:
        cold.close()

    # node A: prefill, L3 records; its writer pushes what L3 stored
    store_a, store_b = tmp_path / "a", tmp_path / "b"
    out_a, _, root_a, _, _ = complete(store_a)
    with DiskTier(l3(store_a), reconcile=False, close_at_exit=False) as disk_a:
        manifests = disk_a._tree.manifests()[0]
        assert manifests
        records = [prefix_record(man, read_prefix(disk_a, man)) for man in manifests]
    with RemoteTier(remote) as node_a:
        sent = [node_a.push(record) for record in records]
        assert sum(result.pages_sent for result in sent) > 0
        assert all(
            result.pages_sent + result.pages_present == len(r.pages)
            for result, r in zip(sent, records, strict=True)
        )
        assert all(node_a.push(record).bytes_sent == 0 for record in records)  # a repeat: 0 bytes

    # node B: its own identity and prompt give the keys; match, fetch, promote into its L3
    llm_b = SkippyLlama(
        str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=Settings(l3=l3(store_b))
    )
    try:
        root_b = llm_b.prefix_cache.root
        page_tokens = llm_b.prefix_cache.page_tokens
        tokens = llm_b.tokenize(PROMPT.encode())
    finally:
        llm_b.close()
    assert root_b == root_a  # same model, layout, backend and settings: the same identity
    keys = page_keys(root_b, tokens, page_tokens)
    with RemoteTier(remote, identity=root_b) as node_b:
        depth = node_b.match(root_b, keys)
        assert depth >= 2
        pages = node_b.fetch(keys[:depth])
        assert len(pages) == depth
        status = node_b.status()
        assert status["activity"]["bytes_in"] > 0 and not status["bad_values"]
    parents = [root_b, *keys[: depth - 1]]
    blobs = tuple(
        PageBlob(
            key,
            parent,
            page_tokens,
            token_bytes(tokens[i * page_tokens : (i + 1) * page_tokens]),
            page,
            page_tokens,
        )
        for i, (key, parent, page) in enumerate(zip(keys[:depth], parents, pages, strict=True))
    )
    record = PrefixRecord(
        root_b.hex(), records[0].model_identity, records[0].model_name, depth * page_tokens, blobs
    )
    with DiskTier(l3(store_b), reconcile=False, close_at_exit=False) as disk_b:
        assert disk_b.record(record) and disk_b.flush(60)
    out_b, event, _, _, _ = complete(store_b)
    assert out_a == out_b == reference
    assert event is not None
    assert event.tier == "l3" and event.cached_tokens >= depth * page_tokens  # type: ignore[attr-defined]
