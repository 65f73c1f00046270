"""The bundle file: one prefix's pages and manifest, signed with ed25519.

Layout (every integer little-endian)::

    b"SKBUNDLE" | version u8 | header length u32 | header (canonical JSON)
    | for each page: its tokens (int32, 4 bytes each) then its stored bytes
    | ed25519 signature (64 bytes) over everything before it

The header names the signer's public key and the bundle's ``kind``: ``prefix`` (the default when
absent) or ``restore-points`` (``points.py``: records and pages of restore points instead of
pages). A prefix bundle's header carries L3's manifest body (cache identity, model,
pages with their sizes) and, per page, its parent node, token count, stored size and digest.
Reading a bundle is checking it, in this order, before anything is trusted: the shape of the
file and header; the signer is in the trust list and the signature verifies under that trusted
key; then every page: its sizes, its digest, and its chain key, ``xxh3_128(parent ‖ tokens)``,
which must be the key the manifest names, so a bundle cannot put pages under keys other than
those of its own tokens. Anything else is :class:`BundleRefused` with a message that says why.
Nothing is ever unpickled; JSON is parsed with type checks (L3's ``schema`` parsers).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..errors import SkippyError
from ..identity import chain_key
from ..tiers.l3.schema import Manifest, dump_json, load_json
from ..tiers.records import KEY_BYTES

MAGIC = b"SKBUNDLE"
VERSION = 1
_HEAD = struct.Struct("<8sBI")
SIGNATURE_BYTES = 64
#: A header larger than this is not one of ours (a prefix of 100k pages needs about 15 MB).
MAX_HEADER_BYTES = 64 << 20
#: Public key files larger than this are not keys.
MAX_KEY_FILE_BYTES = 16 << 10


class BundleRefused(SkippyError):
    """A bundle (or a key) that is refused; the message says why."""


@dataclass(frozen=True)
class BundlePage:
    key: bytes
    parent: bytes
    n_tokens: int
    used: int
    tokens: bytes  # int32 little-endian
    stored: bytes  # the page as stored (codec-framed: ``skippy_llama.codecs``)


@dataclass(frozen=True)
class Bundle:
    """A checked bundle: the manifest and its pages, and who signed it."""

    manifest: Manifest
    pages: tuple[BundlePage, ...]
    signer: str  # fingerprint of the trusted key that signed it
    signer_file: str


def fingerprint(public: Ed25519PublicKey) -> str:
    """``ed25519:`` + the first 16 bytes of SHA-256 of the raw public key, hex."""
    return "ed25519:" + hashlib.sha256(_raw(public)).hexdigest()[:32]


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def generate_keypair(private_path: Path, public_path: Path) -> str:
    """Write a new ed25519 key pair (private PEM 0600, public PEM); returns the fingerprint.

    Raises:
        BundleRefused: a file is already there (never overwritten).
    """
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    for path in (private_path, public_path):
        if path.exists():
            raise BundleRefused(f"{path} exists; not overwriting a key")
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    public_path.write_bytes(public)
    return fingerprint(key.public_key())


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """The ed25519 private key in PEM file ``path``.

    Raises:
        BundleRefused: missing, readable by others, not PEM, encrypted, or not ed25519.
    """
    try:
        info = os.stat(path)
        data = path.read_bytes()
    except OSError as exc:
        raise BundleRefused(f"cannot read the signing key {path}: {exc.strerror or exc}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise BundleRefused(f"signing key {path} is readable by others; chmod 600 it")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise BundleRefused(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BundleRefused(f"{path} is a {type(key).__name__}, not an ed25519 key")
    return key


def _load_public(path: Path) -> Ed25519PublicKey:
    try:
        if path.stat().st_size > MAX_KEY_FILE_BYTES:
            raise BundleRefused(f"{path} is too large to be a public key")
        data = path.read_bytes()
    except OSError as exc:
        raise BundleRefused(f"cannot read trusted key {path}: {exc.strerror or exc}") from None
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise BundleRefused(f"{path} is not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BundleRefused(f"{path} is a {type(key).__name__}, not an ed25519 public key")
    return key


def load_trust(path: Path) -> dict[bytes, tuple[Ed25519PublicKey, str]]:
    """The trust list: a PEM public key file, or a directory of them (``*.pem``, ``*.pub``);
    raw public key -> (key, file it came from).

    Raises:
        BundleRefused: the path is missing, a file in it is not an ed25519 public key, or the
            list is empty.
    """
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".pem", ".pub") and p.is_file())
    elif path.is_file():
        files = [path]
    else:
        raise BundleRefused(f"trust list {path} does not exist")
    trusted: dict[bytes, tuple[Ed25519PublicKey, str]] = {}
    for file in files:
        key = _load_public(file)
        trusted[_raw(key)] = (key, str(file))
    if not trusted:
        raise BundleRefused(f"trust list {path} holds no public keys (*.pem or *.pub files)")
    return trusted


def write_bundle(
    path: Path, manifest: Manifest, pages: Iterable[BundlePage], key: Ed25519PrivateKey
) -> int:
    """Write and sign a bundle (atomically: a temporary file renamed); returns its size."""
    pages = list(pages)
    header = {
        "manifest": manifest.body(),
        "pages": [
            {
                "key": p.key.hex(),
                "parent": p.parent.hex(),
                "n_tokens": p.n_tokens,
                "size": len(p.stored),
                "digest": xxhash.xxh3_128_hexdigest(p.stored),
            }
            for p in pages
        ],
    }
    payloads = [part for page in pages for part in (page.tokens, page.stored)]
    return write_signed(path, header, payloads, key)


def check_int(value: Any, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BundleRefused(f"bundle header: {what} is not an integer >= {low}")
    return value


def check_key(value: Any, what: str) -> bytes:
    try:
        key = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise BundleRefused(f"bundle header: {what} is not a {KEY_BYTES}-byte hex key")
    return key


#: ``kind`` of a bundle of one prefix's pages (the default: bundles written before kinds).
KIND_PREFIX = "prefix"


@dataclass(frozen=True)
class Signed:
    """A bundle whose signature verified under a trusted key; its content still unchecked."""

    header: dict[str, Any]
    body: bytes  # everything the signature covers
    offset: int  # where the payloads after the header start in ``body``
    signer: str  # fingerprint
    signer_file: str

    @property
    def kind(self) -> str:
        kind = self.header.get("kind", KIND_PREFIX)
        return kind if isinstance(kind, str) else ""


def write_signed(
    path: Path, header: dict[str, Any], payloads: Iterable[bytes], key: Ed25519PrivateKey
) -> int:
    """Write ``header`` (with the signer added) and ``payloads`` as a bundle signed with
    ``key`` (atomically: a temporary file renamed); returns its size."""
    head = dump_json({"v": VERSION, "signer": _raw(key.public_key()).hex(), **header})
    body = b"".join([_HEAD.pack(MAGIC, VERSION, len(head)), head, *payloads])
    signature = key.sign(body)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(body)
        f.write(signature)
    os.replace(tmp, path)
    return len(body) + len(signature)


def read_bundle(path: Path, trust: dict[bytes, tuple[Ed25519PublicKey, str]]) -> Bundle:
    """Read and check the prefix bundle at ``path`` (see the module docstring).

    Raises:
        BundleRefused: why it is refused.
    """
    signed = read_signed(path, trust)
    if signed.kind != KIND_PREFIX:
        raise BundleRefused(f"{path} is a bundle of kind {signed.kind!r}, not of a prefix")
    return _prefix(path, signed)


def read_signed(path: Path, trust: dict[bytes, tuple[Ed25519PublicKey, str]]) -> Signed:
    """Read the bundle at ``path`` and check its shape, that its signer is in ``trust`` and
    that the signature verifies under that key; its content is checked by its kind's reader.

    Raises:
        BundleRefused: why it is refused.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BundleRefused(f"cannot read bundle {path}: {exc.strerror or exc}") from None
    if len(data) < _HEAD.size + SIGNATURE_BYTES:
        raise BundleRefused(f"{path} is too short to be a bundle ({len(data)} bytes)")
    magic, version, head_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise BundleRefused(f"{path} is not a skippy-llama bundle (magic {magic!r})")
    if version != VERSION:
        raise BundleRefused(f"{path} is a bundle of version {version}; this build reads {VERSION}")
    body, signature = data[:-SIGNATURE_BYTES], data[-SIGNATURE_BYTES:]
    if head_len > MAX_HEADER_BYTES or _HEAD.size + head_len > len(body):
        raise BundleRefused(f"{path}: the header length {head_len} runs past the file")
    try:
        header = load_json(body[_HEAD.size : _HEAD.size + head_len], "bundle header")
    except SkippyError as exc:
        raise BundleRefused(f"{path}: {exc}") from None
    signer_hex = header.get("signer")
    try:
        signer = bytes.fromhex(signer_hex) if isinstance(signer_hex, str) else b""
    except ValueError:
        signer = b""
    if len(signer) != 32:
        raise BundleRefused(f"{path}: the header names no ed25519 signer")
    signer_print = "ed25519:" + hashlib.sha256(signer).hexdigest()[:32]
    if signer not in trust:
        raise BundleRefused(
            f"{path} is signed by {signer_print}, which is not in the trust list "
            f"({len(trust)} trusted key{'s' if len(trust) != 1 else ''}); add its public key "
            "to the list if you trust it"
        )
    public, source = trust[signer]
    try:
        public.verify(signature, body)
    except InvalidSignature:
        raise BundleRefused(
            f"{path}: the signature does not verify under the trusted key {signer_print} "
            f"({source}): the bundle was changed after signing, or is damaged"
        ) from None
    return Signed(header, body, _HEAD.size + head_len, signer_print, source)


