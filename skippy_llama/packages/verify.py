"""Verify a model package: file integrity, then publisher metadata against the GGUF geometry.

Integrity and metadata validity are different failures. A changed, missing or extra file means
the package is not what was built (``tampered``: an error). Publisher metadata that disagrees with
the GGUF only means it is not used (``rejected``): the package still loads, with F16/F16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import PackageError
from .geometry import FIELDS, Geometry, GeometryComparison, cached_gguf_geometry, compare_geometry
from .hashing import sha256_file
from .manifest import MANIFEST_NAME, METADATA_DIR, Manifest, Verdict, read_manifest
from .publisher import CONFIG, PublisherMetadata, read_publisher_metadata

ReportVerdict = Literal["validated", "rejected", "absent", "tampered"]


@dataclass(frozen=True)
class FileProblem:
    """One integrity failure, naming the file relative to the package root."""

    path: str
    problem: str

    def describe(self) -> str:
        """``path: problem``."""
        return f"{self.path}: {self.problem}"


@dataclass(frozen=True)
class PublisherCheck:
    """Outcome of validating publisher metadata against a GGUF's geometry."""

    verdict: Verdict
    reasons: tuple[str, ...]
    comparison: GeometryComparison | None = None
    #: Set only when ``verdict == "validated"``.
    publisher: PublisherMetadata | None = None


def check_publisher(
    geometry: Geometry,
    metadata_dir: Path,
    *,
    repo_id: str,
    revision: str,
    names: tuple[str, ...],
) -> PublisherCheck:
    """Validate the publisher files ``names`` in ``metadata_dir`` against ``geometry``.

    Validated needs ``config.json`` to parse and to state at least one geometry field, and every
    field both sides state to agree.
    """
    if not names:
        return PublisherCheck("absent", ("the package carries no publisher metadata",))
    try:
        pub = read_publisher_metadata(metadata_dir, repo_id=repo_id, revision=revision, names=names)
    except PackageError as exc:
        return PublisherCheck("rejected", (str(exc),))
    cmp = compare_geometry(geometry, pub.config)
    if cmp.mismatches:
        return PublisherCheck(
            "rejected",
            tuple(f"geometry mismatch, {m.describe()}" for m in cmp.mismatches),
            cmp,
        )
    if not cmp.compared:
        return PublisherCheck(
            "rejected",
            (
                f"{CONFIG} states none of the geometry fields ({', '.join(FIELDS)}), "
                "so it cannot be matched to the GGUF",
            ),
            cmp,
        )
    agree = ", ".join(cmp.compared)
    return PublisherCheck(
        "validated",
        (f"{len(cmp.compared)} geometry fields agree with the GGUF: {agree}",),
        cmp,
        pub,
    )


def check_files(root: Path, manifest: Manifest, *, hashes: bool = True) -> list[FileProblem]:
    """Every listed file present with its size and (if ``hashes``) sha256; nothing unlisted."""
    problems: list[FileProblem] = []
    for entry in manifest.files:
        path = root / entry.path
        if not path.is_file():
            problems.append(FileProblem(entry.path, "missing"))
            continue
        size = path.stat().st_size
        if size != entry.size:
            problems.append(
                FileProblem(entry.path, f"size is {size} bytes, the manifest says {entry.size}")
            )
            continue
        if hashes:
            _, digest = sha256_file(path)
            if digest != entry.sha256:
                problems.append(
                    FileProblem(
                        entry.path,
                        f"sha256 is {digest}, the manifest says {entry.sha256}: "
                        "the file changed after the package was made",
                    )
                )
    listed = {e.path for e in manifest.files} | {MANIFEST_NAME}
    for path in sorted(root.rglob("*")):
        if path.is_dir():
            continue
        rel = path.relative_to(root).as_posix()
        if rel not in listed:
            problems.append(FileProblem(rel, f"not listed in {MANIFEST_NAME}"))
    return problems


def _geometry_drift(stored: Geometry, actual: Geometry) -> list[str]:
    out = []
    for name in ("architecture", *FIELDS, "split_count"):
        a, b = getattr(stored, name), getattr(actual, name)
        if a != b:
            out.append(f"{name}={a!r} but the GGUF says {b!r}")
    return out


@dataclass(frozen=True)
class VerificationReport:
    """Everything ``package verify`` found.

    ``verdict`` is ``tampered`` when any file problem was found; otherwise it is the publisher
    metadata verdict (``validated``, ``rejected`` or ``absent``). ``reasons`` explain it.
    """

    root: Path
    manifest: Manifest
    verdict: ReportVerdict
    reasons: tuple[str, ...]
    problems: tuple[FileProblem, ...] = ()
    hashes_checked: bool = True
    geometry: Geometry | None = None
    comparison: GeometryComparison | None = None
    publisher: PublisherMetadata | None = field(default=None, repr=False)

    @property
    def intact(self) -> bool:
        """True when every file matched the manifest."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view for ``package verify --json``."""
        return {
            "package": str(self.root),
            "repo_id": self.manifest.repo_id,
            "revision": self.manifest.revision,
            "gguf": list(self.manifest.gguf),
            "verdict": self.verdict,
            "intact": self.intact,
            "hashes_checked": self.hashes_checked,
            "reasons": list(self.reasons),
            "problems": [{"path": p.path, "problem": p.problem} for p in self.problems],
            "files": [e.model_dump() for e in self.manifest.files],
            "geometry": self.geometry.model_dump() if self.geometry else None,
            "comparison": (
                [
                    {
                        "field": c.field,
                        "status": c.status,
                        "gguf_key": c.gguf_key,
                        "gguf_value": c.gguf_value,
                        "config_key": c.config_key,
                        "config_value": c.config_value,
                    }
                    for c in self.comparison.checks
                ]
                if self.comparison
                else None
            ),
        }


def _tampered(
    root: Path,
    manifest: Manifest,
    problems: list[FileProblem],
    hashes: bool,
    geometry: Geometry | None = None,
) -> VerificationReport:
    reasons = tuple(p.describe() for p in problems)
    return VerificationReport(
        root, manifest, "tampered", reasons, tuple(problems), hashes, geometry
    )


def verify_package(path: str | Path, *, hashes: bool = True) -> VerificationReport:
    """Verify the package at ``path``.

    Raises :class:`PackageError` only when ``path`` is not a readable package at all (no or an
    invalid manifest); integrity failures come back as a ``tampered`` report so that callers can
    show every bad file at once. ``hashes=False`` checks presence and sizes only (fast).
    """
    root = Path(path).expanduser().resolve()
    manifest = read_manifest(root)
    problems = check_files(root, manifest, hashes=hashes)
    if problems:
        return _tampered(root, manifest, problems, hashes)
    geometry = cached_gguf_geometry(root / manifest.gguf[0])
    drift = _geometry_drift(manifest.geometry, geometry)
    if geometry.split_count != len(manifest.gguf):
        drift.append(
            f"gguf lists {len(manifest.gguf)} file(s) but the GGUF says split.count="
            f"{geometry.split_count}"
        )
    if drift:
        problems = [FileProblem(MANIFEST_NAME, f"geometry summary: {d}") for d in drift]
        return _tampered(root, manifest, problems, hashes, geometry)
    check = check_publisher(
        geometry,
        root / METADATA_DIR,
        repo_id=manifest.repo_id,
        revision=manifest.revision,
        names=manifest.metadata_names(),
    )
    return VerificationReport(
        root,
        manifest,
        check.verdict,
        check.reasons,
        (),
        hashes,
        geometry,
        check.comparison,
        check.publisher,
    )
