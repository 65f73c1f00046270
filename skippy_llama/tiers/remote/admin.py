"""The remote tier's operator calls (``kv-cache status|prune|clear --remote``): what the server
holds per cache identity, clear by identity, prune what can no longer be served.

Restore points (records ``r:``, their pages ``q:``, the length index ``n:`` and the owner
``o:``, issue 46) are counted, cleared and pruned with the pages and manifests of their cache
identity (``points_admin.py``); ``--model-identity`` finds an identity by its manifests or by the
owner its points name.

Unlike the request path these raise :class:`~skippy_llama.errors.TierError` when the server
cannot be reached, so the CLI reports it; they walk the namespace with SCAN (never KEYS), in
pipelined batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis

from ...config import RemoteSettings, redact_url
from ...errors import TierError
from ..l3.auth import Signer
from ..l3.schema import Manifest
from . import codec
from .client import failure_reason
from .keys import CHILDREN, MANIFEST, PAGE, POINT, POINT_LENGTHS, POINT_OWNER, POINT_PAGE, Keys
from .points_admin import PointAdmin

#: Keys per SCAN step and per pipelined batch.
SCAN_COUNT = 1000


class Admin:
    """Operator calls over one client, key scheme and secret."""

    #: keys per SCAN step and per pipelined batch
    batch = SCAN_COUNT

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        signer: Signer,
        settings: RemoteSettings,
        bad_value: Callable[[str], None],
    ) -> None:
        self._client = client
        self.keys = keys
        self._signer = signer
        self.settings = settings
        self._bad_value = bad_value
        self._points = PointAdmin(self)

    def _unavailable(self, exc: BaseException) -> TierError:
        return TierError(
            f"remote server {redact_url(self.settings.url or '')} unavailable: "
            f"{failure_reason(exc)}: {exc}"
        )

    def _each(
        self, command: str, names: Sequence[bytes], *, raise_on_error: bool = True
    ) -> list[Any]:
        """One pipelined round trip of ``command name`` per name; without ``raise_on_error``
        a failed command's result is its exception (a foreign value of another type)."""
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            getattr(pipe, command)(name)
        results: list[Any] = pipe.execute(raise_on_error=raise_on_error)
        return results

    def server_status(self) -> dict[str, Any]:
        """What the server says (version, memory, eviction policy, evictions) and what this
        namespace holds there, per cache identity (``kv-cache status --remote``).

        Raises:
            TierError: the server cannot be reached or answers with an error.
        """
        try:
            info: dict[str, Any] = self._client.info()
            inventory: dict[str, dict[str, Any]] = {}
            manifests: list[bytes] = []
            owners: list[bytes] = []
            for name, size in self._scan_sizes(self.keys.pattern()):
                parsed = self.keys.parse(name)
                if parsed is None:
                    continue
                ident, secret, kind, _ = parsed
                entry = inventory.setdefault(
                    ident,
                    {"pages": 0, "manifests": 0, "child_entries": 0, "bytes": 0,
                     "other_secrets": 0, "models": {}, "codecs": {},
                     "restore_points": 0, "restore_point_pages": 0,
                     "restore_point_bytes": 0, "restore_point_lengths": 0},
                )  # fmt: skip
                if secret != self.keys.secret:
                    entry["other_secrets"] += 1
                    continue
                if kind == CHILDREN:
                    entry["child_entries"] += size
                    continue
                if kind == POINT_LENGTHS:
                    entry["restore_point_lengths"] += size
                    continue
                if kind == POINT_OWNER:
                    owners.append(name)
                    continue
                entry["bytes"] += size
                if kind in (POINT, POINT_PAGE):  # restore points (issue 46): records + pages
                    entry["restore_point_bytes"] += size
                    entry["restore_points" if kind == POINT else "restore_point_pages"] += 1
                if kind == PAGE:
                    entry["pages"] += 1
                elif kind == MANIFEST:
                    entry["manifests"] += 1
                    manifests.append(name)
            for name, man in self._manifests(manifests):
                parsed = self.keys.parse(name)
                assert parsed is not None
                entry = inventory[parsed[0]]
                entry["models"][man.model_identity] = man.model_name
                # prefixes per page codec: a lossy identity's are cachegen/<version>
                entry["codecs"][man.codec] = entry["codecs"].get(man.codec, 0) + 1
            # the model an identity's restore points belong to (it may have no manifest)
            for ident, mid, label in self._points.owners(owners):
                inventory[ident]["models"].setdefault(mid, label)
        except redis.exceptions.RedisError as exc:
            raise self._unavailable(exc) from None
        version = info.get("valkey_version") or info.get("redis_version")
        return {
            "server": "valkey" if "valkey_version" in info else "redis",
            "version": str(version),
            "run_id": info.get("run_id"),
            "uptime_s": info.get("uptime_in_seconds"),
            "used_memory": info.get("used_memory"),
            "maxmemory": info.get("maxmemory"),
            "maxmemory_policy": info.get("maxmemory_policy"),
            "evicted_keys": info.get("evicted_keys"),
            "inventory": inventory,
        }

    def _scan(self, pattern: bytes) -> Iterator[bytes]:
        for name in self._client.scan_iter(match=pattern, count=SCAN_COUNT):
            yield bytes(name)

    def _scan_sizes(self, pattern: bytes) -> Iterator[tuple[bytes, int]]:
        batch: list[bytes] = []
        for name in self._scan(pattern):
            batch.append(name)
            if len(batch) >= SCAN_COUNT:
                yield from self._sizes(batch)
                batch = []
        if batch:
            yield from self._sizes(batch)

    def _sizes(self, names: list[bytes]) -> list[tuple[bytes, int]]:
        """Bytes of each value; for a child index (a hash), its entries."""

        pipe = self._client.pipeline(transaction=False)
        for name in names:
            parsed = self.keys.parse(name)
            hashed = parsed is not None and parsed[2] in (CHILDREN, POINT_LENGTHS)
            pipe.hlen(name) if hashed else pipe.strlen(name)
        lengths = pipe.execute(raise_on_error=False)  # a foreign value of another type: 0
        return [
            (name, n if isinstance(n, int) else 0) for name, n in zip(names, lengths, strict=True)
        ]

    def _manifests(self, names: list[bytes]) -> Iterator[tuple[bytes, Manifest]]:
        """The manifests under ``names`` that verify (others are counted and skipped)."""
        for start in range(0, len(names), SCAN_COUNT):
            batch = names[start : start + SCAN_COUNT]
            values = self._each("get", batch, raise_on_error=False)
            for name, value in zip(batch, values, strict=True):
                parsed = self.keys.parse(name)
                if value is None or parsed is None:
                    continue
                try:
                    frame = codec.unpack(self._signer, name, codec.KIND_MANIFEST, value)
                    man = Manifest.unpack(bytes(frame.body), parsed[3])
                except codec.FrameError as exc:
                    self._bad_value(exc.reason)
                    continue
                except TierError:
                    self._bad_value("damaged_manifest")
                    continue
                if man.cache_identity != parsed[0]:
                    self._bad_value("foreign")
                    continue
                yield name, man

    def clear(self, identity_hex: str | None = None) -> dict[str, Any]:
        """Delete every key of cache identity ``identity_hex`` in this namespace (every
        identity: None), under any secret: SCAN + UNLINK. Other identities' keys are untouched.

        Raises:
            TierError: the server cannot be reached or answers with an error.
        """
        kinds = {POINT: 0, POINT_PAGE: 0}
        removed = 0
        try:
            batch: list[bytes] = []
            for name in self._scan(self.keys.pattern(identity_hex)):
                batch.append(name)
                if len(batch) >= SCAN_COUNT:
                    removed += self._unlink_counted(batch, kinds)
                    batch = []
            if batch:
                removed += self._unlink_counted(batch, kinds)
        except redis.exceptions.RedisError as exc:
            raise self._unavailable(exc) from None
        return {
            "identity": identity_hex,
            "keys_removed": removed,
            "restore_points_removed": kinds[POINT],
            "restore_point_pages_removed": kinds[POINT_PAGE],
        }

    def _unlink_counted(self, names: list[bytes], kinds: dict[bytes, int]) -> int:
        """UNLINK ``names`` (one pipelined round trip); how many existed, and of those the
        kinds in ``kinds`` counted there."""
        removed = self._each("unlink", names)
        for name, n in zip(names, removed, strict=True):
            parsed = self.keys.parse(name)
            if n and parsed is not None and parsed[2] in kinds:
                kinds[parsed[2]] += 1
        return sum(int(n) for n in removed)

    def prune(self, identity_hex: str | None = None) -> dict[str, Any]:
        """Remove what can never be served again: manifests that do not verify, the pages of a
        prefix after a page the server lost (a match stops at the gap; pages another complete
        prefix still reaches are kept), and cut those prefixes' manifests back to the gap; and
        the restore points that can never be served (:meth:`.PointAdmin.prune`). Server-side
        eviction (``maxmemory``) is what bounds the size; this tidies after it.

        Raises:
            TierError: the server cannot be reached or answers with an error.
        """
        bad = cut = 0
        doomed: set[bytes] = set()
        kept: set[bytes] = set()
        try:
            names = list(self._scan(self.keys.pattern(identity_hex, MANIFEST, mine=True)))
            good = dict(self._manifests(names))
            bad_names = [name for name in names if name not in good]
            if bad_names:
                bad = int(self._client.unlink(*bad_names))
            for name, man in good.items():
                ident = man.cache_identity
                pnames = [self.keys.page(ident, key) for key in man.keys]
                found = self._each("exists", pnames)
                depth = next((i for i, hit in enumerate(found) if not hit), len(found))
                kept.update(pnames[:depth])
                if depth == len(found):
                    continue
                doomed.update(pnames[depth + 1 :])
                self._client.unlink(name)
                if depth:
                    short = man.cut(depth)
                    sname = self.keys.manifest(ident, short.id)
                    value = codec.pack(
                        self._signer, sname, codec.KIND_MANIFEST, short.n_tokens, short.pack()
                    )
                    self._client.set(sname, value, ex=self.settings.ttl)
                cut += 1
            pages = sorted(doomed - kept)
            removed = int(self._client.unlink(*pages)) if pages else 0
            points = self._points.prune(identity_hex)
        except redis.exceptions.RedisError as exc:
            raise self._unavailable(exc) from None
        return {
            "identity": identity_hex,
            "manifests_checked": len(names),
            "manifests_removed_bad": bad,
            "manifests_cut": cut,
            "pages_removed": removed,
            **points.to_json(),
        }
