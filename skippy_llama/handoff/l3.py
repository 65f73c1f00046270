"""Bundles from and into L3: :func:`export_prefix` reads one prefix's pages (verified by L3's
reader), their tokens (L3's child index) and its manifest; :func:`import_bundle` checks a bundle
(``bundle.py``) and records its pages in L3 as a prefix record, through the writer like any
other, so L3's own admission, deduplication, signing and budget apply."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..codecs import decode, encode
from ..errors import SkippyError
from ..identity import chain_key
from ..tiers.l3.schema import Manifest
from ..tiers.l3.tier import DiskTier
from ..tiers.records import PageBlob, PrefixRecord
from .bundle import (
    Bundle,
    BundlePage,
    BundleRefused,
    load_private_key,
    load_trust,
    read_bundle,
    tokens_array,
    write_bundle,
)


@dataclass(frozen=True)
class ExportResult:
    manifest_id: str
    model_identity: str
    cache_identity: str
    pages: int
    tokens: int
    bytes: int


@dataclass(frozen=True)
class ImportResult:
    manifest_id: str
    model_identity: str
    cache_identity: str
    pages: int
    tokens: int
    signer: str
    signer_file: str
    stored: bool  # L3 holds the whole prefix afterwards


def _manifests(tier: DiskTier) -> list[Manifest]:
    # L3's façade lists manifests per model only; the tree lists them one by one (authentic
    # ones: a manifest without a valid tag under l3.secret_file is skipped)
    return tier._tree.manifests()[0] if tier.serving else []


def find_manifest(tier: DiskTier, prefix_or_id: str) -> Manifest:
    """The manifest whose id (hex) is ``prefix_or_id`` or starts with it (unique).

    Raises:
        SkippyError: none matches, or several do (they are listed).
    """
    wanted = prefix_or_id.strip().lower()
    if len(wanted) < 4 or any(c not in "0123456789abcdef" for c in wanted):
        raise SkippyError(
            f"prefix id {prefix_or_id!r}: give a manifest id, or its first 4 or more hex digits "
            "(`kv-cache export --list` lists them)"
        )
    found = [m for m in _manifests(tier) if m.id.hex().startswith(wanted)]
    if not found:
        raise SkippyError(f"no prefix {prefix_or_id!r} in the L3 store at {tier.directory}")
    if len(found) > 1:
        ids = ", ".join(m.id.hex() for m in found[:5])
        raise SkippyError(f"prefix id {prefix_or_id!r} is ambiguous: {ids}")
    return found[0]


def list_prefixes(tier: DiskTier) -> list[Manifest]:
    return sorted(_manifests(tier), key=lambda m: m.created)


def read_prefix(tier: DiskTier, man: Manifest) -> list[BundlePage]:
    """The pages of L3 prefix ``man``: parent, tokens (L3's child index, checked against the
    chain key) and bytes (read and verified by L3, stored here with the zstd codec).

    Raises:
        SkippyError: a page is no longer indexed or does not read.
    """
    pages: list[BundlePage] = []
    parent = man.root
    for i, mpage in enumerate(man.pages):
        tokens = dict(tier.children(parent)).get(mpage.key)
        if tokens is None or chain_key(parent, tokens_array(tokens)) != mpage.key:
            raise SkippyError(f"page {i} of prefix {man.id.hex()} is not in L3's index any more")
        got = tier.read([mpage.key])
        if not got:
            raise SkippyError(f"page {i} of prefix {man.id.hex()} cannot be read from L3")
        stored = encode(bytes(got[0]), "zstd")
        pages.append(BundlePage(mpage.key, parent, mpage.n_tokens, mpage.used, tokens, stored))
        used = mpage.used
        parent = (
            mpage.key
            if used == mpage.n_tokens
            else chain_key(parent, tokens_array(tokens[: 4 * used]))
        )
    return pages


def prefix_record(man: Manifest, pages: list[BundlePage]) -> PrefixRecord:
    """A prefix record of ``pages`` (every page new, decoded), as L3's and the remote tier's
    writers take it.

    Raises:
        BundleRefused: a page does not decode.
    """
    blobs = []
    for i, page in enumerate(pages):
        try:
            data = bytes(decode(page.stored, page.n_tokens))
        except SkippyError as exc:
            raise BundleRefused(f"page {i} does not decode: {exc}") from None
        blobs.append(PageBlob(page.key, page.parent, page.n_tokens, page.tokens, data, page.used))
    return PrefixRecord(
        man.cache_identity, man.model_identity, man.model_name, man.n_tokens, tuple(blobs)
    )


def export_prefix(tier: DiskTier, prefix_or_id: str, out: Path, key_file: Path) -> ExportResult:
    """Write the prefix ``prefix_or_id`` of L3 as a bundle at ``out``, signed with the ed25519
    private key in ``key_file``.

    Raises:
        SkippyError: no such prefix, a page is missing or fails L3's checks, or a bad key.
    """
    key = load_private_key(key_file)
    man = find_manifest(tier, prefix_or_id)
    pages = read_prefix(tier, man)
    size = write_bundle(out, man, pages, key)
    return ExportResult(
        man.id.hex(), man.model_identity, man.cache_identity, len(pages), man.n_tokens, size
    )


def check_bundle(path: Path, trust_path: Path) -> Bundle:
    """The checked bundle at ``path`` under the trust list at ``trust_path``.

    Raises:
        BundleRefused: why it is refused.
    """
    return read_bundle(path, load_trust(trust_path))


def import_bundle(
    tier: DiskTier, path: Path, trust_path: Path, *, timeout: float = 60.0
) -> ImportResult:
    """Check the bundle at ``path`` under the trust list at ``trust_path`` and record its prefix
    in L3 (waiting for the writer).

    Raises:
        BundleRefused: the bundle is refused (the message says why); nothing is written.
        SkippyError: L3 cannot take it (off, read-only, the record dropped).
    """
    bundle = check_bundle(path, trust_path)
    man = bundle.manifest
    try:
        record = prefix_record(man, list(bundle.pages))
    except BundleRefused as exc:
        raise BundleRefused(f"{path}: {exc}") from None
    if not tier.serving:
        raise SkippyError(f"L3 is {tier.state}: cannot import into {tier.directory}")
    if not tier.record(record) or not tier.flush(timeout):
        raise SkippyError("L3 did not take the prefix (its writer queue is full or it stopped)")
    stored = all(tier.contains(page.key) for page in bundle.pages)
    return ImportResult(
        man.id.hex(),
        man.model_identity,
        man.cache_identity,
        len(bundle.pages),
        man.n_tokens,
        bundle.signer,
        bundle.signer_file,
        stored,
    )
