"""The read path: serve the longest prefix of pages that exist, verify and decode.

Each page is checked in order: its metadata parses, its payload is there (absent is told apart
from unreadable), has the declared size and digest, carries a valid tag when the store has a
secret, and decodes within the size its token count allows. The first page that fails ends the
prefix:

* damaged metadata, a wrong size or digest, an undecodable frame, an untrusted row: quarantined
  (the manifests that listed it are cut back to the valid prefix) and counted;
* a missing payload: its metadata is dropped and the manifests cut back (``missing_pages``);
* an unreadable payload (EIO, EMFILE, EACCES …): a fault and a miss; nothing is deleted;
* no valid tag (the store has a secret): a miss counted as ``unauthenticated``, and quarantined
  so that a record under the secret writes it again; an unknown codec: ``unknown_codec``.

Pages are read into one buffer per calling thread, reused by its next read (a fresh ``bytes``
object per page costs its page faults, which were most of an L3 restore's read time on the
H200); what a read returns are views into it. CacheGen pages (lossy, ``codecs/cachegen.py``) are
decoded, once verified, into a second such buffer, as native page bytes: what follows the read
cannot tell them from exact pages, and the cache identity keeps the two apart.

Hits are noted in memory per page and stored by the writer thread in batches (:class:`Touches`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ...codecs import cachegen, decode
from ...errors import StateFormatError, StoreDataError, UnknownCodecError, UntrustedRowError
from ...hostmem import commit, fit
from ...parallel import PARALLEL_BYTES, ordered
from .context import Parts
from .pins import Pins
from .schema import DATA, PageMeta
from .store import StoredRow
from .tree import Tree, payload_digest

#: A page key no page has (keys are digests): :meth:`Reader.prepare` looks it up to open the
#: calling thread's database connection.
_NEVER_STORED = b"skippy-llama:prepare"


@dataclass(frozen=True)
class _Located:
    key: bytes
    meta: PageMeta
    row: StoredRow


@dataclass(frozen=True)
class _Lossy:
    """A verified CacheGen payload, to be decoded into the decode buffer (``size`` bytes)."""

    payload: memoryview
    size: int
    n_tokens: int


@dataclass(frozen=True)
class ReadResult:
    """The decoded pages served (a prefix of the keys asked for) and their metadata.

    An uncompressed page is a view into the reading thread's buffer, valid until that thread's
    next :meth:`Reader.read`; copy what must outlive it (L2 does).
    """

    pages: list[bytes | memoryview]
    metas: list[PageMeta]


def _size_problem(size: int | None, expected: int) -> str | None:
    """Why a payload of ``size`` bytes (None: its file is gone) cannot be the page's
    ``expected`` bytes, or None when it can."""
    if size is None:
        return "missing"  # checked again before repairs
    if size != expected:
        return "truncated" if size < expected else "size"
    return None


class Touches:
    """Per-page hits and last-use times waiting to be stored (page key -> (last use, hits))."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[bytes, tuple[float, int]] = {}

    def note(self, keys: Sequence[bytes], now: float) -> None:
        with self._lock:
            for key in keys:
                _, hits = self._pending.get(key, (now, 0))
                self._pending[key] = (now, hits + 1)

    def take(self) -> dict[bytes, tuple[float, int]]:
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending


