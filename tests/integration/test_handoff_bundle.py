"""Signed handoff bundles between two real L3 stores: ``kv-cache keygen``, ``export`` and
``import`` through the CLI, and every refusal (an untrusted signer, a changed byte, a truncated
file, a bundle that is not one, inconsistent content under a trusted key) with its reason and
nothing written. The model test moves a prefix a real SkippyLlama stored to a second store and
restores it there, with output equal to a cold run."""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import pytest

from skippy_llama.events import CacheEvent

if importlib.util.find_spec("cryptography") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (cryptography) is not installed", allow_module_level=True)

from skippy_llama.cli.main import main
from skippy_llama.config import L3Settings
from skippy_llama.handoff.bundle import (
    BundlePage,
    BundleRefused,
    load_private_key,
    load_trust,
    read_bundle,
    write_bundle,
)
from skippy_llama.handoff.l3 import find_manifest
from skippy_llama.identity import chain_key, token_bytes
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.records import PageBlob, PrefixRecord

PAGE_TOKENS = 16
ROOT = bytes(range(16))


def open_store(directory: Path) -> DiskTier:
    settings = L3Settings(mode="fixed", budget="1GiB", directory=directory, minimum_free="1GiB")
    return DiskTier(settings, reconcile=False, close_at_exit=False)


def l3_flags(directory: Path) -> list[str]:
    flags = ["--l3-mode", "fixed", "--l3-budget", "1GiB", "--l3-minimum-free", "1GiB"]
    return [*flags, "--l3-dir", str(directory)]


def fill(directory: Path, seed: int = 1, n_pages: int = 3) -> tuple[str, list[bytes], list[bytes]]:
    """Store a synthetic prefix in L3 at ``directory``: (manifest id hex, keys, payloads)."""
    rng = random.Random(seed)
    pages, keys, payloads = [], [], []
    parent = ROOT
    for _ in range(n_pages):
        tokens = [rng.randrange(50_000) for _ in range(PAGE_TOKENS)]
        key = chain_key(parent, tokens)
        payload = b"SKPG" + rng.randbytes(8192)
        pages.append(PageBlob(key, parent, PAGE_TOKENS, token_bytes(tokens), payload, PAGE_TOKENS))
        keys.append(key)
        payloads.append(payload)
        parent = key
    record = PrefixRecord(ROOT.hex(), "model-a", "synthetic", PAGE_TOKENS * n_pages, tuple(pages))
    with open_store(directory) as tier:
        assert tier.record(record) and tier.flush(30)
        assert tier.read(keys) == payloads
    return keys[-1].hex(), keys, payloads


def stored_keys(directory: Path, keys: list[bytes]) -> list[bytes]:
    with open_store(directory) as tier:
        return [bytes(page) for page in tier.read(keys)]


@pytest.fixture
def signer(tmp_path: Path) -> tuple[Path, Path]:
    """(private key, public key) made by ``kv-cache keygen``."""
    assert main(["kv-cache", "keygen", str(tmp_path / "node-a")]) == 0
    private, public = tmp_path / "node-a.pem", tmp_path / "node-a.pub.pem"
    assert private.stat().st_mode & 0o077 == 0
    return private, public


@pytest.fixture
def exported(tmp_path: Path, signer: tuple[Path, Path]) -> tuple[Path, list[bytes], list[bytes]]:
    store_a = tmp_path / "a"
    mid, keys, payloads = fill(store_a)
    bundle = tmp_path / "prefix.skb"
    argv = ["kv-cache", "export", mid[:8], str(bundle), "--key", str(signer[0])]
    assert main([*argv, *l3_flags(store_a)]) == 0
    return bundle, keys, payloads


