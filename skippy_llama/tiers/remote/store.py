"""``RemoteStore``: the client of a shared Redis-protocol server (Redis, Valkey) that holds pages
and manifests; ``tier.py``'s ``RemoteTier`` puts it under the page-tier protocol.

The same content-addressed pages as L3 (16-byte chain keys from the cache identity), stored under
the cache identity (``keys.py``) in authenticated frames (``codec.py``). Reads are one pipelined
round trip to learn the match depth (:meth:`RemoteStore.match`) and pipelined batches to fetch
(:meth:`RemoteStore.fetch`), every page verified before a byte leaves the tier; writes
(:meth:`RemoteStore.push`) come from a background writer after L3 has the pages, and send only
the pages the server lacks. Operator calls (status of the server, clear, prune) are
``admin.py``'s.

Fail-open for data: a refused connection, a timeout, a server that restarted empty or evicted a
page, a value that does not verify are misses and counters, never exceptions. After
``remote.breaker_failures`` consecutive server failures the breaker opens for a back-off period
(``breaker.py``); while open a call costs a clock read. A server at ``maxmemory`` under
``noeviction`` (``OOM`` replies) or a read-only replica suspends writes only, for the same
back-off. A bug in this module's own code is logged as an error and counted
(``internal_errors``), and fails open too.

Page codec (``remote.codec``): under a lossy cache identity (one whose roster row qualified
CacheGen, see ``runtime/identity_params.py``) a store built with ``lossy`` parameters sends
CacheGen pages when ``remote.codec`` is cachegen (coding L3's lossless pages on the writer thread,
or sending L3's CacheGen pages as they are) and reads CacheGen or native pages back. A store of
an exact identity never decodes a CacheGen page: one found under its keys is a miss
(``bad_values.codec_mismatch``) and is deleted, so an exact instance never restores lossy values.

Fail-closed for configuration: no ``remote.secret_file``, or one that is not a private secret,
is a :class:`~skippy_llama.errors.ConfigError` naming the setting.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import redis

from ...codecs import cachegen, decode, encode
from ...codecs.cachegen import CacheGenParams
from ...config import RemoteSettings, redact_url
from ...errors import ConfigError, StateFormatError, UnknownCodecError
from ...parallel import submit
from ..base import RemoteMatch
from ..l3.auth import Signer, load_secret
from ..l3.schema import Manifest
from ..records import PageBlob, PrefixRecord
from . import codec
from .admin import Admin
from .breaker import Breaker
from .client import connect, failure_reason, first_error, is_server_failure
from .keys import Keys, secret_id

log = logging.getLogger("skippy_llama")

T = TypeVar("T")

#: Pages per pipelined GET batch: small, so the byte pool verifies and decodes one batch while
#: the socket reads the next (SmolLM2's 128-token pages are about 2 MB stored; on a loopback
#: server 8 per batch took 1.58x a local L3 restore, 2 per batch 1.26x), and a failure mid-prefix
#: wastes at most one batch.
FETCH_BATCH_PAGES = 2
#: Entries a node's child index keeps (a push that finds more starts it over), and a match reads:
#: a system prompt followed by many different questions must not make every lookup read them all.
MAX_CHILDREN = 64
#: What a child-index entry's tag is over (a tag of another kind of value never verifies as it).
CHILD_LABEL = b"remote-child"
#: Page bytes per pipelined SET batch of a push.
PUSH_BATCH_BYTES = 32 << 20
#: Failure reasons that are the server refusing writes while it still serves reads.
_WRITE_REFUSALS = ("oom", "readonly")


@dataclass(frozen=True)
class PushResult:
    """What one :meth:`RemoteStore.push` did."""

    pages_sent: int = 0
    pages_present: int = 0  # already on the server: not sent (their expiry refreshed)
    bytes_sent: int = 0  # page frames sent
    manifest_sent: bool = False
    skipped: str | None = None  # why nothing was sent: breaker_open, writes_suspended, failed


class RemoteStore:
    """The remote store's client: match, fetch, push, status (see the module docstring).

    Args:
        settings: ``remote`` settings (``url`` set).
        identity: the cache identity root (``CacheIdentity.root``) :meth:`holds` and
            :meth:`fetch` look under when not given one; an instance serves one identity.
        client: a ready client (tests); default: one for ``settings.url``.
        clock: monotonic clock of the breaker (tests).
        lossy: the CacheGen parameters of the cache identity, None for an exact identity (see
            the module docstring): with them the store reads CacheGen pages, and sends them
            when ``settings.codec`` is cachegen.

    Raises:
        ConfigError: ``remote.url`` or ``remote.secret_file`` is not set, or the secret file is
            missing, unreadable, not private, too short or too long (naming the setting).
    """

    def __init__(
        self,
        settings: RemoteSettings,
        *,
        identity: bytes | None = None,
        client: redis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
        lossy: CacheGenParams | None = None,
    ) -> None:
        if settings.url is None:
            raise ConfigError("invalid setting remote.url: not set, so there is no remote tier")
        if settings.secret_file is None:
            raise ConfigError(
                "invalid setting remote.secret_file: required with remote.url (every instance "
                "sharing the server holds the same secret)"
            )
        secret = load_secret(settings.secret_file, setting="remote.secret_file")
        self.settings = settings
        self._signer = Signer(secret)
        self.keys = Keys(settings.namespace, secret_id(self._signer))
        self._identity = identity.hex() if identity is not None else None
        self._client = client if client is not None else connect(settings)
        self._breaker = Breaker(settings.breaker_failures, settings.breaker_backoff_s, clock=clock)
        self._writes = Breaker(1, settings.breaker_backoff_s, clock=clock)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._bad: Counter[str] = Counter()
        self._closed = False
        self._lossy = lossy
        #: what pushes code pages with (None: native pages, as L3 stored them losslessly)
        self._push_params = lossy if settings.codec == "cachegen" else None
        self._admin = Admin(self._client, self.keys, self._signer, settings, self._bad_value)

    @classmethod
    def from_settings(cls, settings: RemoteSettings, **kwargs: Any) -> RemoteStore | None:
        """The tier, or None when ``remote.url`` is not set (the default: off)."""
        return cls(settings, **kwargs) if settings.enabled else None

    # ------------------------------------------------------------------ plumbing

    def _add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _bad_value(self, reason: str) -> None:
        with self._lock:
            self._bad[reason] += 1

    @property
    def available(self) -> bool:
        """Whether reads may go to the server now (open and the breaker closed); no I/O."""
        return not self._closed and not self._breaker.is_open

    def _allowed(self, *, write: bool = False) -> str | None:
        """Why no call may go to the server now, or None when one may."""
        if self._closed:
            return "closed"
        if write and self._writes.is_open:
            self._add("skipped_writes_suspended")
            return "writes_suspended"
        if not self._breaker.allow():
            self._add("skipped_breaker_open")
            return "breaker_open"
        return None

    def _failed(self, exc: BaseException, where: str) -> None:
        """Count a failed call (the caller fails open)."""
        if not is_server_failure(exc):
            self._add("internal_errors")
            log.error("remote tier internal error during %s (a bug)", where, exc_info=exc)
            self._breaker.success()  # not the server's fault: release a half-open probe
            return
        reason = failure_reason(exc)
        with self._lock:
            self._failures[reason] += 1
        if reason in _WRITE_REFUSALS:
            self._breaker.success()  # the server answered: reads go on
            if self._writes.failure(reason):
                log.warning(
                    "remote tier: the server refuses writes (%s: %s); pushes pause for %.0f s",
                    reason,
                    exc,
                    self.settings.breaker_backoff_s,
                )
            return
        if self._breaker.failure(reason):
            state = self._breaker.status()
            log.warning(
                "remote tier off after %d failures (%s during %s: %s); trying again at %s",
                state.consecutive_failures,
                reason,
                where,
                exc,
                time.strftime("%H:%M:%S", time.localtime(state.open_until or 0)),
            )

    def _run(self, where: str, call: Callable[[], T], *, write: bool = False) -> T | None:
        """``call()`` under the breaker; None when refused or failed (counted)."""
        if self._allowed(write=write) is not None:
            return None
        try:
            result = call()
        except Exception as exc:
            self._failed(exc, where)
            return None
        self._breaker.success()
        return result

    def _pipeline(
        self, build: Callable[[Any], object], *, raise_on_error: bool = True
    ) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        build(pipe)
        results: list[Any] = pipe.execute(raise_on_error=raise_on_error)
        return results

    def _each(self, command: str, names: Sequence[bytes]) -> list[Any]:
        """One pipelined round trip of ``command name`` for every name (EXISTS, GET, STRLEN)."""
        return self._pipeline(lambda pipe: [getattr(pipe, command)(name) for name in names])

    def _ident(self, root: bytes | None) -> str:
        if root is not None:
            return root.hex()
        if self._identity is None:
            raise ValueError("RemoteStore: no cache identity (pass root= or identity=)")
        return self._identity

    # ------------------------------------------------------------------ reads

    def holds(self, key: bytes, *, root: bytes | None = None) -> bool:
        """True when the server holds page ``key`` (EXISTS; not verified); False on failure."""
        name = self.keys.page(self._ident(root), key)
        found = self._run("holds", lambda: self._client.exists(name))
        return bool(found)

    def match(self, root: bytes, keys: Sequence[bytes]) -> RemoteMatch:
        """How many leading pages of ``keys`` (a prompt's chain keys, page 0 first, under the
        cache identity ``root``) the server holds, and the authenticated pages indexed after
        the deepest of them (a record's tail, see :meth:`push`).

        One pipelined round trip of EXISTS, which also reads the pages after the last of
        ``keys``; a second one only when the server holds some but not all of ``keys``.
        Nothing (depth 0) on a failure or while the breaker is open. Holding is not
        verifying: :meth:`fetch` may still serve fewer.
        """
        if not keys:
            return RemoteMatch(0)
        self._add("requests")
        ident = root.hex()
        names = [self.keys.page(ident, key) for key in keys]
        after_last = self.keys.children(ident, keys[-1])

        def build(pipe: Any) -> None:
            for name in names:
                pipe.exists(name)
            pipe.hgetall(after_last)

        found = self._run("match", functools.partial(self._pipeline, build)) or []
        depth = 0
        for hit in found[:-1]:
            if not hit:
                break
            depth += 1
        children: tuple[tuple[bytes, bytes], ...] = ()
        if depth:
            index = self.keys.children(ident, keys[depth - 1])
            entries = found[-1] if depth == len(keys) else None
            if entries is None:
                entries = self._run("match", functools.partial(self._client.hgetall, index))
            if entries:
                children = self._verified_children(index, entries)
        self._add("hits" if depth else "misses")
        self._add("pages_matched", depth)
        return RemoteMatch(depth, children)

    def _verified_children(
        self, name: bytes, entries: Mapping[Any, Any]
    ) -> tuple[tuple[bytes, bytes], ...]:
        """The entries of the index hash ``name`` that are authentic (others counted)."""
        out: list[tuple[bytes, bytes]] = []
        for key, value in list(entries.items())[:MAX_CHILDREN]:
            ok = isinstance(key, bytes) and isinstance(value, bytes) and len(key) == 16
            if not ok or len(value) <= codec.TAG_BYTES or (len(value) - codec.TAG_BYTES) % 4:
                self._bad_value("foreign_child")
                continue
            tag, raw = value[: codec.TAG_BYTES], value[codec.TAG_BYTES :]
            if not self._signer.verify(tag, self._signer.value(CHILD_LABEL, name, key, raw)):
                self._bad_value("unauthenticated_child")
                continue
            out.append((key, raw))
        return tuple(out)

    def fetch(self, keys: Sequence[bytes], *, root: bytes | None = None) -> list[bytes]:
        """The decoded pages of the longest prefix of ``keys`` the server holds and that
        verifies (tag, digest, the key it is stored under), fetched in pipelined batches.

        Each page is verified and decoded on the shared byte pool while the next batch is
        read from the socket. Stops at the first page that is missing or bad (counted by
        reason; a bad value is deleted so the next push stores it again). Never raises for
        server faults or bad data.
        """
        if not keys:
            return []
        ident = self._ident(root)
        self._add("fetches")
        checks: list[tuple[bytes, int, bool, Future[bytes | tuple[str, bool]]]] = []
        for start in range(0, len(keys), FETCH_BATCH_PAGES):
            names = [self.keys.page(ident, key) for key in keys[start : start + FETCH_BATCH_PAGES]]
            values = self._run("fetch", functools.partial(self._each, "get", names))
            if values is None:
                break
            for name, value in zip(names, values, strict=True):
                size = len(value) if isinstance(value, bytes) else 0
                lossy = size > codec.HEADER_BYTES and _is_cachegen(value)
                checks.append((name, size, lossy, submit(self._check_page, name, value)))
            if any(value is None for value in values):
                break  # evicted since match: the pages after it cannot be used
        out: list[bytes] = []
        lossy_pages = 0
        for name, size, lossy, check in checks:
            page = check.result()
            if isinstance(page, tuple):
                reason, drop = page
                self._bad_value(reason)
                if drop:
                    self._drop(name)
                break
            out.append(page)
            lossy_pages += lossy
            self._add("bytes_in", size)
        for *_, check in checks[len(out) :]:
            check.result()  # none runs on once the restore moves on
        self._add("pages_fetched", len(out))
        self._add("cachegen_pages_fetched", lossy_pages)
        return out

    def _check_page(self, name: bytes, value: Any) -> bytes | tuple[str, bool]:
        """The page in ``value`` read from ``name``, or why not and whether the value can never
        be served (so :meth:`fetch` deletes it). No side effects: runs on the byte pool."""
        if value is None:
            return "missing", False  # evicted, expired or deleted since match
        try:
            frame = codec.unpack(self._signer, name, codec.KIND_PAGE, value)
            if cachegen.codec_of(frame.body) is not None:
                if self._lossy is None:
                    return "codec_mismatch", True  # an exact identity never reads lossy values
                page: bytes | bytearray | memoryview = cachegen.decode(frame.body, frame.n_tokens)
            else:
                page = decode(frame.body, frame.n_tokens)
        except codec.FrameError as exc:
            return exc.reason, True
        except UnknownCodecError:
            return "unknown_codec", False  # authentic, from another version: kept
        except StateFormatError:
            return "undecodable", True
        return bytes(page)

    def _drop(self, name: bytes) -> None:
        """Delete a value that can never be served under ``name``, so a push stores it again."""
        if self._run("drop", lambda: self._client.delete(name)) is not None:
            self._add("bad_values_deleted")

    # ------------------------------------------------------------------ writes

    def push(
        self,
        record: PrefixRecord,
        *,
        stored: Mapping[bytes, bytes] | None = None,
        load: Callable[[bytes], bytes | None] | None = None,
        index: Collection[bytes] = (),
    ) -> PushResult:
        """Send ``record``'s pages the server lacks, then its manifest (call from a background
        writer, after L3 stored the pages; never on the request path).

        One pipelined round trip asks the length of every page and of the manifest (and
        refreshes their expiry when ``remote.ttl`` is set); only missing pages are sent, so a
        repeat push of a stored prefix sends no page bytes. A page's bytes come from ``stored``
        (page key -> the bytes L3 stored, what the L3 recorder encoded), else from the record's
        payload, else from ``load(key)``; a page none of them has ends what is pushed there.
        The pages whose keys are in ``index`` (those that end off a page boundary, which a
        match cannot name by an aligned key) are also entered in their parent's child index.
        Never raises for server faults.
        """
        ident = record.cache_identity
        pages = record.pages
        names = [self.keys.page(ident, page.key) for page in pages]
        mname = self.keys.manifest(ident, record.manifest_id)
        ttl = self.settings.ttl
        self._add("pushes")

        def probe(pipe: Any) -> None:
            for name in [*names, mname]:
                pipe.strlen(name)
                if ttl is not None:
                    pipe.expire(name, ttl)

        why = self._allowed(write=True)
        if why is not None:
            return PushResult(skipped=why)
        try:
            lengths = self._pipeline(probe)
        except Exception as exc:
            self._failed(exc, "push")
            return PushResult(skipped="failed")
        self._breaker.success()
        if ttl is not None:
            lengths = lengths[::2]
        sizes: list[int] = []
        sends: list[tuple[bytes, bytes]] = []
        present = 0
        for page, name, length in zip(pages, names, lengths, strict=False):
            if int(length) > codec.HEADER_BYTES:
                present += 1
                sizes.append(int(length) - codec.HEADER_BYTES)
                continue
            body = self._page_body(page, stored, load)
            if body is not None:
                body = self._wire(body, page.n_tokens)
            if body is None:
                self._add("pages_without_bytes")
                break
            sends.append(
                (name, codec.pack(self._signer, name, codec.KIND_PAGE, page.n_tokens, body))
            )
            sizes.append(len(body))
        sent, sent_bytes, ok = self._send(sends)
        self._add("pages_sent", sent)
        self._add("pages_present", present)
        self._add("bytes_out", sent_bytes)
        if not ok or not sizes:
            return PushResult(sent, present, sent_bytes, False, None if ok else "failed")
        n_pages = len(sizes)
        indexed = [page for page in pages[:n_pages] if page.key in index]
        if indexed:
            self._index(ident, indexed)
        # the pages' codec as L3's manifests name it (pages this store sent; the server's other
        # pages of a lossy identity were sent by instances of the same identity)
        coded = f"{cachegen.NAME}/{cachegen.CODEC_VERSION}" if self._push_params else "native"
        man = Manifest.of_record(
            record, [*sizes, *[1] * (len(pages) - n_pages)], time.time(), codec=coded
        )
        if n_pages < len(pages):
            man = man.cut(n_pages)
            mname = self.keys.manifest(ident, man.id)
        elif int(lengths[-1]) > codec.HEADER_BYTES:
            self._add("manifests_present")
            return PushResult(sent, present, sent_bytes, False)
        value = codec.pack(self._signer, mname, codec.KIND_MANIFEST, man.n_tokens, man.pack())
        done, _, ok = self._send([(mname, value)])
        if done:
            self._add("manifests_sent")
            self._add("manifest_bytes_out", len(value))
        return PushResult(sent, present, sent_bytes, bool(done), None if ok else "failed")

    def _index(self, ident: str, pages: Sequence[PageBlob]) -> None:
        """Enter ``pages`` (stored on the server) in their parents' child indexes."""
        ttl = self.settings.ttl
        entries = []
        for page in pages:
            name = self.keys.children(ident, page.parent)
            tag = self._signer.value(CHILD_LABEL, name, page.key, page.tokens)
            entries.append((name, page.key, tag + page.tokens))

        def add(pipe: Any) -> None:
            for name, key, value in entries:
                pipe.hset(name, key, value)
                pipe.hlen(name)
                if ttl is not None:
                    pipe.expire(name, ttl)

        def restart(full: list[tuple[bytes, bytes, bytes]], pipe: Any) -> None:
            for name, key, value in full:
                pipe.delete(name)
                pipe.hset(name, key, value)

        results = self._run("push", functools.partial(self._pipeline, add), write=True)
        if results is None:
            return
        sizes = results[1 :: 3 if ttl is not None else 2]
        full = [e for e, n in zip(entries, sizes, strict=True) if int(n) > MAX_CHILDREN]
        if full:  # a bound, not an LRU: the index of a busy node starts over
            self._run("push", functools.partial(self._pipeline, functools.partial(restart, full)))
        self._add("children_indexed", len(entries))

    @staticmethod
    def _page_body(
        page: PageBlob,
        stored: Mapping[bytes, bytes] | None,
        load: Callable[[bytes], bytes | None] | None,
    ) -> bytes | None:
        if stored is not None and page.key in stored:
            return bytes(stored[page.key])
        if page.payload is not None:
            return page.data  # the page itself (its own magic): fetch decodes it as stored
        if load is not None:
            data = load(page.key)
            return None if data is None else bytes(data)
        return None

    def _wire(self, body: bytes, n_tokens: int) -> bytes | None:
        """The bytes to send for a page L3 stored as ``body``, in this store's codec (see the
        module docstring); None when they cannot be made (counted; the push ends there)."""
        lossy_body = cachegen.codec_of(body) is not None
        try:
            if self._push_params is not None:
                if lossy_body:
                    return body  # L3 coded it with the identity's parameters already
                coded = cachegen.encode(decode(body, n_tokens), self._push_params)
                self._add("cachegen_pages_sent")
                return coded
            if lossy_body:
                # L3 keeps CacheGen pages, the server native ones: their decoded (lossy) values
                return encode(bytes(cachegen.decode(body, n_tokens)), "zstd")
        except cachegen.CodecUnsupportedError:
            self._add("codec_unsupported")  # a page CacheGen does not code: sent native
        except (StateFormatError, UnknownCodecError) as exc:
            log.warning("remote tier: a page L3 stored does not decode (%s); not pushed", exc)
            return None
        return body

    def _send(self, items: list[tuple[bytes, bytes]]) -> tuple[int, int, bool]:
        """SET ``items`` in pipelined batches: (values stored, their bytes, no failure)."""
        ttl = self.settings.ttl
        done = done_bytes = 0
        for batch in _batches(items, PUSH_BATCH_BYTES):
            build = functools.partial(_set_all, batch, ttl)
            results = self._run(
                "push", functools.partial(self._pipeline, build, raise_on_error=False), write=True
            )
            if results is None:
                return done, done_bytes, False
            for (_, value), result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    break
                done += 1
                done_bytes += len(value)
            error = first_error(results)
            if error is not None:
                self._failed(error, "push")
                return done, done_bytes, False
        return done, done_bytes, True

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """Settings, breaker state and counters of this process (no server call: cheap enough
        for ``/metrics``)."""
        breaker = self._breaker.status()
        writes = self._writes.status()
        with self._lock:
            counts = dict(self._counts)
            failures = dict(self._failures)
            bad = dict(self._bad)
        activity = {
            name: counts.get(name, 0)
            for name in (
                "requests", "hits", "misses", "pages_matched", "fetches", "pages_fetched",
                "bytes_in", "pushes", "pages_sent", "pages_present", "bytes_out",
                "manifests_sent", "manifests_present", "manifest_bytes_out", "children_indexed",
                "pages_without_bytes", "skipped_breaker_open", "skipped_writes_suspended",
                "bad_values_deleted", "internal_errors", "cachegen_pages_sent",
                "cachegen_pages_fetched", "codec_unsupported",
                # restore points (``points.py``)
                "point_hits", "point_misses", "point_bytes_in", "point_pushes", "point_writes",
                "point_values_sent", "point_values_present", "point_bytes_out",
                "points_dropped", "point_pushes_queued", "point_queue_full",
                "point_pending_hits",
            )
        }  # fmt: skip
        assert self.settings.url is not None
        return {
            "state": "closed" if self._closed else ("off" if breaker.state == "open" else "on"),
            "url": redact_url(self.settings.url),
            "namespace": self.settings.namespace,
            "secret_id": self.keys.secret,
            "ttl": self.settings.ttl,
            "timeout_ms": self.settings.timeout_ms,
            "codec": {
                "configured": self.settings.codec,
                "identity": self._lossy.describe() if self._lossy is not None else "native",
                "sends": "cachegen" if self._push_params is not None else "native",
            },
            "breaker": asdict(breaker),
            "writes": asdict(writes),
            "activity": activity,
            "failures": failures,
            "bad_values": bad,
        }

    def server_status(self) -> dict[str, Any]:
        """What the server says and what this namespace holds there (``admin.py``).

        Raises:
            TierError: the server cannot be reached or answers with an error.
        """
        return self._admin.server_status()

    def clear(self, identity_hex: str | None = None) -> dict[str, Any]:
        """Delete every key of one cache identity in this namespace (every identity: None),
        under any secret; other identities' keys are untouched (``admin.py``).

        Raises:
            TierError: the server cannot be reached or answers with an error.
        """
        return self._admin.clear(identity_hex)

    def prune(self, identity_hex: str | None = None) -> dict[str, Any]:
        """Remove what can never be served again (``admin.py``).

        Raises:
            TierError: the server cannot be reached or answers with an error.
        """
        return self._admin.prune(identity_hex)

    def close(self) -> None:
        """Close the connections; later calls are misses."""
        if self._closed:
            return
        self._closed = True
        try:
            self._client.close()
        except Exception as exc:  # closing must not raise at exit
            log.debug("remote tier: closing the client failed: %s", exc)

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_cachegen(value: bytes) -> bool:
    """Whether a page frame's body is a CacheGen payload (its magic; nothing verified)."""
    return cachegen.codec_of(memoryview(value)[codec.HEADER_BYTES :]) is not None


def _set_all(items: list[tuple[bytes, bytes]], ttl: int | None, pipe: Any) -> None:
    for name, value in items:
        pipe.set(name, value, ex=ttl)


def _batches(
    items: list[tuple[bytes, bytes]], max_bytes: int
) -> Iterator[list[tuple[bytes, bytes]]]:
    batch: list[tuple[bytes, bytes]] = []
    size = 0
    for item in items:
        batch.append(item)
        size += len(item[1])
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
