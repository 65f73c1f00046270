"""The native recipe, the split-certified roster and the verdict that joins them (pure: no llama.cpp).

A *recipe* names the native library exactly: the llama-cpp-python version, the llama.cpp commit it
vendors, the skippy ABI version and the SHA-256 of the patch queue in ``patches/``. The *roster*
(``roster/split-certified.json``, written only by ``scripts/certify.py``) holds the recipe it was
certified for and one row per (architecture, backend, K/V types, flash attention) with the lanes
that passed on a real model. The *verdict* says which paths the runtime may take for the model it
loaded: ``certified`` (the row's lanes), ``stock`` (no patched symbols: today's state calls),
``uncertified`` (patched, but not certified for this recipe and row: stock paths) or
``uncertified_override`` (the same, with ``native.allow_uncertified`` set: patched paths anyway).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from .errors import RosterError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# from the sdist's CHANGELOG.md ("update llama.cpp to ggml-org/llama.cpp@0c1e57098"): the sdist
# ships the sources without git metadata, so the library itself cannot report it
LLAMA_CPP_COMMIT = "0c1e57098"
# the version of the skippy_* C calls that runtime/native_ext.py speaks (2: per-layer cell
# copies, patch 0006)
SKIPPY_ABI_VERSION = 2
ROSTER_FORMAT = 1
_QUEUE_TAG = b"skippy-llama patch queue v1"

REPO_ROOT = Path(__file__).resolve().parent.parent
PATCHES_DIR = REPO_ROOT / "patches"
_CHECKOUT_ROSTER = REPO_ROOT / "roster" / "split-certified.json"
# an installed wheel has no checkout around it: its build copies the roster here (setup.py)
_PACKAGED_ROSTER = Path(__file__).resolve().parent / "_data" / "split-certified.json"
ROSTER_PATH = (
    _PACKAGED_ROSTER
    if not _CHECKOUT_ROSTER.is_file() and _PACKAGED_ROSTER.is_file()
    else _CHECKOUT_ROSTER
)

LANES = (
    "page_restore_exact",
    "l1_stream_copy_exact",
    "range_export_slice",
    "append_import_exact",
    "restart_exact",
    "lone_decode_exact",
    "layer_copy_exact",
)
"""Certification lanes; ``range_export_slice`` gates range capture, ``append_import_exact`` append;
``lone_decode_exact`` records what patch 0004 gives (the runtime probes it at load);
``layer_copy_exact`` gates L2's host arena and its per-layer cell copies (patch 0006)."""

VerdictKind = Literal["certified", "stock", "uncertified", "uncertified_override"]


