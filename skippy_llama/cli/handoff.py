"""``skippy-llama kv-cache export|import|keygen``: signed handoff bundles (one prefix, or one
chain of restore points of a recurrent, hybrid or sliding-window model, moved between machines
that share no server).

Registered by :mod:`skippy_llama.cli.kvcache`; the ``cryptography`` package (the ``remote``
extra) is imported only when one of these commands runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..sizes import human_size
from .common import need, open_l3_for_change
from .options import add_settings_arguments, settings_from_args


def register(actions: Any) -> None:
    """Add ``export``, ``import`` and ``keygen`` to the ``kv-cache`` actions."""
    export = actions.add_parser(
        "export",
        help="write one cached prefix or restore point from L3 as a bundle signed with ed25519",
        description=(
            "Write one prefix's pages and manifest from the L3 store as a bundle signed with an "
            "ed25519 private key (`kv-cache keygen` makes one). PREFIX is a manifest id or its "
            "first hex digits, or a restore point's id (recurrent, hybrid and sliding-window "
            "models): its bundle carries the point and every shallower point it extends, "
            "snapshots and attention pages. --list prints the ids."
        ),
    )
    export.add_argument(
        "prefix", metavar="PREFIX_OR_ID", nargs="?", help="manifest or restore point id (or start)"
    )
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


def cmd_keygen(args: argparse.Namespace) -> int:
    need("cryptography")
    from ..handoff.bundle import generate_keypair

    name: Path = args.name
    private = name.with_name(name.name + ".pem")
    public = name.with_name(name.name + ".pub.pem")
    print_ = generate_keypair(private, public)
    print(f"wrote {private} (private, keep it) and {public} (public, for trust lists): {print_}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    need("cryptography")
    from ..handoff.l3 import export_prefix, list_prefixes
    from ..handoff.points import export_points, find_points, list_points

    loaded = settings_from_args(args)
    tier = open_l3_for_change(loaded, "export")
    try:
        if args.list:
            rows: list[dict[str, Any]] = [
                {
                    "id": m.id.hex(),
                    "kind": "prefix",
                    "model_identity": m.model_identity,
                    "model_name": m.model_name,
                    "tokens": m.n_tokens,
                    "pages": len(m.pages),
                }
                for m in list_prefixes(tier)
            ]
            rows += [
                {
                    "id": p.key.hex(),
                    "kind": "restore-point",
                    "model_identity": p.model_identity,
                    "model_name": p.model_name,
                    "tokens": p.n_tokens,
                    "bytes": p.size,
                }
                for p in list_points(tier)
            ]
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                for row in rows:
                    kind = " (restore point)" if row["kind"] == "restore-point" else ""
                    print(f"{row['id']}  {row['model_name']}: {row['tokens']} tokens{kind}")
            return 0
        if not args.prefix or args.output is None or args.key is None:
            raise ConfigError("kv-cache export needs PREFIX_OR_ID, OUT and --key PEM (or --list)")
        wanted = args.prefix.strip().lower()
        prefixes = [m for m in list_prefixes(tier) if m.id.hex().startswith(wanted)]
        if not prefixes and len(wanted) >= 4 and find_points(tier, wanted):
            points = export_points(tier, wanted, args.output, args.key)
        else:
            result = export_prefix(tier, args.prefix, args.output, args.key)
            points = None
    finally:
        tier.close()
    if points is not None:
        if args.json:
            print(json.dumps(vars(points), indent=2))
        else:
            print(
                f"exported {points.points} restore point(s) at {points.tokens} tokens (model "
                f"{points.model_identity}: snapshots {human_size(points.snapshot_bytes)}, "
                f"attention pages {human_size(points.page_bytes)}) to {args.output}: "
                f"{human_size(points.bytes)}"
            )
        return 0
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
    need("cryptography")
    from ..handoff.bundle import BundleRefused, load_trust, read_signed
    from ..handoff.l3 import check_bundle, import_bundle
    from ..handoff.points import KIND_POINTS, import_points, read_point_bundle

    loaded = settings_from_args(args)
    try:
        signed = read_signed(args.bundle, load_trust(args.trust))
        if signed.kind == KIND_POINTS:
            bundle = read_point_bundle(args.bundle, signed)
        else:
            check_bundle(args.bundle, args.trust)  # refused before L3 is even opened
    except BundleRefused as exc:
        print(f"skippy-llama: refused: {exc}", file=sys.stderr)
        return 3
    tier = open_l3_for_change(loaded, "import")
    if signed.kind == KIND_POINTS:
        try:
            points = import_points(tier, bundle)
        finally:
            tier.close()
        return _imported(
            args,
            points,
            f"imported {points.points} restore point(s) at {points.tokens} tokens (model "
            f"{points.model_identity}) signed by {points.signer} ({points.signer_file})"
            + ("" if points.stored else "; L3's policy did not keep all of them"),
        )
    try:
        result = import_bundle(tier, args.bundle, args.trust)
    except BundleRefused as exc:
        print(f"skippy-llama: refused: {exc}", file=sys.stderr)
        return 3
    finally:
        tier.close()
    return _imported(
        args,
        result,
        f"imported prefix {result.manifest_id} ({result.tokens} tokens, {result.pages} "
        f"pages, model {result.model_identity}) signed by {result.signer} "
        f"({result.signer_file})"
        + ("" if result.stored else "; L3's policy did not keep all of it"),
    )


def _imported(args: argparse.Namespace, result: Any, line: str) -> int:
    """Print an import's result (``--json``: its fields) and its exit status: 0 when L3 kept
    everything, 1 when its policy did not."""
    print(json.dumps(vars(result), indent=2) if args.json else line)
    return 0 if result.stored else 1