def test_export_then_import_under_a_trusted_key(
    tmp_path: Path,
    signer: tuple[Path, Path],
    exported: tuple[Path, list[bytes], list[bytes]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundle, keys, payloads = exported
    trust = tmp_path / "trusted"
    trust.mkdir()
    (trust / "node-a.pem").write_bytes(signer[1].read_bytes())
    store_b = tmp_path / "b"
    argv = ["kv-cache", "import", str(bundle), "--trust", str(trust), *l3_flags(store_b)]
    assert main(argv) == 0
    assert "imported prefix" in capsys.readouterr().out
    assert stored_keys(store_b, keys) == payloads
    with open_store(store_b) as tier:
        man = find_manifest(tier, keys[-1].hex())
        assert (man.model_identity, man.cache_identity) == ("model-a", ROOT.hex())
    # importing again stores nothing new and still succeeds
    assert main(argv) == 0


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 3
    return capsys.readouterr().err


def test_an_untrusted_signer_is_refused(
    tmp_path: Path,
    exported: tuple[Path, list[bytes], list[bytes]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    bundle, _, _ = exported
    assert main(["kv-cache", "keygen", str(tmp_path / "other")]) == 0
    store_b = tmp_path / "b"
    argv = ["kv-cache", "import", str(bundle), "--trust", str(tmp_path / "other.pub.pem")]
    err = refused([*argv, *l3_flags(store_b)], capsys)
    assert "refused" in err and "not in the trust list" in err and "ed25519:" in err
    assert not store_b.exists()  # refused before L3 was opened: nothing written


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: b[:-200] + bytes([b[-200] ^ 1]) + b[-199:], "signature does not verify"),
        (lambda b: b[: len(b) // 2], "signature does not verify"),  # truncated
        (lambda b: b[:300], "runs past the file"),  # cut inside the header
        (lambda b: b"PK\x03\x04" + b[4:], "not a skippy-llama bundle"),
        (lambda b: b[:20], "too short"),
    ],
)
def test_a_changed_or_truncated_bundle_is_refused(
    tmp_path: Path,
    signer: tuple[Path, Path],
    exported: tuple[Path, list[bytes], list[bytes]],
    capsys: pytest.CaptureFixture[str],
    damage: object,
    reason: str,
) -> None:
    bundle, _, _ = exported
    bad = tmp_path / "bad.skb"
    bad.write_bytes(damage(bundle.read_bytes()))  # type: ignore[operator]
    store_b = tmp_path / "b"
    argv = ["kv-cache", "import", str(bad), "--trust", str(signer[1]), *l3_flags(store_b)]
    err = refused(argv, capsys)
    assert reason in err
    assert not store_b.exists()


def test_a_trusted_signer_cannot_put_pages_under_keys_of_other_tokens(
    tmp_path: Path, signer: tuple[Path, Path], exported: tuple[Path, list[bytes], list[bytes]]
) -> None:
    """A trusted key vouches for who made a bundle, not for its consistency: pages whose keys
    are not the chain keys of their tokens are refused anyway."""
    bundle, _, _ = exported
    trust = load_trust(signer[1])
    good = read_bundle(bundle, trust)
    pages = list(good.pages)
    wrong_tokens = token_bytes(list(range(PAGE_TOKENS)))
    first = pages[0]
    pages[0] = BundlePage(
        first.key, first.parent, first.n_tokens, first.used, wrong_tokens, first.stored
    )
    forged = tmp_path / "forged.skb"
    write_bundle(forged, good.manifest, pages, load_private_key(signer[0]))
    with pytest.raises(BundleRefused, match="not the chain key of its tokens"):
        read_bundle(forged, trust)


def test_keys_and_trust_lists_are_checked(
    tmp_path: Path, signer: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    private = signer[0]
    with pytest.raises(BundleRefused, match="no public keys"):
        empty = tmp_path / "empty"
        empty.mkdir()
        load_trust(empty)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "x.pem").write_text("not a key")
    with pytest.raises(BundleRefused, match="not a PEM public key"):
        load_trust(junk)
    with pytest.raises(BundleRefused, match="does not exist"):
        load_trust(tmp_path / "absent")
    with pytest.raises(BundleRefused, match=r"not an ed25519 public key|not a PEM public key"):
        load_trust(private)  # a private key is not a trust entry
    private.chmod(0o644)
    with pytest.raises(BundleRefused, match="readable by others"):
        load_private_key(private)
    assert main(["kv-cache", "keygen", str(tmp_path / "node-a")]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err


def test_export_names_unknown_and_ambiguous_prefixes(
    tmp_path: Path, signer: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    store_a = tmp_path / "a"
    mid, _, _ = fill(store_a)
    argv = ["kv-cache", "export", "ffff" if not mid.startswith("ffff") else "0000"]
    argv += [str(tmp_path / "x.skb"), "--key", str(signer[0]), *l3_flags(store_a)]
    assert main(argv) == 2
    assert "no prefix" in capsys.readouterr().err
    assert main(["kv-cache", "export", "--list", *l3_flags(store_a)]) == 0
    assert mid in capsys.readouterr().out


# ---------------------------------------------------------------------- the real model


@pytest.mark.model
def test_a_prefix_stored_by_one_node_restores_on_another_from_a_bundle(
    tmp_path: Path, smollm2_path: Path, signer: tuple[Path, Path]
) -> None:
    import llama_cpp

    from skippy_llama.config import Settings
    from skippy_llama.runtime.llama import SkippyLlama

    text = (
        "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
        "steps as his father had done before him. There were one hundred and twelve of them, "
        "worn smooth in the middle by generations of boots. At the top he trimmed the wick, "
        "polished the great lens until it shone, and wound the clockwork that turned the light. "
    ) * 3 + "The keeper wrote in the logbook that"

    def run(store: Path) -> tuple[str, CacheEvent | None]:
        settings = Settings(
            l3={"mode": "fixed", "budget": "1GiB", "directory": str(store), "minimum_free": "1GiB"}
        )
        llm = SkippyLlama(str(smollm2_path), n_ctx=1024, verbose=False, cache_settings=settings)
        try:
            out = llm.create_completion(text, max_tokens=8, temperature=0.0)
            return str(out["choices"][0]["text"]), llm.last_cache_event
        finally:
            llm.close()

    cold = llama_cpp.Llama(str(smollm2_path), n_ctx=1024, verbose=False)
    try:
        reference = cold.create_completion(text, max_tokens=8, temperature=0.0)
    finally:
        cold.close()
    assert isinstance(reference, dict)
    store_a, store_b = tmp_path / "a", tmp_path / "b"
    first, _ = run(store_a)
    with open_store(store_a) as tier:
        (man,) = tier._tree.manifests()[0]
    bundle = tmp_path / "doc.skb"
    argv = ["kv-cache", "export", man.id.hex(), str(bundle), "--key", str(signer[0])]
    assert main([*argv, *l3_flags(store_a)]) == 0
    argv = ["kv-cache", "import", str(bundle), "--trust", str(signer[1]), *l3_flags(store_b)]
    assert main(argv) == 0
    second, event = run(store_b)
    assert first == second == reference["choices"][0]["text"]
    assert event is not None
    assert event.tier == "l3" and event.cached_tokens >= man.n_tokens - PAGE_TOKENS * 8 > 0