def _prefix(path: Path, signed: Signed) -> Bundle:
    """The prefix bundle ``signed`` holds, checked for consistency (it is trusted already)."""
    header, body = signed.header, signed.body
    try:
        man_body = header.get("manifest")
        if not isinstance(man_body, dict):
            raise BundleRefused(f"{path}: the header has no manifest")
        mid = check_key(man_body.get("id"), "manifest id")
        manifest = Manifest.unpack(json.dumps(man_body).encode(), mid)
    except SkippyError as exc:
        raise BundleRefused(f"{path}: the manifest is invalid: {exc}") from None
    rows = header.get("pages")
    if not isinstance(rows, list) or len(rows) != len(manifest.pages):
        raise BundleRefused(f"{path}: the page list does not match the manifest")
    pages: list[BundlePage] = []
    off = signed.offset
    parent = manifest.root
    for i, (row, mpage) in enumerate(zip(rows, manifest.pages, strict=True)):
        if not isinstance(row, dict):
            raise BundleRefused(f"{path}: page {i} is not an object")
        key = check_key(row.get("key"), f"page {i} key")
        n_tokens = check_int(row.get("n_tokens"), f"page {i} n_tokens", 1)
        size = check_int(row.get("size"), f"page {i} size", 1)
        if key != mpage.key or n_tokens != mpage.n_tokens:
            raise BundleRefused(f"{path}: page {i} differs from the manifest's")
        if check_key(row.get("parent"), f"page {i} parent") != parent:
            raise BundleRefused(f"{path}: page {i} does not continue the prefix before it")
        end = off + 4 * n_tokens + size
        if end > len(body):
            raise BundleRefused(f"{path}: page {i} runs past the end of the bundle (truncated)")
        tokens = body[off : off + 4 * n_tokens]
        stored = body[off + 4 * n_tokens : end]
        off = end
        if xxhash.xxh3_128_hexdigest(stored) != row.get("digest"):
            raise BundleRefused(f"{path}: page {i} does not match its digest")
        if chain_key(parent, tokens_array(tokens)) != key:
            raise BundleRefused(f"{path}: page {i}'s key is not the chain key of its tokens")
        pages.append(BundlePage(key, parent, n_tokens, mpage.used, tokens, stored))
        used = mpage.used
        parent = key if used == n_tokens else chain_key(parent, tokens_array(tokens[: 4 * used]))
    if off != len(body):
        raise BundleRefused(f"{path}: {len(body) - off} bytes after the last page")
    return Bundle(manifest, tuple(pages), signed.signer, signed.signer_file)


def tokens_array(raw: bytes) -> npt.NDArray[np.int32]:
    return np.frombuffer(raw, dtype="<i4")
