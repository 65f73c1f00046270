"""The ``--remote`` side of ``skippy-llama kv-cache status|prune|clear``: the remote store's
server status, and clearing or pruning its keys.

Registered by :mod:`skippy_llama.cli.kvcache`; the ``redis`` package (the ``remote`` extra) is
imported only when one of these commands runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..config import LoadedSettings
from ..errors import ConfigError
from ..sizes import human_size
from .common import confirm, need
from .options import settings_from_args


def open_store(loaded: LoadedSettings) -> Any:
    """The remote store's client for the settings; ConfigError naming the setting when the
    remote tier is off."""
    remote = loaded.settings.remote
    if remote.url is None:
        raise ConfigError(
            "remote.url is not set: no remote tier to act on; pass --remote-url "
            "redis://host:6379/0 and --remote-secret-file FILE, or set SKIPPY_REMOTE__URL"
        )
    need("redis")
    from ..tiers.remote.store import RemoteStore

    return RemoteStore(remote)


def status(loaded: LoadedSettings) -> dict[str, Any]:
    """``kv-cache status --remote``: this client's view and the server's."""
    store = open_store(loaded)
    try:
        server = store.server_status()
        return {"tier": store.status(), "server": server}
    finally:
        store.close()


def format_status(report: dict[str, Any]) -> str:
    """:func:`status`'s report as text."""
    tier, server = report["tier"], report["server"]
    lines = [
        f"remote tier: {tier['url']} namespace {tier['namespace']} (secret id "
        f"{tier['secret_id']}, ttl {tier['ttl'] or 'none'}, timeout {tier['timeout_ms']} ms)",
        f"  server       {server['server']} {server['version']}, memory "
        f"{human_size(int(server['used_memory'] or 0))} of "
        f"{human_size(int(server['maxmemory'])) if server['maxmemory'] else 'no limit'} "
        f"({server['maxmemory_policy']}), evicted keys {server['evicted_keys']}",
    ]
    if not server["inventory"]:
        lines.append("  inventory: empty")
    for ident, entry in sorted(server["inventory"].items()):
        models = ", ".join(f"{mid} ({name})" for mid, name in entry["models"].items()) or "?"
        lines.append(
            f"  {ident}: {entry['manifests']} prefixes, {entry['pages']} pages, "
            f"{human_size(entry['bytes'])}; models {models}"
            + (
                f"; codecs {', '.join(f'{c} {n}' for c, n in sorted(entry['codecs'].items()))}"
                if set(entry.get("codecs", {})) - {"native"}
                else ""
            )
            + (
                f"; {entry['other_secrets']} keys of other secrets"
                if entry["other_secrets"]
                else ""
            )
        )
        if entry.get("restore_points") or entry.get("restore_point_pages"):
            lines.append(
                f"    restore points: {entry['restore_points']} records, "
                f"{entry['restore_point_pages']} pages, "
                f"{human_size(entry['restore_point_bytes'])}; "
                f"{entry.get('restore_point_lengths', 0)} lengths listed"
            )
    return "\n".join(lines)


def _identities(store: Any, model_identity: str | None, cache_identity: str | None) -> Any:
    """The cache identities to act on: one given, those of a model, or None (all)."""
    if cache_identity is not None:
        from ..tiers.remote.keys import check_identity

        try:
            return [check_identity(cache_identity)]
        except ValueError as exc:
            raise ConfigError(f"--cache-identity: {exc}") from None
    if model_identity is None:
        return None
    inventory = store.server_status()["inventory"]
    found = [ident for ident, entry in inventory.items() if model_identity in entry["models"]]
    if not found:
        known = sorted({mid for entry in inventory.values() for mid in entry["models"]})
        raise ConfigError(
            f"unknown model identity {model_identity!r} on the remote server; known: "
            f"{', '.join(known) or 'none (no manifests or restore points under this secret)'}"
        )
    return found


def change(args: argparse.Namespace, what: str) -> int:
    """``kv-cache prune|clear --remote``."""
    loaded = settings_from_args(args)
    store = open_store(loaded)
    try:
        idents = _identities(store, args.model_identity, getattr(args, "cache_identity", None))
        scope = "every identity" if idents is None else f"cache identities {', '.join(idents)}"
        where = f"the remote tier at {store.status()['url']} (namespace {store.settings.namespace})"
        verb = "Remove every key of" if what == "clear" else "Prune unreachable entries of"
        if not confirm(f"{verb} {scope} from {where}?", args.yes):
            print(f"{what} cancelled", file=sys.stderr)
            return 1
        run = store.clear if what == "clear" else store.prune
        results = [run(ident) for ident in (idents if idents is not None else [None])]
    finally:
        store.close()
    if args.json:
        print(json.dumps(results, indent=2))
    elif what == "clear":
        removed = sum(r["keys_removed"] for r in results)
        print(
            f"cleared {removed} remote keys ({scope}), among them "
            f"{sum(r['restore_points_removed'] for r in results)} restore points and "
            f"{sum(r['restore_point_pages_removed'] for r in results)} of their pages"
        )
    else:

        def total(field: str) -> int:
            return sum(int(r[field]) for r in results)

        print(
            f"pruned the remote tier ({scope}): "
            f"{total('manifests_cut')} prefixes cut back, "
            f"{total('pages_removed')} unreachable pages and "
            f"{total('manifests_removed_bad')} bad manifests removed; restore points: "
            f"{total('points_checked')} checked, "
            f"{total('points_removed_unservable')} removed for a lost page and "
            f"{total('points_removed_bad')} bad ones, "
            f"{total('point_pages_removed')} of their pages and "
            f"{total('point_lengths_removed')} length entries removed"
            + (f"; {total('foreign_keys')} foreign keys skipped" if total("foreign_keys") else "")
        )
    return 0


def add_flag(parser: argparse.ArgumentParser, *, identity: bool = False) -> None:
    """Add ``--remote`` (and, with ``identity``, ``--cache-identity``) to ``parser``."""
    parser.add_argument(
        "--remote",
        action="store_true",
        help="act on the remote tier (remote.url) instead of L3",
    )
    if identity:
        parser.add_argument(
            "--cache-identity",
            metavar="HEX",
            default=None,
            help="with --remote: only this cache identity's keys",
        )
