"""``skippy-llama kv-cache export|import|keygen``: signed handoff bundles (one prefix moved
between machines that share no server) and the ``--remote`` side of ``kv-cache
status|prune|clear``.

Registered by :mod:`skippy_llama.cli.kvcache`; the ``cryptography`` and ``redis`` packages (the
``remote`` extra) are imported only when one of these commands runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..config import LoadedSettings
from ..errors import ConfigError
from ..sizes import human_size
from .options import add_settings_arguments, settings_from_args

_EXTRA_HINT = "pip install 'skippy-llama[remote]'"


def _need(module: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"this command needs the {module!r} package: {_EXTRA_HINT}")


def register(actions: Any) -> None:
    """Add ``export``, ``import`` and ``keygen`` to the ``kv-cache`` actions."""
    export = actions.add_parser(
        "export",
        help="write one cached prefix from L3 as a bundle signed with ed25519",
        description=(
            "Write one prefix's pages and manifest from the L3 store as a bundle signed with an "
            "ed25519 private key (`kv-cache keygen` makes one). PREFIX is a manifest id or its "
            "first hex digits; --list prints the ids."
        ),
    )
    export.add_argument("prefix", metavar="PREFIX_OR_ID", nargs="?", help="manifest id (or start)")
    export.add_argument("output", metavar="OUT", nargs="?", type=Path, help="bundle file to write")
    export.add_argument("--key", metavar="PEM", type=Path, help="ed25519 private key (PEM)")
    export.add_argument("--list", action="store_true", help="list the prefixes L3 holds")
    export.add_argument("--json", action="store_true", help="print the result as JSON")
    add_settings_arguments(export)
    export.set_defaults(handler=cmd_export)

    imp = actions.add_parser(
        "import",
        help="store a bundle's prefix in L3, only if signed by a trusted key",
        description=(
            "Check a bundle (signed by a key in the trust list, signature, digests, chain keys) "
            "and store its prefix in the L3 store. Anything else is refused with the reason; "
            "nothing is written then."
        ),
    )
    imp.add_argument("bundle", metavar="BUNDLE", type=Path)
    imp.add_argument(
        "--trust",
        metavar="DIR_OR_FILE",
        type=Path,
        required=True,
        help="a trusted ed25519 public key (PEM), or a directory of them (*.pem, *.pub)",
    )
    imp.add_argument("--json", action="store_true", help="print the result as JSON")
    add_settings_arguments(imp)
    imp.set_defaults(handler=cmd_import)

    keygen = actions.add_parser(
        "keygen",
        help="make an ed25519 key pair for signing bundles",
        description=(
            "Write NAME.pem (the private key, mode 0600: keep it on the exporting machine) and "
            "NAME.pub.pem (the public key: put it in the importers' trust list)."
        ),
    )
    keygen.add_argument("name", metavar="NAME", type=Path, help="path without extension")
    keygen.set_defaults(handler=cmd_keygen)


def _open_l3(loaded: LoadedSettings, what: str) -> Any:
    from .kvcache import _open_for_change

    return _open_for_change(loaded, what)


def cmd_keygen(args: argparse.Namespace) -> int:
    _need("cryptography")
    from ..handoff.bundle import generate_keypair

    name: Path = args.name
    private = name.with_name(name.name + ".pem")
    public = name.with_name(name.name + ".pub.pem")
    print_ = generate_keypair(private, public)
    print(f"wrote {private} (private, keep it) and {public} (public, for trust lists): {print_}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    _need("cryptography")
    from ..handoff.l3 import export_prefix, list_prefixes

    loaded = settings_from_args(args)
    tier = _open_l3(loaded, "export")
    try:
        if args.list:
            rows = [
                {
                    "id": m.id.hex(),
                    "model_identity": m.model_identity,
                    "model_name": m.model_name,
                    "tokens": m.n_tokens,
                    "pages": len(m.pages),
                }
                for m in list_prefixes(tier)
            ]
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                for row in rows:
                    print(f"{row['id']}  {row['model_name']}: {row['tokens']} tokens")
            return 0
        if not args.prefix or args.output is None or args.key is None:
            raise ConfigError("kv-cache export needs PREFIX_OR_ID, OUT and --key PEM (or --list)")
        result = export_prefix(tier, args.prefix, args.output, args.key)
    finally:
        tier.close()
    if args.json:
        print(json.dumps(vars(result), indent=2))
    else:
        print(
            f"exported prefix {result.manifest_id} ({result.tokens} tokens, {result.pages} "
            f"pages, model {result.model_identity}) to {args.output}: "
            f"{human_size(result.bytes)}"
        )
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    _need("cryptography")
    from ..handoff.bundle import BundleRefused
    from ..handoff.l3 import check_bundle, import_bundle

    loaded = settings_from_args(args)
    try:
        check_bundle(args.bundle, args.trust)  # refused before L3 is even opened
    except BundleRefused as exc:
        print(f"skippy-llama: refused: {exc}", file=sys.stderr)
        return 3
    tier = _open_l3(loaded, "import")
    try:
        result = import_bundle(tier, args.bundle, args.trust)
    except BundleRefused as exc:
        print(f"skippy-llama: refused: {exc}", file=sys.stderr)
        return 3
    finally:
        tier.close()
    if args.json:
        print(json.dumps(vars(result), indent=2))
    else:
        print(
            f"imported prefix {result.manifest_id} ({result.tokens} tokens, {result.pages} "
            f"pages, model {result.model_identity}) signed by {result.signer} "
            f"({result.signer_file})"
            + ("" if result.stored else "; L3's policy did not keep all of it")
        )
    return 0 if result.stored else 1


# ---------------------------------------------------------------------- --remote


def open_remote(loaded: LoadedSettings) -> Any:
    """The remote tier of the settings; ConfigError naming the setting when it is off."""
    remote = loaded.settings.remote
    if remote.url is None:
        raise ConfigError(
            "remote.url is not set: no remote tier to act on; pass --remote-url "
            "redis://host:6379/0 and --remote-secret-file FILE, or set SKIPPY_REMOTE__URL"
        )
    _need("redis")
    from ..tiers.remote import RemoteTier

    return RemoteTier(remote)


def remote_status(loaded: LoadedSettings) -> dict[str, Any]:
    tier = open_remote(loaded)
    try:
        server = tier.server_status()
        return {"tier": tier.status(), "server": server}
    finally:
        tier.close()


def format_remote_status(report: dict[str, Any]) -> str:
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
                f"; {entry['other_secrets']} keys of other secrets"
                if entry["other_secrets"]
                else ""
            )
        )
    return "\n".join(lines)


def _remote_identities(tier: Any, model_identity: str | None, cache_identity: str | None) -> Any:
    """The cache identities to act on: one given, those of a model, or None (all)."""
    if cache_identity is not None:
        from ..tiers.remote.keys import check_identity

        try:
            return [check_identity(cache_identity)]
        except ValueError as exc:
            raise ConfigError(f"--cache-identity: {exc}") from None
    if model_identity is None:
        return None
    inventory = tier.server_status()["inventory"]
    found = [ident for ident, entry in inventory.items() if model_identity in entry["models"]]
    if not found:
        known = sorted({mid for entry in inventory.values() for mid in entry["models"]})
        raise ConfigError(
            f"unknown model identity {model_identity!r} on the remote server; known: "
            f"{', '.join(known) or 'none (no manifests under this secret)'}"
        )
    return found


def remote_change(args: argparse.Namespace, what: str) -> int:
    """``kv-cache prune|clear --remote``."""
    from .kvcache import _confirm

    loaded = settings_from_args(args)
    tier = open_remote(loaded)
    try:
        idents = _remote_identities(
            tier, args.model_identity, getattr(args, "cache_identity", None)
        )
        scope = "every identity" if idents is None else f"cache identities {', '.join(idents)}"
        where = f"the remote tier at {tier.status()['url']} (namespace {tier.settings.namespace})"
        verb = "Remove every key of" if what == "clear" else "Prune unreachable entries of"
        if not _confirm(f"{verb} {scope} from {where}?", args.yes):
            print(f"{what} cancelled", file=sys.stderr)
            return 1
        run = tier.clear if what == "clear" else tier.prune
        results = [run(ident) for ident in (idents if idents is not None else [None])]
    finally:
        tier.close()
    if args.json:
        print(json.dumps(results, indent=2))
    elif what == "clear":
        removed = sum(r["keys_removed"] for r in results)
        print(f"cleared {removed} remote keys ({scope})")
    else:
        print(
            f"pruned the remote tier ({scope}): "
            f"{sum(r['manifests_cut'] for r in results)} prefixes cut back, "
            f"{sum(r['pages_removed'] for r in results)} unreachable pages and "
            f"{sum(r['manifests_removed_bad'] for r in results)} bad manifests removed"
        )
    return 0


def add_remote_flag(parser: argparse.ArgumentParser, *, identity: bool = False) -> None:
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
