"""L3's key schema and its typed, versioned records (pure: bytes in, objects out, no diskcache).

Every store key is ``bytes`` whose first byte says what it holds. Keys sort as BLOBs (memcmp), so
each kind is one contiguous key range that can be listed without touching the others::

    \\x01 + token      pin: JSON {v, pid, start, host, at, keys} (pages in use: never evicted)
    \\x02 + kind + key quarantine record: JSON {reason, at, pid, size}
    \\x03 + name       store info: activity counters, the latest reconciliation, open sessions,
                       learned costs
    \\x04 + last key   manifest of one cached prefix (:class:`Manifest`, JSON, versioned)
    \\x05 + parent     child index (:func:`pack_children`): the pages stored after a node
    \\x06 + page key   page metadata (:class:`PageMeta`, binary, versioned)
    \\x07 + page key   page payload: the stored bytes (never pickled)
    \\x08 + point      restore-point record (``points.py``: recurrent and hybrid models)
    \\x09 + point      restore-point metadata: JSON
    \\x0a + page       attention page of composed restore points

Everything read from a store is input: each parser checks types, lengths and versions and raises
:class:`~skippy_llama.errors.StoreDataError` for anything damaged or foreign, so callers turn a bad
record into a quarantine and a miss, never into a crash or a wrong answer.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import ManifestError, StoreDataError
from ..records import KEY_BYTES, PrefixRecord

PIN = b"\x01"
QUAR = b"\x02"
INFO = b"\x03"
MAN = b"\x04"
KIDS = b"\x05"
META = b"\x06"
DATA = b"\x07"
POINT = b"\x08"
POINT_META = b"\x09"
POINT_PAGE = b"\x0a"
KINDS = (PIN, QUAR, INFO, MAN, KIDS, META, DATA, POINT, POINT_META, POINT_PAGE)
ACTIVITY = INFO + b"activity"
RECONCILIATION = INFO + b"reconciliation"
RECONCILER = INFO + b"reconciler"  # lease + cursor of the reconciliation in progress
COSTS = INFO + b"costs"  # tag + JSON cost book (``costs.py``): rates per model and backend
SESSION = INFO + b"session:"  # + token: one per open read-write tier (crash detection)

#: Authentication tags: HMAC-SHA256 truncated to 128 bits (``auth.py``); zero bytes when unsigned.
TAG_BYTES = 16
NO_TAG = bytes(TAG_BYTES)

MANIFEST_VERSION = 2
_CODEC_NAME = re.compile(r"native|[a-z][a-z0-9_]{0,31}/[0-9]{1,5}")
_META_MAGIC = b"PM"
META_VERSION = 2
# magic, version, digest, size, n_tokens, flags, depth, parent, created, last_used, hits, tag
_META_HEAD = struct.Struct("<2sB16sQIBI16sddI16s")
_KIDS_MAGIC = b"K\x02"
_KID_HEAD = struct.Struct("<I16s16s")  # n_tokens, page key, tag; then the tokens
_FLAG_INDEXED = 1


def kind_range(kind: bytes) -> tuple[bytes, bytes]:
    """``[lo, hi)`` bounds of every key of one kind."""
    return kind, bytes([kind[0] + 1])


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise StoreDataError(f"{what} is not a finite number: {value!r}")
    return float(value)


def _count(value: Any, what: str, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise StoreDataError(f"{what} is not an integer >= {low}: {value!r}")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise StoreDataError(f"{what} is not a string: {value!r}")
    return value


def _key_hex(value: Any, what: str) -> bytes:
    try:
        key = bytes.fromhex(_text(value, what))
    except ValueError:
        raise StoreDataError(f"{what} is not hex: {value!r}") from None
    if len(key) != KEY_BYTES:
        raise StoreDataError(f"{what} is not a {KEY_BYTES}-byte key: {value!r}")
    return key


def load_json(raw: bytes, what: str) -> dict[str, Any]:
    """A JSON object from a stored value (StoreDataError when it is not one)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreDataError(f"{what} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise StoreDataError(f"{what} is not a JSON object")
    return data


def dump_json(obj: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no spaces): what tags are computed over."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


@dataclass
class PageMeta:
    """What the store knows about one page, beside its payload.

    ``owners`` are the manifests whose prefix runs through the page (its reference count and,
    for policies, its sharers). ``created``/``last_used``/``hits`` feed eviction (a re-record
    refreshes ``last_used`` but is not a hit). ``tag`` authenticates key, tokens and payload
    when the store has a secret.
    """

    digest: bytes
    size: int
    n_tokens: int
    indexed: bool  # listed in the child index of ``parent``
    depth: int  # pages before this one on its chain (0 for a root page)
    parent: bytes
    created: float
    last_used: float
    hits: int = 0
    tag: bytes = NO_TAG
    owners: list[bytes] = field(default_factory=list)

    def pack(self) -> bytes:
        head = _META_HEAD.pack(
            _META_MAGIC,
            META_VERSION,
            self.digest,
            self.size,
            self.n_tokens,
            _FLAG_INDEXED if self.indexed else 0,
            self.depth,
            self.parent,
            self.created,
            self.last_used,
            self.hits,
            self.tag,
        )
        return head + b"".join(self.owners)

    @classmethod
    def unpack(cls, raw: bytes) -> PageMeta:
        """Parse stored metadata; StoreDataError for a damaged or foreign-version record."""
        if len(raw) < _META_HEAD.size or raw[:2] != _META_MAGIC:
            raise StoreDataError("page metadata of an unknown format")
        if raw[2] != META_VERSION:
            raise StoreDataError(f"page metadata of version {raw[2]}, this build reads 2")
        if (len(raw) - _META_HEAD.size) % KEY_BYTES:
            raise StoreDataError("page metadata with a truncated owner list")
        _, _, digest, size, n_tokens, flags, depth, parent, created, last_used, hits, tag = (
            _META_HEAD.unpack_from(raw)
        )
        if size <= 0 or n_tokens <= 0 or flags & ~_FLAG_INDEXED:
            raise StoreDataError("page metadata with an empty page or unknown flags")
        if not (math.isfinite(created) and math.isfinite(last_used)):
            raise StoreDataError("page metadata with a non-finite time")
        rest = raw[_META_HEAD.size :]
        owners = [rest[i : i + KEY_BYTES] for i in range(0, len(rest), KEY_BYTES)]
        return cls(
            digest,
            size,
            n_tokens,
            bool(flags & _FLAG_INDEXED),
            depth,
            parent,
            created,
            last_used,
            hits,
            tag,
            owners,
        )


@dataclass(frozen=True)
class ManifestPage:
    """One page of a manifest: its key and the tokens of it the prefix uses."""

    key: bytes
    used: int
    size: int  # stored bytes
    n_tokens: int


@dataclass(frozen=True)
class Manifest:
    """One cached prefix: its identities and pages, page 0 first (typed, versioned JSON)."""

    id: bytes
    cache_identity: str
    model_identity: str
    model_name: str
    n_tokens: int
    root: bytes
    pages: tuple[ManifestPage, ...]
    created: float
    last_used: float
    tag: bytes = NO_TAG
    #: the pages' codec: ``native`` (exact; absent from the JSON, so the manifests of earlier
    #: builds read as they were written) or ``cachegen/<version>`` (lossy)
    codec: str = "native"

    @property
    def keys(self) -> list[bytes]:
        return [page.key for page in self.pages]

    @property
    def stored_bytes(self) -> int:
        """Stored bytes of its pages (shared pages counted in full)."""
        return sum(page.size for page in self.pages)

    @classmethod
    def of_record(
        cls, rec: PrefixRecord, sizes: Iterable[int], now: float, *, codec: str = "native"
    ) -> Manifest:
        pages = tuple(
            ManifestPage(p.key, p.used, size, p.n_tokens)
            for p, size in zip(rec.pages, sizes, strict=True)
        )
        return cls(
            rec.manifest_id,
            rec.cache_identity,
            rec.model_identity,
            rec.model_name,
            rec.n_tokens,
            rec.pages[0].parent,
            pages,
            now,
            now,
            codec=codec,
        )

    def cut(self, n_pages: int) -> Manifest:
        """The manifest of the first ``n_pages`` pages (unsigned: the caller signs it)."""
        pages = self.pages[:n_pages]
        return replace(
            self,
            id=pages[-1].key,
            pages=pages,
            n_tokens=sum(p.used for p in pages),
            tag=NO_TAG,
        )

    def body(self) -> dict[str, Any]:
        """The JSON object without the tag (what the tag covers)."""
        extra = {} if self.codec == "native" else {"codec": self.codec}
        return extra | {
            "v": MANIFEST_VERSION,
            "id": self.id.hex(),
            "cache_identity": self.cache_identity,
            "model_identity": self.model_identity,
            "model_name": self.model_name,
            "n_tokens": self.n_tokens,
            "root": self.root.hex(),
            # [key, tokens used, stored bytes, tokens in the page]
            "pages": [[p.key.hex(), p.used, p.size, p.n_tokens] for p in self.pages],
            "created": self.created,
            "last_used": self.last_used,
        }

    def pack(self) -> bytes:
        body = self.body()
        if self.tag != NO_TAG:
            body["tag"] = self.tag.hex()
        return dump_json(body)

    @classmethod
    def unpack(cls, raw: bytes, mid: bytes) -> Manifest:
        """Parse the manifest stored under ``mid``.

        Raises:
            ManifestError: damaged, foreign (the untyped JSON lists of the first release
                included), of another version, or contradicting itself (ids, token counts).
        """
        try:
            return cls._unpack(raw, mid)
        except ManifestError:
            raise
        except StoreDataError as exc:
            raise ManifestError(str(exc)) from None

    @classmethod
    def _unpack(cls, raw: bytes, mid: bytes) -> Manifest:
        data = load_json(raw, "manifest")
        version = data.get("v")
        if version != MANIFEST_VERSION:
            raise ManifestError(
                f"manifest of version {version!r}, this build reads {MANIFEST_VERSION}",
                version=version,
            )
        rows = data.get("pages")
        if not isinstance(rows, list) or not rows:
            raise StoreDataError("manifest without pages")
        pages = []
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != 4:
                raise StoreDataError(f"manifest page {i} is not [key, used, size, n_tokens]")
            key = _key_hex(row[0], f"manifest page {i} key")
            n_tokens = _count(row[3], f"manifest page {i} n_tokens", low=1)
            used = _count(row[1], f"manifest page {i} used", low=1)
            if used > n_tokens:
                raise StoreDataError(f"manifest page {i} uses {used} of its {n_tokens} tokens")
            pages.append(ManifestPage(key, used, _count(row[2], f"page {i} size", low=1), n_tokens))
        tag = data.get("tag")
        codec = data.get("codec", "native")
        if not isinstance(codec, str) or not _CODEC_NAME.fullmatch(codec):
            raise StoreDataError(f"manifest codec is not a codec name: {codec!r}")
        man = cls(
            id=_key_hex(data.get("id"), "manifest id"),
            cache_identity=_text(data.get("cache_identity"), "cache_identity"),
            model_identity=_text(data.get("model_identity"), "model_identity"),
            model_name=_text(data.get("model_name"), "model_name"),
            n_tokens=_count(data.get("n_tokens"), "manifest n_tokens", low=1),
            root=_key_hex(data.get("root"), "manifest root"),
            pages=tuple(pages),
            created=_finite(data.get("created"), "manifest created"),
            last_used=_finite(data.get("last_used"), "manifest last_used"),
            tag=NO_TAG if tag is None else _tag_hex(tag),
            codec=codec,
        )
        if man.id != mid or man.pages[-1].key != mid:
            raise StoreDataError("manifest stored under another prefix's key")
        if man.n_tokens != sum(p.used for p in man.pages):
            raise StoreDataError("manifest n_tokens differs from the tokens its pages cover")
        return man


def _tag_hex(value: Any) -> bytes:
    try:
        tag = bytes.fromhex(_text(value, "manifest tag"))
    except ValueError:
        raise StoreDataError("manifest tag is not hex") from None
    if len(tag) != TAG_BYTES:
        raise StoreDataError("manifest tag has the wrong length")
    return tag


@dataclass(frozen=True)
class Child:
    """One child-index entry: a page stored after a node, with its tokens (int32 LE bytes)."""

    key: bytes
    tokens: bytes
    tag: bytes = NO_TAG


def unpack_children(raw: bytes) -> list[Child]:
    """Entries of a child index; StoreDataError when it does not parse."""
    if raw[:2] != _KIDS_MAGIC:
        raise StoreDataError("child index of an unknown format")
    out: list[Child] = []
    off = 2
    while off < len(raw):
        if off + _KID_HEAD.size > len(raw):
            raise StoreDataError("child index entry cut short")
        n, key, tag = _KID_HEAD.unpack_from(raw, off)
        start = off + _KID_HEAD.size
        end = start + 4 * n
        if n == 0 or end > len(raw):
            raise StoreDataError("child index entry with a bad token count")
        out.append(Child(bytes(key), bytes(raw[start:end]), bytes(tag)))
        off = end
    return out


def pack_children(entries: Iterable[Child]) -> bytes:
    return _KIDS_MAGIC + b"".join(
        _KID_HEAD.pack(len(c.tokens) // 4, c.key, c.tag) + c.tokens for c in entries
    )


@dataclass(frozen=True)
class Pin:
    """A pin: pages a process is using. Valid while its lease runs and, on this host, while the
    process that took it (same pid *and* start time) still runs."""

    pid: int
    start: str | None
    host: str
    at: float
    keys: tuple[bytes, ...] = ()

    def pack(self) -> bytes:
        return dump_json(
            {
                "v": 1,
                "pid": self.pid,
                "start": self.start,
                "host": self.host,
                "at": self.at,
                "keys": [k.hex() for k in self.keys],
            }
        )

    @classmethod
    def unpack(cls, raw: bytes) -> Pin:
        data = load_json(raw, "pin")
        if data.get("v", 1) != 1:
            raise StoreDataError(f"pin of version {data.get('v')!r}")
        start = data.get("start")
        keys = data.get("keys", [])
        if not isinstance(keys, list):
            raise StoreDataError("pin keys are not a list")
        return cls(
            pid=_count(data.get("pid"), "pin pid", low=1),
            start=None if start is None else _text(start, "pin start"),
            host=_text(data.get("host"), "pin host"),
            at=_finite(data.get("at"), "pin time"),
            keys=tuple(_key_hex(k, "pinned key") for k in keys),
        )
