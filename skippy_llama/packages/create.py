"""Build a model package from GGUF file(s) plus publisher files from a folder or the hub cache."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import ConfigError, PackageError
from .geometry import cached_gguf_geometry
from .hashing import copy_hashing, sha256_file
from .manifest import (
    METADATA_DIR,
    FileEntry,
    Manifest,
    Validation,
    check_repo_id,
    check_revision,
    write_manifest,
)
from .publisher import CONFIG, PUBLISHER_FILES, find_publisher_files, parse_json_object
from .verify import check_publisher

LinkMode = Literal["copy", "hardlink"]


def _hub_cache_root(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return cache_dir
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _hub_cache_hint(cache: Path, repo_id: str) -> str:
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    if not repo_dir.is_dir():
        return f"{repo_id} is not in the hub cache at {cache}"
    snaps = sorted(p.name for p in (repo_dir / "snapshots").glob("*") if p.is_dir())
    hint = f"the hub cache at {cache} has snapshots {snaps or 'none'}"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        hint += f"; refs/main is {ref.read_text().strip()}"
    return hint


def fetch_from_hub(
    repo_id: str, revision: str, *, cache_dir: Path | None = None, allow_download: bool = False
) -> dict[str, Path]:
    """Locate the publisher files of ``repo_id`` at commit ``revision`` through huggingface_hub.

    Offline by default (``local_files_only``); ``allow_download`` lets huggingface_hub fetch
    missing files pinned to the same commit. Returns ``{name: path}`` of the files found;
    raises :class:`PackageError` if ``config.json`` cannot be had.
    """
    from huggingface_hub import hf_hub_download

    try:
        from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError
    except ImportError:  # huggingface_hub < 0.24 kept them in utils
        from huggingface_hub.utils import (  # type: ignore[attr-defined,no-redef]
            EntryNotFoundError,
            HfHubHTTPError,
        )

    found: dict[str, Path] = {}
    for name in PUBLISHER_FILES:
        try:
            local = hf_hub_download(
                repo_id,
                name,
                revision=revision,
                cache_dir=str(cache_dir) if cache_dir is not None else None,
                local_files_only=not allow_download,
            )
        except (EntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
            if name != CONFIG:
                continue  # the optional files are simply absent from many repositories
            cache = _hub_cache_root(cache_dir)
            how = (
                "download failed"
                if allow_download
                else "it is not in the local cache and --allow-download was not given"
            )
            raise PackageError(
                f"cannot get {CONFIG} of {repo_id} at revision {revision}: {how} "
                f"({type(exc).__name__}); {_hub_cache_hint(cache, repo_id)}. Download it "
                f"pinned to that commit (`hf download {repo_id} {' '.join(PUBLISHER_FILES)} "
                f"--revision {revision}`), pass --allow-download, or use --metadata-dir"
            ) from exc
        found[name] = Path(local)
    return found


@dataclass(frozen=True)
class CreateResult:
    """The package written by :func:`create_package`."""

    root: Path
    manifest: Manifest


def _check_inputs(
    gguf: Sequence[Path], repo_id: str, revision: str, out_dir: Path
) -> tuple[str, str]:
    try:
        repo_id = check_repo_id(repo_id)
    except ValueError as exc:
        raise ConfigError(f"--repo-id: {exc}") from exc
    try:
        revision = check_revision(revision)
    except ValueError as exc:
        raise ConfigError(f"--revision: {exc}") from exc
    if not gguf:
        raise ConfigError("--gguf: give the GGUF file to package")
    names = [g.name for g in gguf]
    if len(set(names)) != len(names):
        raise ConfigError(f"--gguf: file names must be distinct, got {names}")
    for g in gguf:
        if not g.is_file():
            raise ConfigError(f"--gguf: {g} does not exist or is not a file")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(
            f"OUT_DIR {out_dir} already exists and is not an empty folder; "
            "choose a new folder (packages are never overwritten in place)"
        )
    return repo_id, revision


def create_package(
    out_dir: str | Path,
    *,
    gguf: Sequence[str | Path],
    repo_id: str,
    revision: str,
    metadata_dir: str | Path | None = None,
    from_hf_cache: bool = False,
    hf_cache_dir: str | Path | None = None,
    allow_download: bool = False,
    link: LinkMode = "copy",
) -> CreateResult:
    """Write a package to ``out_dir`` (which must not exist or be empty).

    Publisher files come from ``metadata_dir``, or from the huggingface_hub cache when
    ``from_hf_cache`` (offline unless ``allow_download``), or from nowhere (a package without
    publisher metadata, which loads with F16/F16). The package is built in a sibling temporary
    folder and renamed into place, so a failure leaves nothing half-written.

    Raises :class:`ConfigError` for bad arguments and :class:`PackageError` when the inputs cannot
    make a package (unreadable GGUF, shards missing, no ``config.json``).
    """
    out = Path(out_dir).expanduser().absolute()
    ggufs = [Path(g).expanduser() for g in gguf]
    repo_id, revision = _check_inputs(ggufs, repo_id, revision, out)
    if metadata_dir is not None and from_hf_cache:
        raise ConfigError("give either --metadata-dir or --from-hf-cache, not both")

    sources: dict[str, Path] = {}
    if metadata_dir is not None:
        mdir = Path(metadata_dir).expanduser()
        if not mdir.is_dir():
            raise ConfigError(f"--metadata-dir: {mdir} is not a folder")
        sources = find_publisher_files(mdir)
        if CONFIG not in sources:
            raise ConfigError(
                f"--metadata-dir: {mdir} has no {CONFIG}; copy the publisher's files "
                f"({', '.join(PUBLISHER_FILES)}) for commit {revision} into it"
            )
    elif from_hf_cache:
        cache = Path(hf_cache_dir).expanduser() if hf_cache_dir is not None else None
        sources = fetch_from_hub(repo_id, revision, cache_dir=cache, allow_download=allow_download)
    for name, src in sources.items():
        parse_json_object(src, label=f"{name} ({src})")  # refuse to package broken JSON

    # Fail before copying gigabytes if the shards given do not match what the GGUF says.
    first = cached_gguf_geometry(ggufs[0])
    if first.split_count != len(ggufs):
        raise ConfigError(
            f"--gguf: {ggufs[0]} says split.count={first.split_count} but {len(ggufs)} file(s) "
            "were given; pass every shard with repeated --gguf, the first shard first"
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        entries: list[FileEntry] = []
        for g in ggufs:
            dst = staging / g.name
            if link == "hardlink":
                try:
                    os.link(g, dst)
                except OSError as exc:
                    raise ConfigError(
                        f"--hardlink: cannot hard-link {g} into {out.parent} ({exc.strerror}); "
                        "they must be on the same filesystem, or drop --hardlink to copy"
                    ) from exc
                size, digest = sha256_file(dst)
            else:
                size, digest = copy_hashing(g, dst)
            entries.append(FileEntry(path=g.name, kind="gguf", size=size, sha256=digest))
        # `first` was read from the source before copying; reading the copy again would cost
        # another GGUFReader pass (seconds), and `package verify` re-reads the packaged bytes.
        geometry = first

        if sources:
            (staging / METADATA_DIR).mkdir()
        for name, src in sources.items():
            size, digest = copy_hashing(src, staging / METADATA_DIR / name)
            entries.append(
                FileEntry(path=f"{METADATA_DIR}/{name}", kind="metadata", size=size, sha256=digest)
            )
        check = check_publisher(
            geometry,
            staging / METADATA_DIR,
            repo_id=repo_id,
            revision=revision,
            names=tuple(sources),
        )
        from .. import __version__ as version

        manifest = Manifest(
            repo_id=repo_id,
            revision=revision,
            created_by=f"skippy-llama {version}",
            gguf=[g.name for g in ggufs],
            files=entries,
            geometry=geometry,
            validation=Validation(
                publisher_metadata=check.verdict,
                reasons=list(check.reasons),
                compared_fields=list(check.comparison.compared) if check.comparison else [],
            ),
        )
        write_manifest(staging, manifest)
        if out.exists():
            out.rmdir()  # checked empty above
        os.replace(staging, out)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)
        raise
    return CreateResult(out, manifest)
