"""L3 with the CacheGen codec: pages of a CacheGen identity are encoded by the writer and read back
as native page bytes; an exact identity never reaches them; a payload of an unknown codec
version is a counted miss; ``l3.codec = "cachegen"`` without a qualified codec stores native
pages (counted)."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cachegen_pages import make_page, values_of
from test_tier_disk import settings

from skippy_llama.codecs import cachegen, select, stored_codec
from skippy_llama.codecs.cachegen import CacheGenParams
from skippy_llama.identity import CacheIdentity, ModelIdentity, chain_key, page_keys
from skippy_llama.state import page_from_bytes
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.l3.schema import DATA, MAN, META, Manifest
from skippy_llama.tiers.l3.tree import payload_digest
from skippy_llama.tiers.records import PageBlob, PrefixRecord

PARAMS = CacheGenParams((6, 5), (6, 5), group_tokens=32)
N_TOKENS = 64


def _identity(**codec: Any) -> CacheIdentity:
    return CacheIdentity(
        model=ModelIdentity("xxh3:" + "d" * 32, "llama", {"n_layer": 6}),
        layout_digest="l" * 32, type_k=1, type_v=1, flash_attn=False, v_trans=True,
        rope_freq_base=10000.0, rope_freq_scale=1.0, yarn=(0.0,), n_swa=0, kv_unified=True,
        backend="CPU", codec=codec,
    )  # fmt: skip


EXACT = _identity()
LOSSY = _identity(**PARAMS.identity())


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    select.register(LOSSY.hex, PARAMS)
    yield
    select.register(LOSSY.hex, None)


def _record(identity: CacheIdentity, n_pages: int = 3) -> tuple[PrefixRecord, list[bytes]]:
    tokens = np.arange(n_pages * N_TOKENS, dtype=np.int32) + 7
    parent, pages, raws = identity.root, [], []
    for i in range(n_pages):
        page, _, _ = make_page(n_tokens=N_TOKENS, start=i * N_TOKENS, seed=i)
        raw = page.to_bytes()
        chunk = tokens[i * N_TOKENS : (i + 1) * N_TOKENS]
        key = chain_key(parent, chunk)
        pages.append(PageBlob(key, parent, N_TOKENS, chunk.tobytes(), raw, N_TOKENS))
        raws.append(raw)
        parent = key
    rec = PrefixRecord(identity.hex, identity.model.id, "m", n_pages * N_TOKENS, tuple(pages))
    return rec, raws


def _stored(store: Any, key: bytes) -> bytes:
    """What the L3 store holds under ``key`` (it must hold something)."""
    value = store.get(key)
    assert value is not None, key
    return bytes(value)


def _tier(directory: Path, **kw: Any) -> DiskTier:
    return DiskTier(settings(directory, **kw), reconcile=False, close_at_exit=False)


def test_identity_names_the_codec() -> None:
    assert EXACT.root != LOSSY.root
    assert "codec" not in EXACT.fields()  # exact identities are what they always were
    assert LOSSY.fields()["codec"]["name"] == "cachegen"
    other = _identity(**dataclasses.replace(PARAMS, k_bits=(8, 8)).identity())
    assert other.root != LOSSY.root  # every parameter is identity
    tokens = np.arange(512, dtype=np.int32)
    assert not set(page_keys(EXACT.root, tokens, 64)) & set(page_keys(LOSSY.root, tokens, 64))


def test_writer_encodes_and_reader_decodes_native_pages(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l3", codec="cachegen")
    try:
        rec, raws = _record(LOSSY)
        assert tier.record(rec) and tier.flush(10)
        keys = [p.key for p in rec.pages]
        store = tier._parts.rw
        for key in keys:
            stored = _stored(store, DATA + key)
            assert stored_codec(stored) == "cachegen/1"
            assert len(stored) < 0.6 * len(raws[0])
        man = Manifest.unpack(_stored(store, MAN + keys[-1]), keys[-1])
        assert man.codec == "cachegen/1"
        pages = tier.read(keys)
        assert [len(p) for p in pages] == [len(r) for r in raws]
        for got, raw in zip(pages, raws, strict=True):
            back, want = page_from_bytes(got), page_from_bytes(raw)
            assert back.layout == want.layout and back.start == want.start
            bound = cachegen.error_bound(cachegen.encode(raw, PARAMS))
            for a, b in zip(values_of(back), values_of(want), strict=True):
                assert np.abs(a - b).max() <= bound * 1.01 + np.abs(b).max() * 2**-10
        counts = tier._parts.counters
        assert counts.get("cachegen_pages") == 3 and counts.get("codec_unqualified") == 0
        assert counts.get("encode_us") > 0 and counts.get("encoded_bytes") == sum(map(len, raws))
        summary = tier.codec_summary()
        assert summary["manifests_by_codec"] == {"cachegen/1": 1}
        assert summary["activity"]["cachegen_pages"] == 3
    finally:
        tier.close()


def test_exact_instance_never_reads_a_lossy_page(tmp_path: Path) -> None:
    directory = tmp_path / "l3"
    lossy = _tier(directory, codec="cachegen")
    try:
        rec, raws = _record(LOSSY)
        assert lossy.record(rec) and lossy.flush(10)
    finally:
        lossy.close()
    exact = _tier(directory)
    try:
        tokens = np.arange(3 * N_TOKENS, dtype=np.int32) + 7
        exact_keys = page_keys(EXACT.root, tokens, N_TOKENS)
        assert not exact.contains(exact_keys[0])
        assert exact.children(EXACT.root) == []
        assert exact.read(exact_keys) == []  # a miss: the exact chain names other pages
        # the same tokens recorded exactly are stored beside the lossy ones, never mixed
        rec_exact, _ = _record(EXACT)
        assert exact.record(rec_exact) and exact.flush(10)
        served = exact.read([p.key for p in rec_exact.pages])
        assert [bytes(p) for p in served] == raws
        assert exact._parts.counters.get("cachegen_pages") == 0
    finally:
        exact.close()


def test_unknown_codec_version_is_a_counted_miss(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l3", codec="cachegen")
    try:
        rec, _ = _record(LOSSY, n_pages=1)
        assert tier.record(rec) and tier.flush(10)
        key = rec.pages[0].key
        store = tier._parts.rw
        stored = bytearray(_stored(store, DATA + key))
        struct.pack_into("<H", stored, 4, cachegen.CODEC_VERSION + 1)  # a later build's page
        # replace it as that build would have written it: metadata digest and size to match
        meta = tier._tree.meta(key)
        assert meta is not None
        meta.digest = payload_digest(bytes(stored))
        store.set(DATA + key, bytes(stored))
        store.set(META + key, meta.pack())
        assert tier.read([key]) == []
        assert tier._parts.counters.get("unknown_codec") == 1
        assert tier._parts.counters.get("misses") == 1
        assert tier.contains(key)  # kept: another version reads it
    finally:
        tier.close()


def test_cachegen_without_a_qualified_codec_stores_native(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l3", codec="cachegen")
    try:
        rec, raws = _record(EXACT)  # an identity with no registered codec (not qualified)
        assert tier.record(rec) and tier.flush(10)
        keys = [p.key for p in rec.pages]
        for key, raw in zip(keys, raws, strict=True):
            assert _stored(tier._parts.rw, DATA + key) == raw  # native, exact
        assert tier._parts.counters.get("codec_unqualified") == 3
        assert tier._parts.counters.get("cachegen_pages") == 0
        assert [bytes(p) for p in tier.read(keys)] == raws
    finally:
        tier.close()


def test_unsupported_pages_of_a_cachegen_identity_store_native(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l3", codec="cachegen")
    try:
        rec, _ = _record(LOSSY, n_pages=1)
        bad = bytearray(rec.pages[0].data)
        bad[28 + 24 * 6 : 28 + 24 * 6 + 2] = b"\x00\x7e"  # an F16 NaN
        page = dataclasses.replace(rec.pages[0], payload=bytes(bad))
        rec = dataclasses.replace(rec, pages=(page,))
        assert tier.record(rec) and tier.flush(10)
        assert _stored(tier._parts.rw, DATA + page.key) == bytes(bad)
        assert tier._parts.counters.get("codec_unqualified") == 1
    finally:
        tier.close()


def _row(params: CacheGenParams | None, reason: str = "") -> Any:
    from skippy_llama.roster import CacheGenRow

    return CacheGenRow(
        model="m.gguf", model_digest="xxh3:" + "d" * 32, backend="CPU", layout_digest="L",
        type_k="F16", type_v="F16", flash_attn=False,
        params=params.identity() if params is not None else None,
        measured={"argmax_agree": 1.0, "mean_kl": 0.0, "ppl_rise": 0.001, "size_ratio": 0.2}, reason=reason,
    )  # fmt: skip


class _Layout:
    def digest(self) -> str:
        return "L"


def test_codec_choice_follows_the_roster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime never guesses: CacheGen only with a passing row for this model, backend and
    layout; a failed row, no row, or l3.codec native give native pages."""
    from skippy_llama.config import Settings
    from skippy_llama.roster import Recipe, Roster
    from skippy_llama.runtime import identity_params

    recipe = Recipe("0.3.36", "x", 1, "q")
    roster = Roster(recipe, (), (_row(PARAMS),))
    monkeypatch.setattr(identity_params, "load_roster", lambda: roster)
    cachegen_on = Settings(l3={"mode": "auto", "codec": "cachegen"})
    digest = "xxh3:" + "d" * 32
    choice = identity_params.codec_choice
    assert choice(cachegen_on, digest, "CPU", _Layout()) == PARAMS
    assert choice(Settings(l3={"mode": "auto"}), digest, "CPU", _Layout()) is None
    assert choice(cachegen_on, digest, "CUDA", _Layout()) is None  # another backend
    assert choice(cachegen_on, "xxh3:" + "e" * 32, "CPU", _Layout()) is None  # another model
    failed = Roster(recipe, (), (_row(None, "too lossy"),))
    monkeypatch.setattr(identity_params, "load_roster", lambda: failed)
    assert choice(cachegen_on, digest, "CPU", _Layout()) is None


