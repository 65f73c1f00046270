"""Bundles of restore points (issue 46): the prefixes of recurrent, hybrid and sliding-window
models moved between machines that share no server.

A bundle of kind ``restore-points`` (``bundle.py``'s signed envelope) holds one chain of points
of one cache identity, each as the values L3 and the remote tier keep
(:func:`skippy_llama.restore_points.point_values`): the point's record (its tokens, its
snapshot: the recurrent state or the window's cells, and references to its attention pages) and
the attention pages, each page once however many points run through it. Header fields::

    kind "restore-points", cache_identity (hex root), model_identity, model_name, page_tokens,
    points: [{key, n_tokens, size, digest}], pages: [{key, size, digest}]

then the records and the pages in that order. Reading is checking, after the signature: sizes
and digests; each record as L3 checks it (header, lengths, its own digest, the identity, its
tokens against its key); each page reference is the chain key of the record's own tokens and
names a page of the bundle with the digest the record keeps; the pages rebuild a state; no page
is left over. Anything else is :class:`~.bundle.BundleRefused`. Import stores every point in L3
through :meth:`~skippy_llama.tiers.l3.tier.DiskTier.put_point` (L3's own signing, budget and
page sharing apply); a process of the same cache identity then serves them from L3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..errors import SkippyError, StateFormatError, StoreDataError
from ..restore_points import (
    PointOwner,
    RestorePoint,
    is_composed,
    page_digest,
    page_keys,
    point_key,
    point_values,
    recompose_point,
    unpack_composed,
    unpack_point,
)
from ..tiers.l3.points import PAGE_TOKENS, PointMeta
from ..tiers.l3.tier import DiskTier
from .bundle import (
    BundleRefused,
    Signed,
    check_int,
    check_key,
    load_private_key,
    load_trust,
    read_signed,
    write_signed,
)

KIND_POINTS = "restore-points"


@dataclass(frozen=True)
class PointBundle:
    """A checked bundle of restore points (shallowest first)."""

    root: bytes  # the cache identity root
    owner: PointOwner
    points: tuple[RestorePoint, ...]
    signer: str
    signer_file: str


@dataclass(frozen=True)
class PointExportResult:
    point_id: str
    model_identity: str
    cache_identity: str
    points: int
    tokens: list[int]  # each point's token count
    snapshot_bytes: int  # the records (snapshots + references)
    page_bytes: int  # the attention pages, each once
    bytes: int  # the bundle file


@dataclass(frozen=True)
class PointImportResult:
    model_identity: str
    cache_identity: str
    points: int
    tokens: list[int]
    signer: str
    signer_file: str
    stored: bool  # L3 took every point


def write_point_bundle(
    path: Path,
    root: bytes,
    owner: PointOwner,
    points: Sequence[RestorePoint],
    key: Ed25519PrivateKey,
    page_tokens: int = PAGE_TOKENS,
) -> tuple[int, int, int]:
    """Write ``points`` of the cache identity ``root`` as a bundle signed with ``key`` (an
    ed25519 private key); returns (file bytes, record bytes, page bytes)."""
    records: list[tuple[RestorePoint, bytes]] = []
    pages: dict[bytes, bytes] = {}
    for point in points:
        made = point_values(point, root, page_tokens)
        records.append((point, made.record))
        for page_key, page in made.pages:
            pages.setdefault(page_key, page)
    header = {
        "kind": KIND_POINTS,
        "cache_identity": root.hex(),
        "model_identity": owner.model_identity,
        "model_name": owner.model_name,
        "page_tokens": page_tokens,
        "points": [
            {
                "key": point_key(root, point.tokens).hex(),
                "n_tokens": point.n_tokens,
                "size": len(record),
                "digest": xxhash.xxh3_128_hexdigest(record),
            }
            for point, record in records
        ],
        "pages": [
            {"key": k.hex(), "size": len(v), "digest": xxhash.xxh3_128_hexdigest(v)}
            for k, v in pages.items()
        ],
    }
    payloads = [record for _, record in records] + list(pages.values())
    size = write_signed(path, header, payloads, key)
    return size, sum(len(r) for _, r in records), sum(len(v) for v in pages.values())


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise BundleRefused(f"bundle header: {what} is not a string")
    return value


def read_point_bundle(path: Path, signed: Signed) -> PointBundle:
    """The restore points ``signed`` (a bundle from :func:`~.bundle.read_signed`) holds,
    checked for consistency (see the module docstring).

    Raises:
        BundleRefused: why it is refused.
    """
    header, body = signed.header, signed.body
    if signed.kind != KIND_POINTS:
        raise BundleRefused(f"{path} is a bundle of kind {signed.kind!r}, not of restore points")
    root = check_key(header.get("cache_identity"), "cache_identity")
    owner = PointOwner(
        _str(header.get("model_identity"), "model_identity"),
        _str(header.get("model_name"), "model_name"),
    )
    page_tokens = check_int(header.get("page_tokens"), "page_tokens", 1)
    rows, page_rows = header.get("points"), header.get("pages")
    if not isinstance(rows, list) or not rows or not isinstance(page_rows, list):
        raise BundleRefused(f"{path}: the header lists no restore points")
    off = signed.offset

    def take(row: Any, what: str) -> tuple[bytes, bytes]:
        nonlocal off
        if not isinstance(row, dict):
            raise BundleRefused(f"{path}: {what} is not an object")
        key = check_key(row.get("key"), f"{what} key")
        size = check_int(row.get("size"), f"{what} size", 1)
        if off + size > len(body):
            raise BundleRefused(f"{path}: {what} runs past the end of the bundle (truncated)")
        data = body[off : off + size]
        off += size
        if xxhash.xxh3_128_hexdigest(data) != row.get("digest"):
            raise BundleRefused(f"{path}: {what} does not match its digest")
        return key, data

    records = [(*take(row, f"restore point {i}"), row) for i, row in enumerate(rows)]
    pages = dict(take(row, f"page {i}") for i, row in enumerate(page_rows))
    if off != len(body):
        raise BundleRefused(f"{path}: {len(body) - off} bytes after the last page")
    if len(pages) != len(page_rows):
        raise BundleRefused(f"{path}: a page is listed twice")
    used: set[bytes] = set()
    points = []
    for i, (key, record, row) in enumerate(records):
        what = f"{path}: restore point {i}"
        try:
            if not is_composed(record):
                point = unpack_point(record, root=root, key=key)
            else:
                composed = unpack_composed(record, root=root, key=key)
                refs = [k for k, _ in composed.refs]
                if refs and refs != page_keys(composed.tokens, root, page_tokens):
                    raise BundleRefused(f"{what}: its pages are not keyed by its own tokens")
                parts = []
                for ref, digest in composed.refs:
                    page = pages.get(ref)
                    if page is None or page_digest(page) != digest:
                        raise BundleRefused(f"{what}: page {ref.hex()} is missing or differs")
                    parts.append(page)
                    used.add(ref)
                blob = recompose_point(parts, composed.head, composed.tail)
                point = RestorePoint(composed.tokens, blob, len(composed.tail))
        except (StoreDataError, StateFormatError) as exc:
            raise BundleRefused(f"{what}: {exc}") from None
        if point.n_tokens != check_int(row.get("n_tokens"), f"point {i} n_tokens", 1):
            raise BundleRefused(f"{what}: its token count differs from the header's")
        points.append(point)
    if used != set(pages):
        raise BundleRefused(f"{path}: {len(set(pages) - used)} pages no restore point uses")
    return PointBundle(root, owner, tuple(points), signed.signer, signed.signer_file)


# ---------------------------------------------------------------------- L3


def list_points(tier: DiskTier) -> list[PointMeta]:
    """The restore points L3 holds, oldest first."""
    return sorted(tier.point_metas(), key=lambda m: m.created)


def find_points(tier: DiskTier, point_id: str) -> list[PointMeta]:
    """The points whose key (hex) starts with ``point_id`` (possibly none)."""
    wanted = point_id.strip().lower()
    return [m for m in tier.point_metas() if m.key.hex().startswith(wanted)]


def export_points(tier: DiskTier, point_id: str, out: Path, key_file: Path) -> PointExportResult:
    """Write the restore point ``point_id`` of L3, with every shallower point of the same
    identity whose tokens it extends (a document's prefill points), as a bundle at ``out``
    signed with the ed25519 private key in ``key_file``.

    Raises:
        SkippyError: no such point, several, one does not read, or a bad key.
    """
    key = load_private_key(key_file)
    found = find_points(tier, point_id)
    if not found:
        raise SkippyError(f"no restore point {point_id!r} in the L3 store at {tier.directory}")
    if len(found) > 1:
        ids = ", ".join(m.key.hex() for m in found[:5])
        raise SkippyError(f"restore point id {point_id!r} is ambiguous: {ids}")
    (meta,) = found
    point = tier.read_point(meta)
    if point is None:
        raise SkippyError(f"restore point {meta.key.hex()} does not read from L3 (damaged?)")
    chain = [point]
    for other in tier.point_metas():
        if other.root != meta.root or other.n_tokens >= meta.n_tokens:
            continue
        shallower = tier.read_point(other)
        if shallower is not None and np.array_equal(
            shallower.tokens, point.tokens[: shallower.n_tokens]
        ):
            chain.append(shallower)
    chain.sort(key=lambda p: p.n_tokens)
    owner = PointOwner(meta.model_identity, meta.model_name)
    size, records, pages = write_point_bundle(out, meta.root, owner, chain, key)
    return PointExportResult(
        meta.key.hex(),
        meta.model_identity,
        meta.root.hex(),
        len(chain),
        [p.n_tokens for p in chain],
        records,
        pages,
        size,
    )


def check_point_bundle(path: Path, trust_path: Path) -> PointBundle:
    """The checked bundle of restore points at ``path`` under the trust list at
    ``trust_path``.

    Raises:
        BundleRefused: why it is refused.
    """
    return read_point_bundle(path, read_signed(path, load_trust(trust_path)))


def import_points(tier: DiskTier, bundle: PointBundle) -> PointImportResult:
    """Store a checked bundle's points in L3 (shallowest first).

    Raises:
        SkippyError: L3 cannot take them (off, read-only).
    """
    if not tier.serving:
        raise SkippyError(f"L3 is {tier.state}: cannot import into {tier.directory}")
    stored = [tier.put_point(bundle.root, point, bundle.owner) for point in bundle.points]
    return PointImportResult(
        bundle.owner.model_identity,
        bundle.root.hex(),
        len(bundle.points),
        [p.n_tokens for p in bundle.points],
        bundle.signer,
        bundle.signer_file,
        all(stored),
    )
