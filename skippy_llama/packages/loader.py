"""Open a model package for the runtime: verify it, keep usable publisher metadata, resolve KV."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PackageError
from ..identity import file_stamp, record_file_digest
from .kvdtype import KVDtypeResolution, resolve_kv_dtype
from .manifest import Manifest, read_manifest
from .publisher import PublisherMetadata
from .verify import VerificationReport, verify_package


@dataclass(frozen=True)
class LoadedPackage:
    """A verified package, ready for ``SkippyLlama.from_package``.

    ``publisher`` is the package-validated publisher metadata, or ``None`` when the package has
    none or it was rejected; ``publisher_reason`` then says why.
    """

    root: Path
    manifest: Manifest
    verification: VerificationReport
    publisher: PublisherMetadata | None
    publisher_reason: str | None

    @property
    def gguf_path(self) -> Path:
        """The GGUF file to load (the first shard of a split model)."""
        return self.root / self.manifest.gguf[0]

    @property
    def gguf_paths(self) -> tuple[Path, ...]:
        """Every GGUF file of the package, the one to load first."""
        return tuple(self.root / g for g in self.manifest.gguf)

    def resolve(
        self, user_k: str | int | None = None, user_v: str | int | None = None
    ) -> KVDtypeResolution:
        """Resolve the live K/V types for this package; user choices win (DESIGN §6)."""
        return resolve_kv_dtype(
            user_k=user_k,
            user_v=user_v,
            publisher=self.publisher,
            publisher_unavailable=self.publisher_reason,
        )

    def summary(self) -> dict[str, Any]:
        """A JSON-ready description for status output."""
        return {
            "package": str(self.root),
            "repo_id": self.manifest.repo_id,
            "revision": self.manifest.revision,
            "gguf": str(self.gguf_path),
            "publisher_metadata": self.verification.verdict,
            "reasons": list(self.verification.reasons),
        }


def _gguf_stamps(path: str | Path) -> dict[str, str]:
    """Each GGUF's file stamp before verification (empty when the package cannot be read)."""
    try:
        root = Path(path).resolve()
        manifest = read_manifest(root)
        return {g: file_stamp(root / g) for g in manifest.gguf}
    except (PackageError, OSError):
        return {}  # verification reports the problem


def _remember_verified_digests(root: Path, manifest: Manifest, stamps: dict[str, str]) -> None:
    """Give the cache identity each GGUF's verified sha256, so it is not hashed a second time.

    Recorded only for a file whose stamp did not change while it was verified.
    """
    sha = {f.path: f.sha256 for f in manifest.files}
    for name, stamp in stamps.items():
        if name in sha:
            record_file_digest(root / name, "sha256:" + sha[name], stamp)


def load_package(path: str | Path, *, verify_hashes: bool = True) -> LoadedPackage:
    """Verify the package at ``path`` and return it with its usable publisher metadata.

    Raises :class:`PackageError` when ``path`` is not a package or any file fails verification
    (missing, changed, or unlisted), naming the files. Rejected or absent publisher metadata is
    not an error: the package loads and resolves to F16/F16 unless the user says otherwise.
    ``verify_hashes=False`` skips re-hashing (sizes are still checked) for fast repeated loads of
    a package already verified with ``skippy-llama package verify``.
    """
    stamps = _gguf_stamps(path)
    report = verify_package(path, hashes=verify_hashes)
    if not report.intact:
        raise PackageError(
            f"model package {report.root} failed verification: "
            + "; ".join(report.reasons)
            + ". Restore the original files or re-create the package with "
            "`skippy-llama package create`"
        )
    if verify_hashes:
        _remember_verified_digests(report.root, report.manifest, stamps)
    reason: str | None = None
    if report.publisher is None:
        prefix = "publisher metadata not used: " if report.verdict == "rejected" else ""
        reason = prefix + "; ".join(report.reasons)
    return LoadedPackage(
        root=report.root,
        manifest=report.manifest,
        verification=report,
        publisher=report.publisher,
        publisher_reason=reason,
    )
