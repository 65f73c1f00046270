"""``skippy-llama kv-cache status|prune|clear``: inspect and manage the L3 disk store (and, with
``--remote``, the remote tier, see ``remote.py``; ``export|import|keygen``: signed bundles, see
``handoff.py``).

Settings come from the same flags, ``SKIPPY_*`` environment and config file as ``skippy-llama
run`` (see :mod:`skippy_llama.cli.options`), so ``status`` describes exactly the store a run would
use. ``status`` never changes the store (no reconciliation; it shows the latest one recorded);
``prune`` and ``clear`` ask for confirmation unless ``--yes``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..config import Settings
from ..errors import ConfigError
from ..models import resolve_model_path
from ..packages.kvdtype import KVDtypeResolution
from ..sizes import human_size, parse_size
from ..tiers.disk import DiskTier
from ..tiers.l3.report import status_report
from . import handoff, remote, simulate
from .common import confirm, open_l3_for_change
from .options import (
    add_kv_dtype_arguments,
    add_settings_arguments,
    kv_dtype_from_args,
    model_kwargs,
    settings_from_args,
)


def register(sub: Any) -> None:
    """Register ``kv-cache`` and its ``status``, ``prune`` and ``clear`` actions."""
    parser = sub.add_parser(
        "kv-cache",
        help="inspect and manage the L3 disk KV cache",
        description=(
            "Inspect and manage the L3 disk KV cache: effective state, usage, activity, "
            "reconciliation and per-model inventory; prune to a size or a model; clear."
        ),
    )
    actions = parser.add_subparsers(dest="kv_command", metavar="ACTION", required=True)

    status = actions.add_parser(
        "status",
        help="state, usage, activity and inventory; the native library and its verdict",
        description=(
            "The L3 store's state, usage, activity and inventory, L1's memory, the live K/V "
            "dtype, the native llama.cpp library's recipe against the split-certified roster "
            "and, with --model or --package, that model's verdict (the model is loaded to "
            "read its live KV layout; the store is not opened for it)."
        ),
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="GGUF model whose native verdict to print (loaded as `run` loads it)",
    )
    add_settings_arguments(status)
    add_kv_dtype_arguments(status)
    remote.add_flag(status)
    status.set_defaults(handler=cmd_status)

    prune = actions.add_parser(
        "prune",
        help="evict least-recently-used entries to a size, or one model's entries",
        description=(
            "Evict least-recently-used entries (probation first) down to --target, or every "
            "entry of --model-identity (both: that model's entries down to the target). "
            "With neither, apply the configured budget now. Entries in use are kept."
        ),
    )
    prune.add_argument("--target", metavar="SIZE", help="prune down to this size, e.g. 10GiB")
    prune.add_argument("--model-identity", metavar="ID", help="only this model's entries")
    prune.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    prune.add_argument("--json", action="store_true", help="print the result as JSON")
    add_settings_arguments(prune)
    remote.add_flag(prune, identity=True)
    prune.set_defaults(handler=cmd_prune)

    clear = actions.add_parser("clear", help="remove every entry, or one model's entries")
    clear.add_argument("--model-identity", metavar="ID", help="only this model's entries")
    clear.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    clear.add_argument("--json", action="store_true", help="print the result as JSON")
    add_settings_arguments(clear)
    remote.add_flag(clear, identity=True)
    clear.set_defaults(handler=cmd_clear)
    simulate.register(actions)
    handoff.register(actions)


# ---------------------------------------------------------------------- helpers


def _check_model_flag(value: str | None) -> None:
    if value is not None and not value.strip():
        raise ConfigError(
            "--model-identity is blank; pass an id that `skippy-llama kv-cache status` lists "
            "under inventory, or leave the flag out to act on every model"
        )


# ---------------------------------------------------------------------- status


def cmd_status(args: argparse.Namespace) -> int:
    """``kv-cache status [--json] [--remote]``."""
    loaded = settings_from_args(args)
    if args.remote:
        report = remote.status(loaded)
        print(json.dumps(report, indent=2) if args.json else remote.format_status(report))
        return 0
    # Read-only: status must not change the store (not even diskcache's settings table, nor a
    # missing directory); it reports the latest reconciliation recorded.
    tier = DiskTier(loaded.settings.l3, reconcile=False, close_at_exit=False, read_only=True)
    try:
        status = tier.status()
        report = status_report(loaded, status, tier)
    finally:
        tier.close()
    resolution, package = kv_dtype_from_args(args)
    report["kv_dtype"] = resolution.to_dict()
    if package is not None:
        report["kv_dtype"]["package"] = package.summary()
    report["l1"] = l1_memory(loaded.settings)
    if package is not None and args.model:
        raise ConfigError("give --model or --package, not both")
    model: Path | None = None
    if package is not None:
        model = package.gguf_path
    elif args.model:
        model = resolve_model_path(args.model)
    report["native"] = native_report(loaded.settings, resolution, model)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False))
    else:
        print(format_status(report))
    return 0


def native_report(
    settings: Settings, resolution: KVDtypeResolution, model: Path | None
) -> dict[str, Any]:
    """The native library's recipe against the roster, and ``model``'s verdict when given.

    The model is loaded as ``run`` loads it (same K/V types, flash attention rule and L1
    settings) with L3 off, so the verdict is the one a run gets and the store is not touched.
    """
    from ..runtime.recipe import native_status

    if model is None:
        return native_status()
    from ..runtime.llama import SkippyLlama

    no_l3 = settings.model_copy(update={"l3": settings.l3.model_copy(update={"mode": "off"})})
    llm = SkippyLlama(str(model), cache_settings=no_l3, **model_kwargs(resolution, 512))
    try:
        return native_status(llm.native_verdict, str(model))
    finally:
        llm.close()


def l1_memory(settings: Settings) -> dict[str, Any]:
    """What L1 will hold beside the context, in tokens and as a multiple of plain Llama's KV."""
    l1 = settings.l1
    if not l1.enabled:
        return {"enabled": False, "summary": "off"}
    budget = l1.budget_tokens
    share = "≤ 2×" if budget is None else f"1 + {budget}/n_ctx ×"
    return {
        "enabled": True,
        "max_prefixes": l1.max_prefixes,
        "budget_tokens": budget if budget is not None else "n_ctx",
        "summary": (
            f"up to {l1.max_prefixes} resident prefixes (device checkpoints), "
            f"{budget if budget is not None else 'n_ctx'} tokens in all: KV memory {share} "
            "that of plain Llama at the same n_ctx"
        ),
    }