def queue_patches(patches_dir: Path = PATCHES_DIR) -> list[Path]:
    """The patch files named by ``patches_dir/series``, in series order (checked to exist)."""
    series = patches_dir / "series"
    if not series.is_file():
        raise RosterError(f"patch queue {str(patches_dir)!r} has no series file")
    names = [
        line.strip()
        for line in series.read_text("utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    paths: list[Path] = []
    for name in names:
        path = patches_dir / name
        if "/" in name or not path.is_file():
            raise RosterError(f"series names {name!r}, which is not a file in {patches_dir}")
        paths.append(path)
    if not paths:
        raise RosterError(f"patch queue {str(patches_dir)!r} is empty")
    return paths


def queue_digest(patches_dir: Path = PATCHES_DIR) -> str:
    """SHA-256 over a version tag, the patch count and each patch's name and bytes, in series order.

    Lengths prefix every field, so renaming, reordering, adding or editing a patch changes it.
    """
    paths = queue_patches(patches_dir)
    h = hashlib.sha256(_QUEUE_TAG)
    h.update(len(paths).to_bytes(4, "little"))
    for path in paths:
        name = path.name.encode("utf-8")
        data = path.read_bytes()
        h.update(len(name).to_bytes(4, "little") + name)
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the native library's behaviour, as the roster records it."""

    llama_cpp_python: str
    llama_cpp_commit: str
    skippy_abi: int
    queue_sha256: str

    def describe(self) -> str:
        return (
            f"llama-cpp-python {self.llama_cpp_python} (llama.cpp {self.llama_cpp_commit}), "
            f"skippy ABI {self.skippy_abi}, patch queue {self.queue_sha256[:12]}"
        )


def expected_recipe(patches_dir: Path = PATCHES_DIR) -> Recipe:
    """The recipe a build of this checkout's patch queue has."""
    return Recipe(
        LLAMA_CPP_PYTHON_VERSION, LLAMA_CPP_COMMIT, SKIPPY_ABI_VERSION, queue_digest(patches_dir)
    )


@dataclass(frozen=True)
class RowKey:
    """What certification is specific to: the model architecture and the live KV layout."""

    architecture: str
    backend: str
    type_k: str
    type_v: str
    flash_attn: bool

    def describe(self) -> str:
        fa = "on" if self.flash_attn else "off"
        return f"{self.architecture} on {self.backend}, K {self.type_k} / V {self.type_v}, flash attention {fa}"


@dataclass(frozen=True)
class RosterRow:
    """One certified (architecture, backend, K/V, flash attention) combination and its lanes."""

    key: RowKey
    lanes: tuple[str, ...]
    model: str
    model_digest: str
    #: (lane, why) for each lane that ran and did not pass, so the roster says why a path is off
    failed: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class CacheGenRow:
    """The ``cachegen`` lane of one (model digest, K/V layout, backend): the cheapest CacheGen
    parameters that passed the quality gate (``scripts/qualify_cachegen.py``), or None with the
    measured reason. ``params`` is the codec's own JSON form (``CacheGenParams.identity()``);
    ``measured`` holds the agreement, max |delta logit|, perplexity rise and size ratio, and
    the measure's noise floor on the same positions (``floor_argmax_agree``, ``floor_mean_kl``);
    ``tried`` the cheaper sets that failed, with their measurements."""

    model: str
    model_digest: str
    backend: str
    layout_digest: str
    type_k: str
    type_v: str
    flash_attn: bool
    params: Mapping[str, Any] | None
    measured: Mapping[str, float]
    reason: str = ""
    tried: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.params is not None

    def matches(self, model_digest: str, backend: str, layout_digest: str) -> bool:
        return (self.model_digest, self.backend, self.layout_digest) == (
            model_digest,
            backend,
            layout_digest,
        )

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "model": self.model,
            "model_digest": self.model_digest,
            "backend": self.backend,
            "layout_digest": self.layout_digest,
            "type_k": self.type_k,
            "type_v": self.type_v,
            "flash_attn": self.flash_attn,
            "params": dict(self.params) if self.params is not None else None,
            "measured": dict(self.measured),
        }
        if self.reason:
            doc["reason"] = self.reason
        if self.tried:
            doc["tried"] = list(self.tried)
        return doc


@dataclass(frozen=True)
class RestorePointRow:
    """The ``restore_points`` lane of one architecture family on one backend (issue 46): whether
    a restore point (whole state at p, restored, the rest of the prompt decoded) gave a cold
    prefill's logits bit for bit (``exact``), at which positions (``positions``: "any prompt
    end", or the alignment the runtime keeps), the bytes of the part that is not per token at
    the probed position (``snapshot_bytes``: recurrent state or sliding-window cells), and
    ``reason`` where it is not exact or needs care."""

    architecture: str
    memory: str
    backend: str
    flash_attn: bool
    model: str
    model_digest: str
    exact: bool
    positions: str
    snapshot_bytes: int
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {k: v for k, v in asdict(self).items() if k != "reason"}
        if self.reason:
            doc["reason"] = self.reason
        return doc

    @property
    def alignment(self) -> int | None:
        """The positions the row certifies as a step in tokens: 1 for "any prompt end", N for
        "multiples of N tokens"; None for anything else (read as not certified)."""
        if self.positions == "any prompt end":
            return 1
        words = self.positions.split()
        if (
            len(words) == 4
            and words[0] == "multiples"
            and words[1] == "of"
            and words[3] == "tokens"
        ):
            try:
                step = int(words[2])
            except ValueError:
                return None
            return step if step > 0 else None
        return None


@dataclass(frozen=True)
class PointVerdict:
    """Whether the roster certifies restore points for one architecture on one backend with
    flash attention on or off: ``alignment`` (tokens: points only on multiples of it; 1: any
    prompt end) when it does, None when not, and ``reason`` either way."""

    alignment: int | None
    reason: str


def decide_points(
    library: Recipe | None,
    roster: Roster | None,
    architecture: str,
    backend: str,
    flash_attn: bool,
) -> PointVerdict:
    """The roster's ``restore_points`` verdict for a model of ``architecture`` on ``backend``
    (the runtime asks it where batch splits change results: GPU builds, BLAS, flash attention).

    A row counts only under the recipe the loaded library was built from, and only when exact:
    ``scripts/certify.py --restore-points`` run on that backend writes it."""
    where = f"{architecture} on {backend} (flash attention {'on' if flash_attn else 'off'})"
    if library is None:
        return PointVerdict(None, f"{where}: the stock library has no certified restore points")
    if roster is None:
        return PointVerdict(None, f"{where}: there is no roster")
    if roster.recipe != library:
        return PointVerdict(None, f"{where}: the roster certifies another recipe")
    row = roster.point_row(architecture, backend, flash_attn)
    if row is None:
        return PointVerdict(
            None, f"{where}: no restore_points row (run scripts/certify.py --restore-points there)"
        )
    if not row.exact:
        return PointVerdict(None, f"{where}: not exact ({row.reason})")
    step = row.alignment
    if step is None:
        return PointVerdict(None, f"{where}: positions {row.positions!r} are not understood")
    return PointVerdict(step, f"{where}: certified at {row.positions}")


@dataclass(frozen=True)
class Roster:
    """The recipe certification ran on, the rows it certified, the CacheGen lane's rows and the
    restore-point lane's rows (one per architecture family and backend)."""

    recipe: Recipe
    rows: tuple[RosterRow, ...]
    cachegen: tuple[CacheGenRow, ...] = ()
    restore_points: tuple[RestorePointRow, ...] = ()

    def row(self, key: RowKey) -> RosterRow | None:
        return next((row for row in self.rows if row.key == key), None)

    def point_row(
        self, architecture: str, backend: str, flash_attn: bool
    ) -> RestorePointRow | None:
        """The ``restore_points`` row of an architecture family on a backend (None: none)."""
        return next(
            (
                r
                for r in self.restore_points
                if (r.architecture, r.backend, r.flash_attn) == (architecture, backend, flash_attn)
            ),
            None,
        )

    def cachegen_row(
        self, model_digest: str, backend: str, layout_digest: str
    ) -> CacheGenRow | None:
        """The ``cachegen`` row of a model file, backend and K/V layout (None: never qualified)."""
        return next(
            (r for r in self.cachegen if r.matches(model_digest, backend, layout_digest)), None
        )

    def to_json(self) -> str:
        doc = {
            "format": ROSTER_FORMAT,
            "generated_by": "scripts/certify.py (never edit by hand)",
            "recipe": asdict(self.recipe),
            "rows": [
                {
                    **asdict(row.key),
                    "lanes": list(row.lanes),
                    "model": row.model,
                    "model_digest": row.model_digest,
                    **({"failed": dict(row.failed)} if row.failed else {}),
                }
                for row in sorted(
                    self.rows, key=lambda r: json.dumps(asdict(r.key), sort_keys=True)
                )
            ],
        }
        if self.cachegen:
            doc["cachegen"] = [
                row.to_json()
                for row in sorted(
                    self.cachegen,
                    key=lambda r: (r.model, r.backend, r.type_k, r.type_v, r.flash_attn),
                )
            ]
        if self.restore_points:
            doc["restore_points"] = [
                row.to_json()
                for row in sorted(
                    self.restore_points, key=lambda r: (r.architecture, r.backend, r.flash_attn)
                )
            ]
        return json.dumps(doc, indent=2, sort_keys=False) + "\n"


def parse_roster(text: str, where: str = "roster") -> Roster:
    """Parse and check a roster document; anything unexpected is a :class:`RosterError`."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise RosterError(f"{where} is not JSON: {exc}") from exc
    if not isinstance(doc, Mapping) or doc.get("format") != ROSTER_FORMAT:
        raise RosterError(f"{where} is not a roster of format {ROSTER_FORMAT}")
    recipe_doc = _mapping(doc.get("recipe"), f"{where}: recipe")
    recipe = Recipe(
        llama_cpp_python=_str(recipe_doc, "llama_cpp_python", where),
        llama_cpp_commit=_str(recipe_doc, "llama_cpp_commit", where),
        skippy_abi=_int(recipe_doc, "skippy_abi", where),
        queue_sha256=_str(recipe_doc, "queue_sha256", where),
    )
    rows_doc = doc.get("rows")
    if not isinstance(rows_doc, Sequence) or isinstance(rows_doc, str):
        raise RosterError(f"{where}: rows must be a list")
    rows: list[RosterRow] = []
    for i, item in enumerate(rows_doc):
        row = _mapping(item, f"{where}: rows[{i}]")
        lanes = row.get("lanes")
        if not isinstance(lanes, list) or not all(lane in LANES for lane in lanes):
            raise RosterError(f"{where}: rows[{i}].lanes must list lanes among {', '.join(LANES)}")
        flash = row.get("flash_attn")
        if not isinstance(flash, bool):
            raise RosterError(f"{where}: rows[{i}].flash_attn must be true or false")
        key = RowKey(
            architecture=_str(row, "architecture", where),
            backend=_str(row, "backend", where),
            type_k=_str(row, "type_k", where),
            type_v=_str(row, "type_v", where),
            flash_attn=flash,
        )
        failed_doc = _mapping(row.get("failed", {}), f"{where}: rows[{i}].failed")
        if not all(lane in LANES and isinstance(why, str) for lane, why in failed_doc.items()):
            raise RosterError(f"{where}: rows[{i}].failed must map lanes to reasons")
        rows.append(
            RosterRow(
                key,
                tuple(lanes),
                _str(row, "model", where),
                _str(row, "model_digest", where),
                tuple((lane, str(why)) for lane, why in failed_doc.items()),
            )
        )
    cachegen_doc = doc.get("cachegen", [])
    if not isinstance(cachegen_doc, Sequence) or isinstance(cachegen_doc, str):
        raise RosterError(f"{where}: cachegen must be a list")
    cachegen = tuple(
        _cachegen_row(_mapping(item, f"{where}: cachegen[{i}]"), f"{where}: cachegen[{i}]")
        for i, item in enumerate(cachegen_doc)
    )
    points_doc = doc.get("restore_points", [])
    if not isinstance(points_doc, Sequence) or isinstance(points_doc, str):
        raise RosterError(f"{where}: restore_points must be a list")
    points = tuple(
        _point_row(_mapping(item, f"{where}: restore_points[{i}]"), f"{where}: restore_points[{i}]")
        for i, item in enumerate(points_doc)
    )
    return Roster(recipe, tuple(rows), cachegen, points)


def _point_row(row: Mapping[str, Any], where: str) -> RestorePointRow:
    flash, exact = row.get("flash_attn"), row.get("exact")
    if not isinstance(flash, bool) or not isinstance(exact, bool):
        raise RosterError(f"{where}: flash_attn and exact must be true or false")
    reason = row.get("reason", "")
    if not isinstance(reason, str) or (not exact and not reason):
        raise RosterError(f"{where}: a row that is not exact needs its reason")
    return RestorePointRow(
        architecture=_str(row, "architecture", where),
        memory=_str(row, "memory", where),
        backend=_str(row, "backend", where),
        flash_attn=flash,
        model=_str(row, "model", where),
        model_digest=_str(row, "model_digest", where),
        exact=exact,
        positions=_str(row, "positions", where),
        snapshot_bytes=_int(row, "snapshot_bytes", where),
        reason=reason,
    )


def _cachegen_row(row: Mapping[str, Any], where: str) -> CacheGenRow:
    flash = row.get("flash_attn")
    if not isinstance(flash, bool):
        raise RosterError(f"{where}.flash_attn must be true or false")
    params = row.get("params")
    if params is not None and not isinstance(params, Mapping):
        raise RosterError(f"{where}.params must be an object or null")
    measured = _mapping(row.get("measured", {}), f"{where}.measured")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in measured.values()):
        raise RosterError(f"{where}.measured must hold numbers")
    tried = row.get("tried", [])
    if not isinstance(tried, list) or not all(isinstance(t, str) for t in tried):
        raise RosterError(f"{where}.tried must list strings")
    reason = row.get("reason", "")
    if not isinstance(reason, str) or (params is None and not reason):
        raise RosterError(f"{where}: a row without params needs its reason")
    return CacheGenRow(
        model=_str(row, "model", where),
        model_digest=_str(row, "model_digest", where),
        backend=_str(row, "backend", where),
        layout_digest=_str(row, "layout_digest", where),
        type_k=_str(row, "type_k", where),
        type_v=_str(row, "type_v", where),
        flash_attn=flash,
        params=dict(params) if params is not None else None,
        measured=dict(measured),
        reason=reason,
        tried=tuple(tried),
    )


def load_roster(path: Path = ROSTER_PATH) -> Roster | None:
    """The roster at ``path``; None when there is none. A malformed one raises :class:`RosterError`."""
    try:
        text = path.read_text("utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RosterError(f"cannot read roster {str(path)!r}: {exc}") from exc
    return parse_roster(text, str(path))


@dataclass(frozen=True)
class Verdict:
    """What the runtime may do with the native library for one loaded model."""

    kind: VerdictKind
    reason: str
    lanes: tuple[str, ...] = ()
    recipe: Recipe | None = None
    #: (lane, why) for the certified row's lanes that ran and failed: their paths stay stock
    failed: tuple[tuple[str, str], ...] = ()

    def allows(self, lane: str) -> bool:
        """Whether the patched path that ``lane`` certifies may be used."""
        if self.kind == "uncertified_override":
            return True
        return self.kind == "certified" and lane in self.lanes

    @property
    def range_export(self) -> bool:
        return self.allows("range_export_slice")

    @property
    def append_import(self) -> bool:
        return self.allows("append_import_exact")

    @property
    def layer_copy(self) -> bool:
        return self.allows("layer_copy_exact")

    def describe(self) -> str:
        recipe = self.recipe.describe() if self.recipe else "stock llama-cpp-python"
        return f"{self.kind}: {self.reason} [{recipe}]"

    def to_json(self) -> dict[str, Any]:
        """The verdict as ``run --json`` and ``kv-cache status --json`` report it: the kind,
        the one-line description, the lanes whose patched paths are used, and the certified
        row's failed lanes with the roster's reasons."""
        return {
            "verdict": self.kind,
            "reason": self.describe(),
            "lanes": [lane for lane in LANES if self.allows(lane)],
            "failed": dict(self.failed),
            "recipe": asdict(self.recipe) if self.recipe is not None else None,
        }


def decide(
    library: Recipe | None, roster: Roster | None, key: RowKey, *, allow_uncertified: bool = False
) -> Verdict:
    """Compare the loaded library's recipe and the model's row with the roster.

    ``library`` is None for a stock build (no skippy symbols). A patched build whose ABI this
    skippy-llama does not speak is treated as stock: its calls cannot be made safely at all.
    """
    if library is None:
        return Verdict("stock", "the llama.cpp library has no skippy patches")
    if library.skippy_abi != SKIPPY_ABI_VERSION:
        return Verdict(
            "stock",
            f"the library's skippy ABI {library.skippy_abi} is not {SKIPPY_ABI_VERSION}, "
            "the one this skippy-llama speaks",
            recipe=library,
        )
    problem = _uncertified_reason(library, roster, key)
    if problem is None:
        assert roster is not None
        row = roster.row(key)
        assert row is not None
        return Verdict("certified", _certified_reason(key, row), row.lanes, library, row.failed)
    if allow_uncertified:
        return Verdict(
            "uncertified_override", f"{problem}; native.allow_uncertified is set", recipe=library
        )
    return Verdict("uncertified", f"{problem}; using the stock paths", recipe=library)


def _certified_reason(key: RowKey, row: RosterRow) -> str:
    """Which lanes the row certifies and which keep the stock paths (the roster says why)."""
    others = [lane for lane in LANES if lane not in row.lanes]
    reason = f"{key.describe()} is certified for {', '.join(row.lanes)}"
    if others:
        reason += f"; stock paths for {', '.join(others)}"
    return reason


def _uncertified_reason(library: Recipe, roster: Roster | None, key: RowKey) -> str | None:
    if roster is None:
        return "there is no roster"
    if roster.recipe != library:
        diffs = [
            f"{name} {getattr(library, name)!r} (roster: {getattr(roster.recipe, name)!r})"
            for name in ("llama_cpp_python", "llama_cpp_commit", "skippy_abi", "queue_sha256")
            if getattr(library, name) != getattr(roster.recipe, name)
        ]
        return "the roster certifies another recipe: " + ", ".join(diffs)
    if roster.row(key) is None:
        return f"{key.describe()} is not certified"
    return None


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RosterError(f"{what} must be an object")
    return value


def _str(doc: Mapping[str, Any], name: str, where: str) -> str:
    value = doc.get(name)
    if not isinstance(value, str) or not value:
        raise RosterError(f"{where}: {name} must be a non-empty string")
    return value


def _int(doc: Mapping[str, Any], name: str, where: str) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RosterError(f"{where}: {name} must be an integer")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m skippy_llama.roster digest [PATCHES_DIR]``: print the patch-queue digest."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "digest" or len(args) > 2:
        print("usage: python -m skippy_llama.roster digest [PATCHES_DIR]", file=sys.stderr)
        return 2
    print(queue_digest(Path(args[1]) if len(args) == 2 else PATCHES_DIR))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