class Reader:
    """Verified reads of page payloads (see the module docstring)."""

    def __init__(self, parts: Parts, tree: Tree, pins: Pins) -> None:
        self.parts = parts
        self.tree = tree
        self.pins = pins
        self.touches = Touches()
        self._local = threading.local()  # .buffer: this thread's read buffer

    def _buffer(self, size: int, name: str = "buffer") -> memoryview:
        """This thread's read (or decode) buffer, at least ``size`` bytes (replaced, never
        resized: views handed out earlier keep their memory)."""
        buf = fit(getattr(self._local, name, None), size)
        setattr(self._local, name, buf)
        return memoryview(buf)

    def prepare(self, size: int) -> None:
        """Ready the calling thread for reads of up to ``size`` bytes of pages: its read
        buffer made and its memory committed (:func:`~skippy_llama.hostmem.commit`), its
        database connection opened by one lookup of a key that is never stored. A restore's
        read-ahead threads call this at load (``KVSeam.warm_reads``): a fresh SmolLM2
        process's first L3 restore of 3,900 tokens otherwise faulted 7,200 pages (29 MB) in
        its two read threads and opened a connection in each (8 and ~7 ms of their CPU on a
        loaded machine). A buffer already large enough is left as it is (a view of it may be
        in use). Never raises: what fails here happens again, and is handled, on the first
        read."""
        old = getattr(self._local, "buffer", None)
        with contextlib.suppress(OSError, MemoryError):
            buf = fit(old, size)
            if buf is not old:
                self._local.buffer = buf
                commit(buf)
        store = self.parts.store
        if store is not None:
            with contextlib.suppress(Exception):  # the first read meets it again, handled
                self.tree.meta(_NEVER_STORED)
                store.row(DATA + _NEVER_STORED)

    def release(self) -> None:
        """Drop the calling thread's buffers (on close: a restored prefix's size of memory
        would otherwise stay with the tier object)."""
        self._local.buffer = None
        self._local.decoded = None

    def meta_field(self, key: bytes, where: str) -> tuple[bytes, int] | None:
        """(digest, reference count) of a stored page from its metadata alone; None when absent,
        damaged (a read quarantines it) or unreadable (a counted fault)."""
        try:
            meta = self.tree.meta(key)
        except StoreDataError:
            return None
        except Exception as exc:
            self.parts.health.fault(exc, where)
            return None
        return None if meta is None else (meta.digest, len(meta.owners))

    def _bad(self, key: bytes, reason: str) -> None:
        if self.parts.rw_ok:
            self.tree.quarantine(key, reason)
        else:
            self.parts.counters.add("corrupt_entries")

    def _locate(self, key: bytes) -> _Located | None:
        """A page's metadata and where its payload lies (SQLite, the caller's thread), or None
        (and the failure handled)."""
        store = self.parts.store
        assert store is not None
        try:
            meta = self.tree.meta(key)
        except UntrustedRowError:
            self._bad(key, "untrusted_row")
            return None
        except StoreDataError:
            self._bad(key, "bad_metadata")
            return None
        if meta is None:
            return None  # the chain simply ends here
        try:
            row = store.row(DATA + key)
        except UntrustedRowError:
            self._bad(key, "untrusted_row")
            return None
        if row is None:
            self._failed(key, "missing")
            return None
        # the file's real size, not the metadata's claim, sizes the read buffer
        try:
            problem = _size_problem(row.size(), meta.size)
        except UntrustedRowError:
            problem = "untrusted_payload"
        if problem is not None:
            self._failed(key, problem)
            return None
        return _Located(key, meta, row)

    def _load(self, page: _Located, out: memoryview) -> bytes | memoryview | _Lossy | str:
        """Read ``page`` into ``out`` (its ``meta.size`` bytes), verify and decode it: the page,
        or why it cannot be served.

        Runs on any thread (file read, digest, tag and decode, no SQLite) and changes nothing:
        :meth:`_failed` acts on the reason, in order, on the caller's thread.
        """
        try:
            size = page.row.read_into(out)
        except UntrustedRowError:
            return "untrusted_payload"
        meta = page.meta
        problem = _size_problem(size, meta.size)  # the file may have changed since it was located
        if problem is not None:
            return problem
        payload = out
        if payload_digest(payload) != meta.digest:
            return "digest_mismatch"
        signer = self.parts.signer
        if signer.enabled and not signer.verify(
            meta.tag, signer.page(page.key, meta.n_tokens, payload)
        ):
            return "unauthenticated"
        try:
            if cachegen.codec_of(payload) is not None:
                return _Lossy(payload, cachegen.decoded_size(payload, meta.n_tokens), meta.n_tokens)
            return decode(payload, meta.n_tokens)
        except UnknownCodecError:
            return "unknown_codec"
        except StateFormatError:
            return "undecodable"

    def _load_slot(self, slot: tuple[_Located, memoryview]) -> bytes | memoryview | _Lossy | str:
        return self._load(*slot)

    @staticmethod
    def _decode_slot(slot: tuple[_Lossy, memoryview]) -> memoryview | str:
        lossy, out = slot
        try:
            cachegen.decode_into(lossy.payload, out, lossy.n_tokens)
        except UnknownCodecError:
            return "unknown_codec"
        except StateFormatError:
            return "undecodable"
        return out

    def _decode_lossy(
        self, located: list[_Located], outcomes: list[bytes | memoryview | _Lossy]
    ) -> tuple[list[bytes | memoryview], str | None]:
        """The served pages: CacheGen payloads decoded into this thread's decode buffer (in
        parallel when there are several). Stops at the first page that does not decode, with
        its reason (handled by the caller like a read failure)."""
        lossy = [o for o in outcomes if isinstance(o, _Lossy)]
        if not lossy:
            return [o for o in outcomes if not isinstance(o, _Lossy)], None
        buffer = self._buffer(sum(o.size for o in lossy), "decoded")
        slots: list[tuple[_Lossy, memoryview]] = []
        for o in lossy:
            slots.append((o, buffer[: o.size]))
            buffer = buffer[o.size :]
        pages: list[bytes | memoryview] = []
        with contextlib.closing(
            ordered(self._decode_slot, slots, parallel=len(slots) > 1)
        ) as decoded:
            for page, outcome in zip(located, outcomes, strict=False):
                if isinstance(outcome, _Lossy):
                    result = next(decoded)
                    if isinstance(result, str):
                        self._failed(page.key, result)
                        return pages, result
                    pages.append(result)
                else:
                    pages.append(outcome)
        return pages, None

    def _failed(self, key: bytes, reason: str) -> None:
        """Count and repair after a page that cannot be served (see the module docstring)."""
        parts = self.parts
        if reason == "missing":
            parts.counters.add("missing_pages")
            if parts.rw_ok:
                self.tree.cut_back(key, "missing")
        elif reason == "unauthenticated":
            parts.counters.add("unauthenticated")
            # out of service like a damaged page, so that the next record of these tokens
            # writes it again under the secret (a store that just got one heals as it is used)
            if parts.rw_ok:
                self.tree.quarantine(key, "unauthenticated", corrupt=False)
        elif reason == "unknown_codec":
            parts.counters.add("unknown_codec")  # another version's data: a miss, kept
        elif reason == "untrusted_payload":
            assert parts.store is not None
            parts.store.refuse(DATA + key)
            self._bad(key, "untrusted_row")
        else:
            self._bad(key, reason)

    def read(self, keys: Sequence[bytes]) -> ReadResult:
        """Pages of the longest prefix of ``keys`` that exists and verifies; never raises for
        storage faults (they are counted)."""
        outcomes: list[bytes | memoryview | _Lossy] = []
        metas: list[PageMeta] = []
        with self.pins.local(keys):
            located: list[_Located] = []
            for key in keys:
                try:
                    found = self._locate(key)
                except Exception as exc:  # transient I/O, locks; a bug is logged as one
                    self.parts.health.fault(exc, "read")
                    break
                if found is None:
                    break
                located.append(found)
            total = sum(page.meta.size for page in located)
            buffer = self._buffer(total)
            slots: list[tuple[_Located, memoryview]] = []
            for page in located:
                slots.append((page, buffer[: page.meta.size]))
                buffer = buffer[page.meta.size :]
            parallel = total >= PARALLEL_BYTES
            with contextlib.closing(ordered(self._load_slot, slots, parallel=parallel)) as loads:
                for page in located:
                    try:
                        outcome = next(loads)
                    except Exception as exc:
                        self.parts.health.fault(exc, "read")
                        break
                    if isinstance(outcome, str):
                        self._failed(page.key, outcome)
                        break
                    outcomes.append(outcome)
                    metas.append(page.meta)
            pages, failed = self._decode_lossy(located, outcomes)
            if failed is not None:
                metas = metas[: len(pages)]
        if pages:
            self.touches.note(keys[: len(pages)], time.time())
        return ReadResult(pages, metas)
