"""``remote.codec = "cachegen"`` against a real ``redis-server`` (no mocks).

Model-free first (real page bytes from ``tests/unit/cachegen_pages.py``): a store of a lossy
identity sends CacheGen pages coded from L3's lossless ones (or L3's CacheGen pages as they are)
and reads them back within the codec's error bound; with ``remote.codec`` native it sends native
pages; a store of an exact identity never decodes a CacheGen page found under its keys (a counted
miss, deleted). Then SmolLM2 on the real request path: a lossy instance's pages reach the server
as CacheGen pages under its own identity, an exact instance sharing the server and its secret
answers cold, and a second lossy instance with an empty L3 restores the prefix from the server.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("redis") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (redis) is not installed", allow_module_level=True)
if importlib.util.find_spec("zstandard") is None and not os.environ.get("CI"):
    pytest.skip("the cachegen extra (zstandard) is not installed", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from cachegen_pages import make_page
from redisserver import RedisServer

from skippy_llama.codecs import cachegen, encode, stored_codec
from skippy_llama.codecs.cachegen import CacheGenParams
from skippy_llama.config import RemoteSettings, load_settings
from skippy_llama.identity import chain_key
from skippy_llama.tiers.l3.schema import Manifest
from skippy_llama.tiers.records import PageBlob, PrefixRecord
from skippy_llama.tiers.remote import RemoteStore
from skippy_llama.tiers.remote import codec as remote_codec

PARAMS = CacheGenParams((8, 6, 6), (8, 6, 6))
N_TOKENS = 32
ROOT = bytes(range(16))


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "remote.key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def _store(
    url: str, secret: Path, codec: str, lossy: CacheGenParams | None = PARAMS
) -> RemoteStore:
    settings = RemoteSettings(url=url, secret_file=secret, codec=codec)  # type: ignore[arg-type]
    return RemoteStore(settings, lossy=lossy)


def _record(
    n_pages: int = 3, *, l3_codec: str = "zstd"
) -> tuple[PrefixRecord, list[bytes], dict[bytes, bytes], list[bytes]]:
    """A record of real F16 pages: (record, keys, what L3 stored per key, native page bytes)."""
    parent, pages, keys, raws, stored = ROOT, [], [], [], {}
    for i in range(n_pages):
        page, _, _ = make_page(n_tokens=N_TOKENS, start=i * N_TOKENS, seed=i)
        raw = page.to_bytes()
        tokens = np.arange(i * N_TOKENS, (i + 1) * N_TOKENS, dtype=np.int32) + 11
        key = chain_key(parent, tokens)
        pages.append(PageBlob(key, parent, N_TOKENS, tokens.tobytes(), raw, N_TOKENS))
        stored[key] = (
            cachegen.encode(raw, PARAMS) if l3_codec == "cachegen" else encode(raw, "zstd")
        )
        keys.append(key)
        raws.append(raw)
        parent = key
    record = PrefixRecord(ROOT.hex(), "model", "synthetic", N_TOKENS * n_pages, tuple(pages))
    return record, keys, stored, raws


def _server_codecs(server: RedisServer, keys: list[bytes], store: RemoteStore) -> set[str]:
    client = server.client()
    try:
        values = [client.get(store.keys.page(ROOT.hex(), key)) for key in keys]
    finally:
        client.close()
    pages = [v for v in values if isinstance(v, bytes)]
    assert len(pages) == len(keys)
    return {stored_codec(v[remote_codec.HEADER_BYTES :]) for v in pages}


def _close(got: list[bytes], raws: list[bytes]) -> None:
    """Decoded pages: same size and header as the native ones, values within the codec's
    error bound (F16 rounding of the result aside)."""
    assert len(got) == len(raws)
    for page, raw in zip(got, raws, strict=True):
        assert len(page) == len(raw) and page[:64] == raw[:64]
        bound = cachegen.error_bound(cachegen.encode(raw, PARAMS))
        head = len(raw) - 6 * 2 * N_TOKENS * 64 * 2  # 6 layers, K and V, 64 F16 channels
        a = np.frombuffer(page, np.float16, offset=head).astype(np.float32)
        b = np.frombuffer(raw, np.float16, offset=head).astype(np.float32)
        assert np.abs(a - b).max() <= bound + np.abs(b).max() * 2.0**-10


def test_a_lossy_identity_sends_cachegen_pages_and_reads_them_back(
    redis_clean: RedisServer, secret: Path
) -> None:
    record, keys, stored, raws = _record()
    with _store(redis_clean.url, secret, "cachegen") as store:
        pushed = store.push(record, stored=stored)
        assert pushed.pages_sent == 3 and pushed.manifest_sent
        assert _server_codecs(redis_clean, keys, store) == {"cachegen/1"}
        # fewer bytes on the wire than the lossless pages L3 holds
        assert pushed.bytes_sent < sum(len(v) for v in stored.values())
        got = store.fetch(keys, root=ROOT)
        _close(got, raws)
        activity = store.status()["activity"]
        assert activity["cachegen_pages_sent"] == 3 and activity["cachegen_pages_fetched"] == 3
        # the server's manifest names the codec, as L3's do
        name = store.keys.manifest(ROOT.hex(), record.manifest_id)
        client = redis_clean.client()
        try:
            value = client.get(name)
        finally:
            client.close()
        assert isinstance(value, bytes)
        frame = remote_codec.unpack(store._signer, name, remote_codec.KIND_MANIFEST, value)
        assert Manifest.unpack(bytes(frame.body), record.manifest_id).codec == "cachegen/1"
        assert store.server_status()["inventory"][ROOT.hex()]["codecs"] == {"cachegen/1": 1}
        assert store.status()["codec"]["sends"] == "cachegen"


def test_l3_cachegen_pages_are_sent_as_they_are(redis_clean: RedisServer, secret: Path) -> None:
    record, keys, stored, raws = _record(l3_codec="cachegen")
    with _store(redis_clean.url, secret, "cachegen") as store:
        pushed = store.push(record, stored=stored)
        assert pushed.bytes_sent == sum(len(v) + remote_codec.HEADER_BYTES for v in stored.values())
        assert store.status()["activity"]["cachegen_pages_sent"] == 0  # nothing re-coded
        _close(store.fetch(keys, root=ROOT), raws)


def test_remote_codec_native_sends_native_pages_of_a_lossy_identity(
    redis_clean: RedisServer, secret: Path
) -> None:
    """A lossy identity (l3.codec qualified it) whose remote.codec is native: L3's CacheGen
    pages travel decoded (native, lossless), and read back as the values L3 holds."""
    record, keys, stored, _ = _record(l3_codec="cachegen")
    with _store(redis_clean.url, secret, "native") as store:
        store.push(record, stored=stored)
        assert _server_codecs(redis_clean, keys, store) == {"native"}
        got = store.fetch(keys, root=ROOT)
        assert got == [bytes(cachegen.decode(stored[key], N_TOKENS)) for key in keys]


def test_an_exact_identity_never_reads_a_cachegen_page(
    redis_clean: RedisServer, secret: Path
) -> None:
    record, keys, stored, raws = _record()
    with _store(redis_clean.url, secret, "cachegen") as lossy:
        lossy.push(record, stored=stored)
    # the same keys read by a store of an exact identity (a bug or a forged write could put a
    # lossy page there): a miss, counted, and the value deleted so an exact push replaces it
    with _store(redis_clean.url, secret, "cachegen", lossy=None) as exact:
        assert exact.status()["codec"]["sends"] == "native"  # no lossy identity: native
        assert exact.fetch(keys, root=ROOT) == []
        assert exact.status()["bad_values"] == {"codec_mismatch": 1}
        assert exact.status()["activity"]["bad_values_deleted"] == 1
        exact_record, _, exact_stored, _ = _record()
        exact.push(exact_record, stored=exact_stored)
        assert exact.fetch(keys[:1], root=ROOT) == raws[:1]  # exact bytes again


def test_remote_codec_setting_is_fail_closed(secret: Path) -> None:
    assert load_settings().settings.remote.codec == "native"
    url = "redis://127.0.0.1:1/0"
    got = load_settings({"remote": {"url": url, "secret_file": str(secret), "codec": "cachegen"}})
    assert got.settings.remote.codec == "cachegen"
    from skippy_llama.errors import ConfigError

    with pytest.raises(ConfigError, match=r"remote\.codec"):
        load_settings({"remote": {"url": url, "secret_file": str(secret), "codec": "lossy"}})


# ------------------------------------------------------------------ SmolLM2, the request path

DOC = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had done before him. There were one hundred and twelve of them, worn smooth "
    "in the middle by generations of boots. At the top he trimmed the wick, polished the great "
    "lens until it shone, and wound the clockwork that turned the light. "
) * 6
PROMPT = DOC + "In the logbook that night the keeper wrote that"


def _plant_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A passing cachegen row for whatever model and layout asks (a test's roster)."""
    from skippy_llama.roster import CacheGenRow
    from skippy_llama.runtime import identity_params

    class Qualified:
        def cachegen_row(self, digest: str, backend: str, layout: str) -> CacheGenRow:
            return CacheGenRow(
                "test", digest, backend, layout, "F16", "F16", False, PARAMS.identity(),
                {"argmax_agree": 1.0, "mean_kl": 0.0, "ppl_rise": 0.0, "size_ratio": 0.4},
            )  # fmt: skip

    monkeypatch.setattr(identity_params, "load_roster", lambda: Qualified())


