"""Identity: what makes cached bytes valid for a context, and the chained page keys.

The *cache identity* is a digest over everything that changes the bytes of a page or their
meaning: the model file's content, its geometry, the live KV layout (types, v_trans, per-layer row
sizes, rope/yarn, SWA, unified cache), the llama.cpp state-format and skippy page-format
versions, the backend (unless cross-backend sharing is opted into) and a user namespace. Page keys
chain from it: ``h_i = xxh3_128(h_{i-1} || tokens_i)`` with ``h_{-1}`` = the identity, so a page
key names one exact token prefix under one identity, and a lookup walks the chain from page 0.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from .state.format import STATE_FORMAT_VERSION
from .state.pages import PAGE_FORMAT_VERSION

KEY_BYTES = 16
_DIGEST_CHUNK = 8 << 20
#: Tensor-name fragments of models whose continuation state is not only attention KV.
RECURRENT_MARKERS = ("ssm_", "time_mix", "recurrent", "rwkv")


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/skippy-llama`` (``~/.cache/skippy-llama``): the memos of this user."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "skippy-llama"


def _identity_cache_path() -> Path:
    return user_cache_dir() / "file-digests.json"


#: Files at least this large report hashing progress (a multi-GB GGUF takes seconds to minutes).
PROGRESS_BYTES = 1 << 30
#: ``progress(done_bytes, total_bytes)``, called after each chunk of a long hash.
DigestProgress = Callable[[int, int], None]


def file_stamp(path: str | os.PathLike[str]) -> str:
    """What the digest memo trusts a file by: device, inode, size, mtime and ctime.

    Size and mtime alone survive an in-place rewrite that restores the mtime (``os.utime``);
    the ctime cannot be set back by a user, and device and inode catch a replaced file.
    """
    st = Path(path).stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def read_memo(memo: Path) -> dict[str, Any]:
    """A JSON memo's table; empty when it is missing, unreadable or not an object."""
    try:
        table = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def write_memo(memo: Path, key: str, value: Any) -> None:
    """Set ``key`` in a JSON memo, replaced atomically; failures are ignored (a memo only saves
    work)."""
    table = read_memo(memo)
    table[key] = value
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table))
        os.replace(tmp, memo)
    except OSError:
        pass  # the memo is an optimisation; an unwritable cache dir only costs a re-hash


def stderr_progress(name: str) -> DigestProgress:
    """A progress callback printing ``hashing NAME: 37% (1.2 of 3.3 GiB)`` lines to stderr."""
    shown = [-1]

    def report(done: int, total: int) -> None:
        percent = 100 * done // max(total, 1)
        if percent // 10 == shown[0] // 10 and percent < 100:
            return  # one line per 10 %
        shown[0] = percent
        print(
            f"skippy-llama: hashing {name} for the cache identity: {percent}% "
            f"({done / (1 << 30):.1f} of {total / (1 << 30):.1f} GiB)",
            file=sys.stderr,
            flush=True,
        )

    return report