def test_remote_codec_makes_the_identity_lossy_only_with_a_remote_tier(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """remote.codec asks for the same row as l3.codec; without remote.url it asks for nothing."""
    from skippy_llama.config import Settings
    from skippy_llama.roster import Recipe, Roster
    from skippy_llama.runtime import identity_params

    roster = Roster(Recipe("0.3.36", "x", 1, "q"), (), (_row(PARAMS),))
    monkeypatch.setattr(identity_params, "load_roster", lambda: roster)
    secret = tmp_path / "remote.key"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    remote = {"url": "redis://127.0.0.1:1/0", "secret_file": str(secret), "codec": "cachegen"}
    digest = "xxh3:" + "d" * 32
    choice = identity_params.codec_choice
    assert choice(Settings(remote=remote), digest, "CPU", _Layout()) == PARAMS
    no_url = Settings(remote={"codec": "cachegen"})
    assert choice(no_url, digest, "CPU", _Layout()) is None
    native = Settings(remote={**remote, "codec": "native"})
    assert choice(native, digest, "CPU", _Layout()) is None


def test_a_lossy_identity_stores_l3_pages_losslessly_unless_l3_codec_asks(
    tmp_path: Path,
) -> None:
    """remote.codec alone makes the identity lossy; L3 (l3.codec native) still stores its pages
    with the lossless codec, and reads them back as they were."""
    tier = _tier(tmp_path / "l3", codec="native")
    try:
        rec, raws = _record(LOSSY)
        assert tier.record(rec) and tier.flush(10)
        store = tier._parts.rw
        assert {stored_codec(_stored(store, DATA + p.key)) for p in rec.pages} == {"native"}
        assert tier._parts.counters.get("cachegen_pages") == 0
        assert [bytes(p) for p in tier.read([p.key for p in rec.pages])] == raws
    finally:
        tier.close()


def test_codec_setting_is_fail_closed() -> None:
    from skippy_llama.config import load_settings
    from skippy_llama.errors import ConfigError

    assert load_settings().settings.l3.codec == "native"
    assert load_settings({"l3": {"codec": "cachegen"}}).settings.l3.codec == "cachegen"
    with pytest.raises(ConfigError, match=r"l3\.codec"):
        load_settings({"l3": {"codec": "lossy"}})
