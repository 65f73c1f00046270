"""Settings flags shared by ``skippy-llama run`` and ``skippy-llama kv-cache``.

Every flag defaults to ``None`` (= not given) so that only flags the user actually typed become
``cli`` overrides; everything else falls through to env, the TOML file, and the defaults, and
``kv-cache status`` can report each field's real source.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..config import LoadedSettings, load_settings
from ..packages.kvdtype import KVDtypeResolution, resolve_kv_dtype
from ..packages.loader import LoadedPackage, load_package


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the cache-settings flags (``--config``, ``--l3-mode`` …) to ``parser``.

    Values are passed through as strings: sizes and directories are validated by
    :mod:`skippy_llama.config`, so a bad flag gets the same field-naming error as a bad env var.
    """
    group = parser.add_argument_group("cache settings (override SKIPPY_* env and the config file)")
    group.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML settings file (default: $SKIPPY_CONFIG)",
    )
    group.add_argument(
        "--page-tokens", metavar="N", default=None, help="tokens per KV page (default 128)"
    )
    group.add_argument(
        "--namespace", metavar="NAME", default=None, help="namespace mixed into the cache identity"
    )
    group.add_argument(
        "--l2-budget",
        metavar="SIZE",
        default=None,
        help="RAM mirror budget, e.g. 2GiB (default off)",
    )
    group.add_argument(
        "--l3-mode",
        choices=("off", "auto", "fixed"),
        default=None,
        help="disk tier mode (default off)",
    )
    group.add_argument(
        "--l3-budget",
        metavar="SIZE",
        default=None,
        help="disk budget for --l3-mode fixed, e.g. 32GiB",
    )
    group.add_argument(
        "--l3-dir", metavar="DIR", default=None, help="absolute disk-cache directory"
    )
    group.add_argument(
        "--l3-minimum-free",
        metavar="SIZE",
        default=None,
        help="free space kept on the filesystem; below it L3 turns read-only (default 16GiB)",
    )
    group.add_argument(
        "--l3-compression",
        choices=("auto", "zstd", "none"),
        default=None,
        help="how L3 stores pages: zstd (lossless, ~0.86 of the bytes), none, or auto (the "
        "default: none)",
    )
    group.add_argument(
        "--l3-codec",
        choices=("native", "cachegen"),
        default=None,
        help="page codec: native (exact, the default) or cachegen (experimental, lossy: "
        "restores are no longer bit-identical to cold; used only where the roster qualifies "
        "the model and K/V layout)",
    )
    group.add_argument(
        "--remote-url",
        metavar="URL",
        default=None,
        help="shared remote tier: redis://host:6379/0 or unix:///path/to.sock (Redis or Valkey; "
        "default off); needs --remote-secret-file",
    )
    group.add_argument(
        "--remote-secret-file",
        metavar="FILE",
        default=None,
        help="absolute path of the secret every instance sharing the remote server holds",
    )
    group.add_argument(
        "--remote-timeout-ms",
        metavar="MS",
        default=None,
        help="remote connect and command timeout (default 250)",
    )
    group.add_argument(
        "--remote-namespace",
        metavar="NAME",
        default=None,
        help="key prefix on the remote server (default skippy)",
    )
    group.add_argument(
        "--remote-ttl",
        metavar="SECONDS",
        default=None,
        help="expiry of remote keys, refreshed on every push (default none)",
    )
    group.add_argument(
        "--remote-codec",
        choices=("native", "cachegen"),
        default=None,
        help="codec of the pages sent to and read from the remote server: native (exact, the "
        "default) or cachegen (experimental, lossy: a fraction of the bytes on the network; used "
        "only where the roster qualifies the model and K/V layout)",
    )
    group.add_argument(
        "--repair-generated",
        choices=("auto", "always", "never"),
        default=None,
        help="re-decode replies as a batch for the next turn: auto (chat completions, the "
        "default), always, never",
    )


# (argparse dest, nested settings path)
_FLAG_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("page_tokens", ("page_tokens",)),
    ("namespace", ("namespace",)),
    ("l2_budget", ("l2", "budget")),
    ("l3_mode", ("l3", "mode")),
    ("l3_budget", ("l3", "budget")),
    ("l3_dir", ("l3", "directory")),
    ("l3_minimum_free", ("l3", "minimum_free")),
    ("l3_compression", ("l3", "compression")),
    ("l3_codec", ("l3", "codec")),
    ("repair_generated", ("l1", "repair_generated")),
    ("remote_url", ("remote", "url")),
    ("remote_secret_file", ("remote", "secret_file")),
    ("remote_timeout_ms", ("remote", "timeout_ms")),
    ("remote_namespace", ("remote", "namespace")),
    ("remote_ttl", ("remote", "ttl")),
    ("remote_codec", ("remote", "codec")),
)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Nested overrides (``{"l3": {"mode": "auto"}}``) for the flags that were actually given."""
    overrides: dict[str, Any] = {}
    for dest, path in _FLAG_FIELDS:
        value = getattr(args, dest, None)
        if value is None:
            continue
        node = overrides
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return overrides


def settings_from_args(args: argparse.Namespace) -> LoadedSettings:
    """Load settings with the given flags as ``cli`` overrides (CLI > env > file > default).

    Raises:
        ConfigError: a value is invalid (the message names the field) or ``--config`` is missing.
    """
    return load_settings(overrides_from_args(args), config_file=getattr(args, "config", None))


def add_kv_dtype_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--package``, ``--type-k`` and ``--type-v`` (live K/V dtype choice, DESIGN §6)."""
    group = parser.add_argument_group("model package and live K/V dtype")
    group.add_argument(
        "--package",
        metavar="DIR",
        default=None,
        help="model package folder (skippy-llama package create); its publisher metadata "
        "decides the K/V dtype unless --type-k/--type-v are given",
    )
    group.add_argument(
        "--type-k", metavar="TYPE", default=None, help="K cache type, e.g. f16, q8_0"
    )
    group.add_argument(
        "--type-v", metavar="TYPE", default=None, help="V cache type, e.g. f16, q8_0"
    )


def kv_dtype_from_args(args: argparse.Namespace) -> tuple[KVDtypeResolution, LoadedPackage | None]:
    """Resolve the live K/V dtype from ``--package``/``--type-k``/``--type-v``.

    Raises:
        PackageError: the package is missing or fails verification.
        ConfigError: a type name is not a llama.cpp cache type.
    """
    user_k, user_v = getattr(args, "type_k", None), getattr(args, "type_v", None)
    if getattr(args, "package", None):
        package = load_package(args.package)
        return package.resolve(user_k, user_v), package
    return (
        resolve_kv_dtype(
            user_k=user_k,
            user_v=user_v,
            publisher=None,
            publisher_unavailable="no --package given",
        ),
        None,
    )


def model_kwargs(resolution: KVDtypeResolution, n_ctx: int) -> dict[str, Any]:
    """``Llama`` arguments for the live K/V dtype ``resolution``, as ``run`` loads a model.

    ``kv-cache status`` loads a model with the same ones, so the verdict it prints is the one
    ``run`` gets (the roster row depends on the K/V types and flash attention).
    """
    kwargs: dict[str, Any] = {"n_ctx": n_ctx, "verbose": False, "seed": 1}
    kwargs.update(resolution.llama_kwargs())
    if resolution.needs_flash_attn:
        kwargs["flash_attn"] = True
    return kwargs