def _when(ts: float | None) -> str:
    return "never" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def format_status(report: dict[str, Any]) -> str:
    """Human-readable status."""
    eff, usage, act = report["effective"], report["usage"], report["activity"]
    state = eff["state"] + (f" ({eff['reason']})" if eff.get("reason") else "")
    lines = [f"L3 disk cache: {state}"]
    if eff.get("detail"):
        lines.append(f"  problem      {eff['detail']}")
    if eff["state"] != "off":
        free = usage["filesystem_available_bytes"]
        lines += [
            f"  directory    {eff['directory']}",
            f"  budget       {human_size(usage['budget_bytes'])} ({eff['mode']})",
            f"  used         {human_size(usage['used_bytes'])}",
            f"  free space   {'unknown' if free is None else human_size(free)}"
            f" (reserve {human_size(usage['minimum_free_bytes'])})",
            f"  entries      {usage['manifests']} prefixes, {usage['pages']} pages, "
            f"{usage['quarantined']} quarantined"
            + (
                f", {usage['skipped_manifests']} prefixes skipped (damaged or unauthentic)"
                if usage["skipped_manifests"]
                else ""
            ),
            "activity (all processes):",
            f"  hits {act['hits']}, misses {act['misses']}, pages read {act['pages_read']} "
            f"({human_size(act['bytes_read'])})",
            f"  pages written {act['writes']} ({human_size(act['bytes_written'])}), "
            f"deduplicated {act['pages_deduplicated']}, dropped writes {act['dropped_writes']}",
            f"  evictions {act['evictions']}, pruned {act['pruned']}, "
            f"corrupt {act['corrupt_entries']}, missing {act['missing_pages']}, "
            f"storage errors {act['storage_errors']}, lock timeouts {act['lock_timeouts']}",
            f"  admission: admitted {act['admitted']}, rejected {act['rejected']}, "
            f"fallback {act['admission_fallback']}, promoted {act['promotions']}",
            f"  trust: unauthenticated {act['unauthenticated']}, untrusted rows "
            f"{act['untrusted_rows']}, damaged manifests {act['damaged_manifests']}, "
            f"damaged costs {act['damaged_costs']}, internal errors {act['internal_errors']}",
        ]
        codec = report.get("codec")
        if codec is not None:
            cact = codec["activity"]
            stored = ", ".join(f"{n} {c}" for c, n in codec["manifests_by_codec"].items())
            lines.append(
                f"page codec: {codec['configured']} (l3.codec); prefixes by codec: "
                f"{stored or 'none'}; CacheGen pages written {cact['cachegen_pages']}, stored "
                f"native for want of a qualified codec {cact['codec_unqualified']}, unknown "
                f"codec (missed) {cact['unknown_codec']}"
            )
        rec = report["reconciliation"]
        if rec["ran"]:
            lines.append(
                f"reconciliation (last {_when(rec['at'])}, pid {rec['pid']}, {rec['verify']}): "
                f"{rec['pages_checked']} pages checked, "
                f"{rec['orphan_pages_removed']} orphan pages and "
                f"{rec['orphan_files_removed']} files removed, "
                f"{rec['manifests_removed']} prefixes repaired, "
                f"{rec['quarantined']} quarantined ({rec['quarantined_total']} in quarantine)"
            )
        else:
            lines.append("reconciliation: none recorded yet")
        if report["inventory"]:
            lines.append("inventory:")
            for entry in report["inventory"]:
                lines.append(
                    f"  {entry['model_identity']}  {entry['model_name']}: "
                    f"{entry['manifests']} prefixes, {entry['pages']} pages, "
                    f"{human_size(entry['bytes'])}, {entry['tokens']} tokens"
                )
        else:
            lines.append("inventory: empty")
        points = report.get("restore_points") or []
        if points:
            lines.append(
                f"restore points (recurrent and hybrid models): {usage['restore_points']}, "
                f"{human_size(usage['restore_point_bytes'])}; served {act['point_hits']}, "
                f"written {act['point_writes']}, evicted {act['points_evicted']}, "
                f"corrupt {act['corrupt_points']}, dropped {act['points_dropped']}"
            )
            for entry in points:
                shown = entry["sizes"][:8]  # all of them are in --json
                sizes = ", ".join(f"{n} tok {human_size(b)}" for n, b in shown)
                sizes += ", …" if len(entry["sizes"]) > len(shown) else ""
                lines.append(
                    f"  {entry['model_identity']}  {entry['model_name']}: {entry['points']} "
                    f"points, {human_size(entry['bytes'])}: {sizes}"
                )
    l1 = report.get("l1")
    if l1 is not None:
        lines.append(f"L1: {l1['summary']}")
    kv = report.get("kv_dtype")
    if kv is not None:
        lines.append(f"live K/V dtype: K={kv['type_k']} V={kv['type_v']} by {kv['rule']}")
        lines.extend(f"  {rule} skipped: {why}" for rule, why in kv.get("skipped", {}).items())
    native = report.get("native")
    if native is not None:
        from ..runtime.recipe import format_native_status

        lines.extend(format_native_status(native))
    lines.append(
        "configured:" + (f" (file {report['config_file']})" if report["config_file"] else "")
    )
    for name, item in report["configured"].items():
        lines.append(f"  {name} = {item['value']!r} ({item['source']})")
    return "\n".join(lines)