def _node(model: Path, store: Path, url: str, secret: Path, codec: str):  # type: ignore[no-untyped-def]
    from skippy_llama.config import Settings
    from skippy_llama.costs import AlwaysRestore
    from skippy_llama.runtime.llama import SkippyLlama

    settings = Settings(
        l1={"enabled": False},
        l3={"mode": "fixed", "budget": "1GiB", "directory": str(store), "minimum_free": "1GiB"},
        remote={"url": url, "secret_file": str(secret), "codec": codec, "timeout_ms": 2000},
    )
    # restores forced: a GPU build's measured costs may prefill this short prompt instead
    return SkippyLlama(
        str(model), n_ctx=1024, verbose=False, cache_settings=settings, cost_model=AlwaysRestore()
    )


@pytest.mark.model
@pytest.mark.slow  # three model loads and two prefills: about 20 s on a loaded 2-core machine
def test_lossy_nodes_share_cachegen_pages_and_an_exact_node_never_reads_them(
    redis_clean: RedisServer,
    tmp_path: Path,
    smollm2_path: Path,
    secret: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from skippy_llama.codecs import select

    exact = _node(smollm2_path, tmp_path / "exact", redis_clean.url, secret, "native")
    _plant_row(monkeypatch)
    lossy_a = _node(smollm2_path, tmp_path / "a", redis_clean.url, secret, "cachegen")
    lossy_c = None
    try:
        assert exact.cache_identity.codec_name == "native"
        assert lossy_a.cache_identity.codec_name == "cachegen/1"
        assert lossy_a.cache_identity.root != exact.cache_identity.root
        lossy_a.create_completion(PROMPT, max_tokens=1)
        assert lossy_a.flush_cache(120)
        status = lossy_a.prefix_cache.status()["remote"]
        assert status["codec"]["sends"] == "cachegen"
        assert status["activity"]["cachegen_pages_sent"] >= 2
        # A's L3 keeps lossless pages (l3.codec native): only the wire is coded
        disk = lossy_a.prefix_cache.disk
        assert disk is not None and disk._parts.counters.get("cachegen_pages") == 0
        client = redis_clean.client()
        try:
            names = [n for n in client.scan_iter(count=1000) if client.type(n) == b"string"]
            values = [client.get(n) for n in names]
        finally:
            client.close()
        pages = [v for v in values if isinstance(v, bytes) and v[5] == remote_codec.KIND_PAGE]
        codecs = {stored_codec(memoryview(v)[remote_codec.HEADER_BYTES :]) for v in pages}
        assert codecs == {"cachegen/1"}  # every page on the server: CacheGen

        # an exact node on the same server and secret: its identity has no pages there (cold)
        exact.create_completion(PROMPT, max_tokens=1)
        event = exact.last_cache_event
        assert event is not None and event.tier == "cold" and event.cached_tokens == 0

        # a second lossy node with an empty L3 restores the prefix from the server
        lossy_c = _node(smollm2_path, tmp_path / "c", redis_clean.url, secret, "cachegen")
        lossy_c.create_completion(PROMPT, max_tokens=1)
        event = lossy_c.last_cache_event
        assert event is not None and event.tier == "remote" and event.cached_tokens >= 2 * 128
        assert event.codec == "cachegen/1"
        remote = lossy_c.prefix_cache.status()["remote"]["activity"]
        assert remote["cachegen_pages_fetched"] >= 2
    finally:
        for llm in (exact, lossy_a, lossy_c):
            if llm is not None:
                llm.close()
        select.register(lossy_a.cache_identity.hex, None)
