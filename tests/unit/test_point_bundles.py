"""Bundles of composed restore points, without a model: attention pages (``statefixtures``
states) shared by the points of a chain and carried once; a trusted signer's bundle whose page
references are not the chain of its own tokens, or that carries a page no point uses, or misses
one, is refused."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

if importlib.util.find_spec("cryptography") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (cryptography) is not installed", allow_module_level=True)

from statefixtures import Spec, build_state, make_content

from skippy_llama.handoff.bundle import (
    BundleRefused,
    generate_keypair,
    load_private_key,
    load_trust,
    read_signed,
    write_signed,
)
from skippy_llama.handoff.points import read_point_bundle, write_point_bundle
from skippy_llama.restore_points import (
    ComposedRecord,
    PointOwner,
    RestorePoint,
    pack_composed,
    page_digest,
    point_key,
    point_values,
)

ROOT = bytes(range(16))
OWNER = PointOwner("model-a", "synthetic")


def _hybrid(n: int, content: Any, seed: int) -> RestorePoint:
    tail = np.random.default_rng(seed).bytes(300)
    tokens = np.arange(3, 3 + n, dtype=np.int32)
    return RestorePoint(tokens, build_state(content, n).data + tail, len(tail))


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Any, Any]:
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub.pem")
    return load_private_key(tmp_path / "k.pem"), load_trust(tmp_path / "k.pub.pem")


def test_a_chain_of_composed_points_carries_each_page_once(
    tmp_path: Path, keys: tuple[Any, Any]
) -> None:
    content = make_content(Spec(v_trans=True), 700)
    short, long_ = _hybrid(300, content, 1), _hybrid(600, content, 2)
    path = tmp_path / "b.skb"
    _, records, pages = write_point_bundle(path, ROOT, OWNER, [short, long_], keys[0])
    whole = len(point_values(long_, ROOT, 128).record)
    assert records < 2 * whole  # snapshots + references: the pages are apart
    bundle = read_point_bundle(path, read_signed(path, keys[1]))
    assert [p.blob for p in bundle.points] == [short.blob, long_.blob]
    assert [p.recurrent for p in bundle.points] == [300, 300]
    header = read_signed(path, keys[1]).header
    # pages [0, 256) shared: 2 + the short point's [256, 300) + the long one's 3
    assert len(header["pages"]) == 2 + 1 + 3 and pages > 0


def _write(
    path: Path, key: Any, records: list[tuple[RestorePoint, bytes]], pages: dict[bytes, bytes]
) -> None:
    header = {
        "kind": "restore-points",
        "cache_identity": ROOT.hex(),
        "model_identity": "model-a",
        "model_name": "synthetic",
        "page_tokens": 128,
        "points": [
            {
                "key": point_key(ROOT, p.tokens).hex(),
                "n_tokens": p.n_tokens,
                "size": len(r),
                "digest": xxhash.xxh3_128_hexdigest(r),
            }
            for p, r in records
        ],
        "pages": [
            {"key": k.hex(), "size": len(v), "digest": xxhash.xxh3_128_hexdigest(v)}
            for k, v in pages.items()
        ],
    }
    write_signed(path, header, [r for _, r in records] + list(pages.values()), key)


def test_inconsistent_bundles_under_a_trusted_key_are_refused(
    tmp_path: Path, keys: tuple[Any, Any]
) -> None:
    content = make_content(Spec(v_trans=True), 400)
    point = _hybrid(300, content, 1)
    made = point_values(point, ROOT, 128)
    pages = dict(made.pages)
    path = tmp_path / "b.skb"

    def refused(
        records: list[tuple[RestorePoint, bytes]], pages: dict[bytes, bytes], why: str
    ) -> None:
        _write(path, keys[0], records, pages)
        with pytest.raises(BundleRefused, match=why):
            read_point_bundle(path, read_signed(path, keys[1]))

    # as made: accepted
    _write(path, keys[0], [(point, made.record)], pages)
    assert read_point_bundle(path, read_signed(path, keys[1])).points[0].blob == point.blob
    # a page left out, or one more that no point uses
    first = next(iter(pages))
    refused([(point, made.record)], {k: v for k, v in pages.items() if k != first}, "missing")
    refused([(point, made.record)], {**pages, bytes(16): b"x" * 10}, "no restore point uses")
    # the record's pages under keys that are not the chain of its own tokens (signed anew)
    moved = {bytes([k[0] ^ 1]) + k[1:]: v for k, v in pages.items()}
    refs = tuple((k, page_digest(v)) for k, v in moved.items())
    record = pack_composed(ComposedRecord(point.tokens, refs, b"", point.blob[-300:]), ROOT)
    refused([(point, record)], moved, "not keyed by its own tokens")
