"""``skippy-llama package create|verify``: build and check model packages."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..packages.create import create_package
from ..packages.kvdtype import KVDtypeResolution, resolve_kv_dtype
from ..packages.manifest import MANIFEST_NAME
from ..packages.verify import VerificationReport, verify_package

_CREATE_EPILOG = """\
examples:
  # publisher files copied by hand from the repository at that commit
  skippy-llama package create --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
      --repo-id HuggingFaceTB/SmolLM2-135M-Instruct \\
      --revision 0123456789abcdef0123456789abcdef01234567 \\
      --metadata-dir ./smollm2-files ./smollm2-pkg

  # publisher files from the local huggingface_hub cache (no network)
  skippy-llama package create --gguf model.gguf --repo-id ORG/NAME --revision SHA \\
      --from-hf-cache ./pkg

The revision must be a full 40-hex commit id: branches and tags move, commits do not.
The package records every file with its size and sha256; check it later with
`skippy-llama package verify`.
"""

_VERIFY_EPILOG = f"""\
Re-hashes every file listed in {MANIFEST_NAME}, re-reads the GGUF geometry and compares it
with the publisher's config.json, then shows the live K/V dtype the package resolves to.

exit status: 0 the package is intact (publisher metadata validated, rejected or absent);
             1 a file is missing, changed or unlisted; 2 not a package / bad arguments.
"""


def register(sub: Any) -> None:
    """Register ``package`` with its ``create`` and ``verify`` subcommands."""
    p = sub.add_parser(
        "package",
        help="build and verify model packages (GGUF + publisher metadata at one commit)",
        description=(
            "A model package binds a GGUF to its publisher's Hugging Face metadata at one "
            "immutable commit. Validated publisher metadata decides the live K/V cache dtype "
            "unless you override it."
        ),
    )
    psub = p.add_subparsers(dest="package_command", metavar="ACTION", required=True)

    c = psub.add_parser(
        "create",
        help="build a package folder from a GGUF and publisher metadata",
        description="Build a model package folder. Offline first: publisher files come from a "
        "folder or the local huggingface_hub cache.",
        epilog=_CREATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument(
        "--gguf",
        action="append",
        required=True,
        type=Path,
        metavar="FILE",
        help="the GGUF file; repeat for every shard of a split model, first shard first",
    )
    c.add_argument(
        "--repo-id", required=True, metavar="ORG/NAME", help="Hugging Face repository id"
    )
    c.add_argument(
        "--revision",
        required=True,
        metavar="SHA",
        help="full 40-hex commit id of the repository the metadata comes from (not a branch)",
    )
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--metadata-dir",
        type=Path,
        metavar="DIR",
        help="folder holding the publisher's config.json (and generation_config.json, "
        "tokenizer_config.json, special_tokens_map.json where present)",
    )
    src.add_argument(
        "--from-hf-cache",
        action="store_true",
        help="take the publisher files from the huggingface_hub cache at --revision "
        "(local_files_only unless --allow-download)",
    )
    src.add_argument(
        "--no-metadata",
        action="store_true",
        help="package the GGUF without publisher metadata (loads with F16/F16 K/V)",
    )
    c.add_argument(
        "--hf-cache-dir",
        type=Path,
        metavar="DIR",
        help="huggingface_hub cache folder (default: HF_HUB_CACHE or ~/.cache/huggingface/hub)",
    )
    c.add_argument(
        "--allow-download",
        action="store_true",
        help="with --from-hf-cache: let huggingface_hub download missing files, pinned to "
        "--revision",
    )
    c.add_argument(
        "--hardlink",
        action="store_true",
        help="hard-link the GGUF into the package instead of copying it (same filesystem only)",
    )
    c.add_argument("--json", action="store_true", help="print the manifest as JSON")
    c.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="new (or empty) package folder")
    c.set_defaults(handler=_create)

    v = psub.add_parser(
        "verify",
        help="re-hash a package and check its publisher metadata against the GGUF",
        description="Verify a model package folder.",
        epilog=_VERIFY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument("dir", type=Path, metavar="DIR", help="the package folder")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(handler=_verify)


def _create(args: argparse.Namespace) -> int:
    if args.allow_download and not args.from_hf_cache:
        print(
            "skippy-llama: note: --allow-download only applies to --from-hf-cache", file=sys.stderr
        )
    result = create_package(
        args.out_dir,
        gguf=args.gguf,
        repo_id=args.repo_id,
        revision=args.revision,
        metadata_dir=args.metadata_dir,
        from_hf_cache=args.from_hf_cache,
        hf_cache_dir=args.hf_cache_dir,
        allow_download=args.allow_download,
        link="hardlink" if args.hardlink else "copy",
    )
    m = result.manifest
    if args.json:
        print(m.model_dump_json(indent=2))
        return 0
    print(f"created package {result.root}")
    print(f"  repo:     {m.repo_id} @ {m.revision}")
    for f in m.files:
        print(f"  file:     {f.path} ({f.size} bytes, sha256 {f.sha256[:16]}…)")
    _print_verdict(m.validation.publisher_metadata, m.validation.reasons)
    return 0


def _print_verdict(verdict: str, reasons: list[str] | tuple[str, ...]) -> None:
    label = {
        "validated": "validated",
        "rejected": "REJECTED (not used; K/V falls back to F16/F16 unless you override)",
        "absent": "absent",
    }.get(verdict, verdict)
    print(f"  publisher metadata: {label}")
    for r in reasons:
        print(f"    - {r}")


def _resolution(report: VerificationReport) -> KVDtypeResolution:
    reason = None if report.publisher is not None else "; ".join(report.reasons)
    return resolve_kv_dtype(
        user_k=None, user_v=None, publisher=report.publisher, publisher_unavailable=reason
    )


def _verify(args: argparse.Namespace) -> int:
    report = verify_package(args.dir)
    resolution = _resolution(report) if report.intact else None
    if args.json:
        data = report.to_dict()
        data["kv_dtype"] = resolution.to_dict() if resolution else None
        print(json.dumps(data, indent=2))
    else:
        m = report.manifest
        print(f"package {report.root}")
        print(f"  repo:     {m.repo_id} @ {m.revision}")
        print(f"  gguf:     {', '.join(m.gguf)}")
        if report.intact:
            print(f"  files:    {len(m.files)} listed, sizes and sha256 match")
            g = report.geometry
            if g is not None:
                print(
                    f"  geometry: {g.architecture}, layers={g.layers} hidden={g.hidden_size} "
                    f"heads={g.heads} kv_heads={g.kv_heads} head_dim={g.head_dim} "
                    f"vocab={g.vocab} ctx={g.context_length} rope_base={g.rope_base}"
                )
            _print_verdict(report.verdict, report.reasons)
            if resolution is not None:
                print(f"  live KV dtype (no override): {resolution.describe()}")
        else:
            print("  integrity: FAILED")
            for p in report.problems:
                print(f"    - {p.describe()}")
    if not report.intact:
        names = ", ".join(p.path for p in report.problems)
        print(
            f"skippy-llama: error: package {report.root} failed verification ({names}); "
            "restore the files or re-create the package",
            file=sys.stderr,
        )
        return 1
    return 0