# ---------------------------------------------------------------------- prune / clear


def cmd_prune(args: argparse.Namespace) -> int:
    """``kv-cache prune [--target SIZE] [--model-identity ID] [--yes] [--remote]``."""
    _check_model_flag(args.model_identity)
    if args.cache_identity is not None and not args.remote:
        raise ConfigError("--cache-identity names remote keys: give it with --remote")
    if args.remote:
        if args.target is not None:
            raise ConfigError(
                "--target does not apply to --remote: the server's maxmemory and eviction "
                "policy bound its size; prune --remote removes what can no longer be served"
            )
        return remote.change(args, "prune")
    loaded = settings_from_args(args)
    target: int | None = None
    if args.target is not None:
        try:
            target = parse_size(args.target)
        except ValueError as exc:
            raise ConfigError(f"invalid --target {args.target!r}: {exc}") from None
    tier = open_l3_for_change(loaded, "prune")
    try:
        tier.check_model_identity(args.model_identity)
        scope = f"model {args.model_identity}" if args.model_identity else "all models"
        goal = (
            f"down to {human_size(target)}"
            if target is not None
            else ("every entry" if args.model_identity else "to the budget")
        )
        if not confirm(f"Prune the L3 cache at {tier.directory} ({scope}) {goal}?", args.yes):
            print("prune cancelled", file=sys.stderr)
            return 1
        result = tier.prune(target, args.model_identity)
    finally:
        tier.close()
    if not result.reached_target:
        print(
            f"target not reached: {result.kept_in_use} entries are in use and were kept",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(
            f"pruned {result.manifests_removed} prefixes and {result.pages_removed} pages: "
            f"{human_size(result.bytes_before)} -> {human_size(result.bytes_after)}"
            + (f" (target {human_size(target)})" if target is not None else "")
            + (f"; kept {result.kept_in_use} in use" if result.kept_in_use else "")
        )
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    """``kv-cache clear [--model-identity ID] [--yes] [--remote]``."""
    _check_model_flag(args.model_identity)
    if args.cache_identity is not None and not args.remote:
        raise ConfigError("--cache-identity names remote keys: give it with --remote")
    if args.remote:
        return remote.change(args, "clear")
    loaded = settings_from_args(args)
    tier = open_l3_for_change(loaded, "clear")
    try:
        tier.check_model_identity(args.model_identity)
        scope = f"model {args.model_identity}'s entries" if args.model_identity else "every entry"
        if not confirm(f"Remove {scope} from the L3 cache at {tier.directory}?", args.yes):
            print("clear cancelled", file=sys.stderr)
            return 1
        result = tier.clear(args.model_identity)
    finally:
        tier.close()
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(
            f"cleared {result.manifests_removed} prefixes and {result.pages_removed} pages: "
            f"{human_size(result.bytes_before)} -> {human_size(result.bytes_after)}"
            + (
                f"; {result.pages_kept_in_use} pages in use stay until released"
                if result.pages_kept_in_use
                else ""
            )
        )
    return 0