def file_digest(
    path: str | os.PathLike[str],
    *,
    memo: Path | None = None,
    progress: DigestProgress | None = None,
) -> str:
    """Tagged content digest of a file (``xxh3:<hex>``), memoized by :func:`file_stamp`.

    Hashing a multi-GB GGUF takes seconds, so the result is kept in a small JSON file and reused
    while the file's stamp is unchanged. A digest recorded with :func:`record_file_digest` (a
    model package's verified sha256) is returned as it is, so a package is not hashed twice.
    Files of :data:`PROGRESS_BYTES` or more report to ``progress`` (default: lines on stderr).
    """
    p = Path(path).resolve()
    stamp = file_stamp(p)
    memo = memo or _identity_cache_path()
    hit = read_memo(memo).get(str(p))
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("digest"), str):
        return str(hit["digest"])
    size = p.stat().st_size
    if progress is None and size >= PROGRESS_BYTES:
        progress = stderr_progress(p.name)
    h = xxhash.xxh3_128()
    done = 0
    with p.open("rb") as f:
        while chunk := f.read(_DIGEST_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress is not None and size >= PROGRESS_BYTES:
                progress(done, size)
    digest = "xxh3:" + h.hexdigest()
    if file_stamp(p) == stamp:  # not rewritten while it was read
        write_memo(memo, str(p), {"stamp": stamp, "digest": digest})
    return digest


def record_file_digest(
    path: str | os.PathLike[str], digest: str, stamp: str, *, memo: Path | None = None
) -> bool:
    """Remember a digest verified by another route (``sha256:<hex>`` of a model package).

    ``stamp`` is the :func:`file_stamp` taken *before* the file was verified; nothing is recorded
    (and False returned) when the file changed since, so the memo never pairs a stamp with
    content it did not see. Algorithms are tagged, so equal content may have two digests: that
    costs a miss, never a wrong hit.
    """
    p = Path(path).resolve()
    if ":" not in digest or file_stamp(p) != stamp:
        return False
    write_memo(memo or _identity_cache_path(), str(p), {"stamp": stamp, "digest": digest})
    return True


def process_digest() -> str:
    """A digest unique to this process: the model identity when only L1 (in-process) is on.

    L1 never leaves the process, so it needs no content digest; a random tag can never equal a
    content digest, so a per-process identity cannot address L2/L3 pages.
    """
    return "process:" + uuid.uuid4().hex


@dataclass(frozen=True)
class ModelIdentity:
    """A model file's content digest plus the architecture and geometry it declares."""

    digest: str
    architecture: str
    geometry: Mapping[str, int | float | str] = field(default_factory=dict)
    name: str = ""

    @property
    def durable(self) -> bool:
        """Whether the digest names the file's content (L2/L3 may use it), not this process."""
        return not self.digest.startswith("process:")

    @property
    def id(self) -> str:
        """The short id operators pass to ``--model-identity`` (hex, 32 chars)."""
        h = xxhash.xxh3_128()
        h.update(self.digest.encode())
        h.update(self.architecture.encode())
        h.update(json.dumps(dict(self.geometry), sort_keys=True).encode())
        return h.hexdigest()


@dataclass(frozen=True)
class CacheIdentity:
    """Every field that decides whether stored pages may be restored into a context."""

    model: ModelIdentity
    layout_digest: str
    type_k: int
    type_v: int
    flash_attn: bool
    v_trans: bool
    rope_freq_base: float
    rope_freq_scale: float
    yarn: tuple[float, ...]
    n_swa: int
    kv_unified: bool
    backend: str
    namespace: str = ""
    state_format: int = STATE_FORMAT_VERSION
    page_format: int = PAGE_FORMAT_VERSION
    #: Runtime parameters that change the bytes (LoRA, kv_overrides, offload, batch split …),
    #: as chosen by ``runtime/identity_params.py``'s table; JSON values only.
    params: Mapping[str, Any] = field(default_factory=dict)
    #: The lossy page codec and its parameters (``CacheGenParams.identity()``), empty for exact
    #: pages: an instance that stores exact pages can never address a lossy one. Left out of
    #: :meth:`fields` when empty, so exact identities are what they always were.
    codec: Mapping[str, Any] = field(default_factory=dict)

    @property
    def codec_name(self) -> str:
        """``native`` for exact pages, else ``<codec>/<version>`` (``cachegen/1``)."""
        if not self.codec:
            return "native"
        return f"{self.codec.get('name')}/{self.codec.get('version')}"

    @property
    def durable(self) -> bool:
        """Whether pages under this identity may be shared beyond this process (L2/L3)."""
        return self.model.durable

    def fields(self) -> dict[str, Any]:
        """The identity as a flat JSON-ready dict (status output, tests)."""
        return {
            "model_identity": self.model.id,
            "model_digest": self.model.digest,
            "architecture": self.model.architecture,
            "geometry": dict(self.model.geometry),
            "layout_digest": self.layout_digest,
            "type_k": self.type_k,
            "type_v": self.type_v,
            "flash_attn": self.flash_attn,
            "v_trans": self.v_trans,
            "rope_freq_base": self.rope_freq_base,
            "rope_freq_scale": self.rope_freq_scale,
            "yarn": list(self.yarn),
            "n_swa": self.n_swa,
            "kv_unified": self.kv_unified,
            "backend": self.backend,
            "namespace": self.namespace,
            "state_format": self.state_format,
            "page_format": self.page_format,
            "params": dict(self.params),
        } | ({"codec": dict(self.codec)} if self.codec else {})

    @property
    def root(self) -> bytes:
        """``h_{-1}``: the 16-byte root of every page-key chain under this identity."""
        return xxhash.xxh3_128(json.dumps(self.fields(), sort_keys=True).encode()).digest()

    @property
    def hex(self) -> str:
        return self.root.hex()


def token_bytes(tokens: Sequence[int] | npt.NDArray[np.integer[Any]]) -> bytes:
    """Tokens as little-endian int32 bytes: the hashed form of a page's content."""
    return np.asarray(tokens, dtype="<i4").tobytes()


def chain_key(parent: bytes, tokens: Sequence[int] | npt.NDArray[np.integer[Any]]) -> bytes:
    """``xxh3_128(parent || tokens)``: the key of the page holding ``tokens`` after ``parent``."""
    h = xxhash.xxh3_128(parent)
    h.update(token_bytes(tokens))
    return h.digest()


def page_keys(
    root: bytes, tokens: Sequence[int] | npt.NDArray[np.integer[Any]], page_tokens: int
) -> list[bytes]:
    """Keys of every *full* page of ``tokens``, chained from ``root``."""
    arr = np.asarray(tokens, dtype="<i4")
    keys: list[bytes] = []
    parent = root
    for start in range(0, len(arr) - page_tokens + 1, page_tokens):
        parent = chain_key(parent, arr[start : start + page_tokens])
        keys.append(parent)
    return keys


def paging_refusal(
    architecture: str, tensor_names: Iterable[str], *, recurrent: bool
) -> str | None:
    """Why a model's state must not be paged, or ``None`` when paging is sound.

    Recurrent, hybrid and SSM models carry state beyond attention KV, so a prefix of cells is not
    a prefix of the state.
    """
    if recurrent:
        return f"{architecture}: recurrent or hybrid memory is not attention KV alone"
    for name in tensor_names:
        for marker in RECURRENT_MARKERS:
            if marker in name:
                return f"{architecture}: tensor {name!r} marks recurrent state ({marker})"
    return None
