"""Certify the patched llama.cpp on real models and write roster/split-certified.json.

    python scripts/certify.py            run every lane per model and KV layout, write the roster
                                         (rows of other backends under the same patch queue are
                                         kept: run it on each backend, e.g. on a CUDA machine
                                         with --models smollm2 where Gemma 3 is not installed)
    python scripts/certify.py --check    fail (exit 1) when the roster does not match this checkout's
                                         patch queue and recipe, was edited by hand, or (on a patched
                                         library) the loaded library was built from another queue

Certification needs the library built by scripts/build_patched_llama.sh from this checkout's queue
(its recipe is the one the roster records). Each lane is a real run on the model whose
content digest the row records; a row lists only the lanes that passed:

  page_restore_exact   prefix cut into pages, reassembled, restored with set_data: suffix logits
                       bit-identical to a cold prefill
  range_export_slice   range exports equal, byte for byte, the matching slice of a full export
  append_import_exact  a resident prefix continued by append import gives bit-identical logits,
                       and non-continuing blobs are refused with the sequence untouched
  restart_exact        pages written to disk restore exactly in a fresh process
  l1_stream_copy_exact a resident prefix kept as a device checkpoint and copied back (the L1 path)
                       gives bit-identical logits; cut shorter too, except for sliding-window
                       models, whose checkpoints the runtime serves only at full length
  layer_copy_exact     pages kept in a host arena laid out as the KV tensors (L2's arena) are
                       copied per layer into a fresh context (patch 0006) and give bit-identical
                       logits; cells copied out equal the state's pages; a non-continuing copy
                       is refused with the sequence untouched
  lone_decode_exact    the last tokens decoded one at a time, as a reply is generated, give
                       bit-identical logits (patch 0004; the runtime probes this at load on the
                       user's CPU, so the lane records what the patch gives, it gates nothing)

Models: SmolLM2-135M (llama) and Gemma 3 270M (gemma3, sliding-window attention, run past its
512-token window). A lane that fails is recorded with its reason under the row's "failed".

    python scripts/certify.py --cachegen  the ``cachegen`` lane only (scripts/qualify_cachegen.py):
                                         qualify the lossy CacheGen page codec per (model digest,
                                         K/V layout, backend) on SmolLM2 and Gemma 3 (teacher-
                                         forced quality against the native cache) and write the
                                         roster's "cachegen" rows, keeping the other rows as they
                                         are

    python scripts/certify.py --restore-points  the ``restore_points`` lane only (issue 46): one
                                         row per architecture family and backend, on the
                                         synthetic GGUFs of every recurrent and hybrid family
                                         (skippy_llama.testing.synthetic) and on Gemma 3 270M
                                         (sliding window): a restore point restored and the rest
                                         decoded gives the cold logits bit for bit, at which
                                         positions, and the snapshot's bytes. Where a restore at
                                         any prompt end is not exact (a GPU: batch splits change
                                         the numbers) it certifies restores at multiples of the
                                         micro-batch ("multiples of N tokens"), which is what the
                                         runtime keeps off the CPU; the runtime turns restore
                                         points on off the CPU only with such a row. On a CUDA
                                         machine: python3 scripts/certify.py --restore-points
                                         (add --roster FILE to write a copy to bring back)

A plain run (no option) runs every lane above and then the ``restore_points`` lane, keeping the
roster's ``cachegen`` rows; each of those options keeps the rest: each lane is re-run on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy_llama.errors import RosterError  # noqa: E402
from skippy_llama.identity import file_digest  # noqa: E402
from skippy_llama.models import default_model_path, gemma3_model_path  # noqa: E402
from skippy_llama.roster import (  # noqa: E402
    PATCHES_DIR,
    ROSTER_PATH,
    RestorePointRow,
    Roster,
    RosterRow,
    expected_recipe,
    load_roster,
    parse_roster,
)
from skippy_llama.runtime import native, native_ext  # noqa: E402
from skippy_llama.runtime.arena_setup import layers_match  # noqa: E402
from skippy_llama.runtime.context import adjusted  # noqa: E402
from skippy_llama.runtime.recipe import library_recipe, row_key  # noqa: E402
from skippy_llama.runtime.seam import arena_spans  # noqa: E402
from skippy_llama.state import (  # noqa: E402
    assemble,
    cut_pages,
    page_from_bytes,
    parse_state,
    slice_state,
)
from skippy_llama.state.format import SequenceState, parse_layout, parse_sections  # noqa: E402
from skippy_llama.state.layout import KVLayout  # noqa: E402
from skippy_llama.state.pages import Page  # noqa: E402
from skippy_llama.tiers.arena import ArenaSlot, HostArena  # noqa: E402

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as "
    "his father had done before him. At the top he trimmed the wick, polished the great lens and "
    "wound the clockwork that turned the light; ships far out at sea watched for its pulse. "
)
PAGE = 64


@dataclass(frozen=True)
class Layout:
    name: str
    type_k: int
    type_v: int
    flash_attn: bool


F16, Q8_0 = 1, 8
LAYOUTS = (
    Layout("f16-fa_off", F16, F16, False),
    Layout("f16-fa_on", F16, F16, True),
)


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    #: prefix pages, a continuation, and a suffix whose logits are compared
    split: tuple[int, int, int]


#: the certification models by short name (``--models``)
MODELS: dict[str, Callable[[], Model]] = {
    "smollm2": lambda: Model("SmolLM2-135M-Instruct.Q4_1", default_model_path(), (128, 192, 300)),
    # past Gemma 3's 512-token window, where the sliding-window layers drop cells
    "gemma3": lambda: Model("gemma-3-270m-q4_k_m", gemma3_model_path(), (256, 640, 704)),
}


def _models(names: list[str] | None = None) -> list[Model]:
    return [make() for name, make in MODELS.items() if not names or name in names]


def _llama(model: Path, layout: Layout, n_seq_max: int = 1) -> llama_cpp.Llama:
    # the runtime's own context adjustment: n_seq_max sequences in one unified cache
    with adjusted(n_seq_max):
        # every layer offloaded on a GPU build (its KV cache on the device, as users run it);
        # a CPU build ignores it
        return llama_cpp.Llama(
            str(model), n_ctx=1024, n_batch=512, type_k=layout.type_k, type_v=layout.type_v,
            flash_attn=layout.flash_attn, swa_full=True, n_gpu_layers=-1, verbose=False,
        )  # fmt: skip


def _tokens(llm: llama_cpp.Llama, n: int) -> list[int]:
    tokens = llm.tokenize((TEXT * 16).encode())[:n]
    assert len(tokens) == n, "the certification text is too short"
    return tokens


def _logits(llm: llama_cpp.Llama) -> np.ndarray[Any, Any]:
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def _continue(llm: llama_cpp.Llama, tokens: list[int], done: int) -> np.ndarray[Any, Any]:
    """Tell llama_cpp the first ``done`` tokens are in the cache, decode the rest, return logits."""
    llm.input_ids[:done] = tokens[:done]
    llm.n_tokens = done
    llm.eval(tokens[done:])
    return _logits(llm)


class Run:
    """One model and layout: a cold context that decoded the text in the lanes' batch shapes."""

    def __init__(self, model: Model, layout: Layout) -> None:
        self.model, self.layout = model, layout
        self.split = model.split
        self.cold = _llama(model.path, layout)
        self.n_swa = int(llama_cpp.llama_model_n_swa(self.cold.model))
        self.tokens = _tokens(self.cold, self.split[2])
        a, b, c = self.split
        for lo, hi in ((0, a), (a, b), (b, c)):
            self.cold.eval(self.tokens[lo:hi])
        self.reference = _logits(self.cold)
        self.blob = native.get_seq_state(self.cold.ctx, 0)
        # a sliding-window model's state has a second section the page format does not hold
        self.sections: list[SequenceState] = parse_sections(self.blob)
        self.full: SequenceState | None = (
            parse_state(self.blob) if len(self.sections) == 1 else None
        )

    @property
    def kv_layout(self) -> KVLayout:
        """The layout the runtime reads for the row key (SkippyLlama.kv_layout's parse_layout):
        both sections of a sliding-window state, so the runtime finds the row certified here."""
        return parse_layout(self.blob)

    def paging_refusal(self) -> str | None:
        """Why pages of this model cannot be cut (None when they can), from the measured state."""
        if self.full is not None:
            return None
        parts = ", ".join(
            f"{sec.layout.n_layer} layers holding {sec.n_tokens} cells "
            f"[{int(sec.positions.min())}, {int(sec.positions.max()) + 1})"
            for sec in self.sections
        )
        return (
            f"the state of {self.split[2]} tokens has {len(self.sections)} memory sections "
            f"({parts}; n_swa {self.n_swa}, swa_full on): the sliding-window layers keep only "
            "their window's cells, so pages cut from a capture cannot rebuild a shorter "
            "prefix; SWA models stay L1-only"
        )

    def warm(self, n_seq_max: int = 1) -> llama_cpp.Llama:
        return _llama(self.model.path, self.layout, n_seq_max)

    def close(self) -> None:
        self.cold.close()


Outcome = str | None
"""A lane's result: None when it passed, else why not."""

DIFFER = "logits differ from a cold prefill"


def _exact(got: np.ndarray[Any, Any], run: Run) -> Outcome:
    if np.array_equal(got, run.reference):
        return None
    return f"{DIFFER} (max |d| {float(np.abs(got - run.reference).max()):.3g})"


def lane_page_restore(run: Run) -> Outcome:
    if run.full is None:
        return run.paging_refusal()
    a, b, _ = run.split
    pages = [page_from_bytes(p.to_bytes()) for p in cut_pages(run.full, PAGE)]
    blob = assemble(pages[: b // PAGE], run.full.layout, seq_id=0)
    warm = run.warm()
    try:
        warm.eval(run.tokens[:a])  # something else in the sequence: set_data clears it
        if not native.set_seq_state(warm.ctx, blob, 0):
            return "llama_state_seq_set_data refused the assembled prefix"
        return _exact(_continue(warm, run.tokens, b), run)
    finally:
        warm.close()


def lane_range_export(run: Run) -> Outcome:
    if run.full is None:
        # measured: the patched call exports llama_kv_cache memory only
        size = native_ext.range_export_size(run.cold.ctx, 0, 0, PAGE)
        if size == 0:
            return (
                "skippy_state_seq_range_get_size returns 0: patch 0002 exports llama_kv_cache "
                "memory only, and this model's is llama_kv_cache_iswa"
            )
        return run.paging_refusal()
    n = run.full.n_tokens
    for p0, p1 in ((0, PAGE), (PAGE, 3 * PAGE), (3 * PAGE, n), (5, -1)):
        end = n if p1 < 0 else p1
        part = parse_state(native_ext.range_export(run.cold.ctx, 0, p0, p1))
        want = np.arange(p0, end, dtype=np.int32)
        if part.layout != run.full.layout or not np.array_equal(part.positions, want):
            return f"range [{p0}, {p1}) exported other cells or another layout"
        page = Page(p0, part.n_tokens, part.layout, part.ext, part.k, part.v)
        if page.to_bytes() != slice_state(run.full, p0, end).to_bytes():
            return f"range [{p0}, {p1}) differs from the slice of a full export"
    return None


def lane_append_import(run: Run) -> Outcome:
    a, b, _ = run.split
    if run.full is None:
        # measured: offer the whole stock state to an empty sequence
        warm = run.warm()
        try:
            if native_ext.append_import(warm.ctx, run.blob, 0):
                return run.paging_refusal()
            return (
                "skippy_state_seq_append_data refuses: patch 0003 appends to llama_kv_cache "
                "memory only, and this model's is llama_kv_cache_iswa"
            )
        finally:
            warm.close()
    good = native_ext.range_export(run.cold.ctx, 0, a, b)
    bad = [
        native_ext.range_export(run.cold.ctx, 0, a + 8, b),
        native_ext.range_export(run.cold.ctx, 0, a - 8, b),
        good[:-4096],
    ]
    warm = run.warm()
    try:
        warm.eval(run.tokens[:a])
        before = bytes(native.get_seq_state(warm.ctx, 0))
        for blob in bad:
            if native_ext.append_import(warm.ctx, blob, 0):
                return "a blob whose positions do not continue was accepted"
            if bytes(native.get_seq_state(warm.ctx, 0)) != before:
                return "a refused append changed the sequence"
        if not native_ext.append_import(warm.ctx, good, 0):
            return "a continuing blob was refused"
        return _exact(_continue(warm, run.tokens, b), run)
    finally:
        warm.close()


def lane_layer_copy(run: Run) -> Outcome:
    """Patch 0006, L2's arena path: pages put in a host arena (the device's layout) are copied
    per layer into a fresh context in two calls (a prefix, then the rest after it) and give
    bit-identical logits; a copy out of the cold context equals the pages byte for byte; a
    span whose positions do not continue the sequence is refused with nothing changed."""
    if run.full is None:
        if native_ext.kv_layers(run.cold.ctx) is None:
            return (
                "skippy_kv_layers returns -1: patch 0006 copies llama_kv_cache memory only, and "
                "this model's is llama_kv_cache_iswa"
            )
        return run.paging_refusal()
    a, b, _ = run.split
    layout = run.full.layout
    pages = cut_pages(run.full, PAGE)[: b // PAGE]
    infos = native_ext.kv_layers(run.cold.ctx)
    if infos is None:
        return "skippy_kv_layers refuses this cache"
    differ = layers_match(infos, layout)
    if differ is not None:
        return f"skippy_kv_layers disagrees with the state format: {differ}"
    # the first page in the last slot, the others from slot 0 on: more than one run of cells
    n_slots = len(pages) + 2
    arena = HostArena(layout, PAGE, n_slots)
    slots = [arena.put(page, n_slots - 2 if i == 0 else None) for i, page in enumerate(pages)]
    if any(slot is None for slot in slots):
        return "the arena refused a page"
    held = [slot for slot in slots if slot is not None]
    # copied out into empty slots 0, 1, ... of another arena (nothing put there first)
    out = HostArena(layout, PAGE, n_slots)
    out_slots = [ArenaSlot(i, p.start, p.n_tokens, b"", p.nbytes) for i, p in enumerate(pages)]
    parts = [(slot, slot.start, slot.end) for slot in out_slots]
    if not native_ext.cells_get(run.cold.ctx, 0, 0, arena_spans(out, parts)):
        return "skippy_kv_cells_get refused the cold context's cells"
    for slot, page in zip(out_slots, pages, strict=True):
        if out.page(slot).to_bytes() != page.to_bytes():
            return f"cells copied out at [{page.start}, {page.end}) differ from the state's page"
    warm = run.warm()
    try:
        first = [(s, s.start, min(s.end, a)) for s in held if s.start < a]
        rest = [(s, max(s.start, a), s.end) for s in held if s.end > a]
        if native_ext.cells_set(warm.ctx, 0, 5, arena_spans(arena, first)):
            return "cells at position 5 were added to an empty sequence"
        if native.seq_pos_max(warm.ctx, 0) != -1:
            return "a refused copy changed the sequence"
        if not native_ext.cells_set(warm.ctx, 0, 0, arena_spans(arena, first)):
            return "skippy_kv_cells_set refused a prefix"
        if not native_ext.cells_set(warm.ctx, 0, a, arena_spans(arena, rest)):
            return "skippy_kv_cells_set refused cells continuing the sequence"
        return _exact(_continue(warm, run.tokens, b), run)
    finally:
        warm.close()
        arena.close()
        out.close()


def lane_l1_copy(run: Run) -> Outcome:
    """The L1 path: a device checkpoint copied back, at full length and (not SWA) cut shorter."""
    a, b, c = run.split
    warm = run.warm(n_seq_max=2)
    try:
        for lo, hi in ((0, a), (a, b)):
            warm.eval(run.tokens[lo:hi])
        handle = native.checkpoint(warm.ctx, 0, 1, b)
        native.seq_rm(warm.ctx, 0)
        warm.n_tokens = 0
        warm.eval(run.tokens[c - 40 : c])  # something else in the working sequence
        native.restore_checkpoint(warm.ctx, handle, 0)
        full = _exact(_continue(warm, run.tokens, b), run)
        if full is not None:
            return f"a checkpoint restored at full length: {full}"
        # a checkpoint of all c tokens cut to b
        handle = native.checkpoint(warm.ctx, 0, 1, c)
        native.seq_rm(warm.ctx, 0)
        warm.n_tokens = 0
        native.restore_checkpoint(warm.ctx, handle, 0)
        native.seq_rm(warm.ctx, 0, b, -1)
        cut = _exact(_continue(warm, run.tokens, b), run)
        if cut is not None and run.n_swa and c > run.n_swa:
            # the checkpoint holds only the last n_swa cells of the sliding-window layers; the
            # runtime (ResidentIndex.window) never cuts such a checkpoint, so this is not its path
            print(
                f"certify: {run.model.name} {run.layout.name} checkpoint cut {c}->{b}: {cut} "
                f"(expected with n_swa {run.n_swa}; the runtime serves it only at full length)"
            )
            return None
        return None if cut is None else f"a checkpoint cut shorter: {cut}"
    finally:
        warm.close()


def lane_lone_decode(run: Run) -> Outcome:
    """Patch 0004: tokens decoded one at a time (a reply) leave a cold prefill's cells."""
    _, b, c = run.split
    warm = run.warm()
    try:
        warm.eval(run.tokens[:b])
        for token in run.tokens[b:c]:
            warm.eval([token])
        return _exact(_logits(warm), run)
    finally:
        warm.close()


def lane_restart(run: Run) -> Outcome:
    if run.full is None:
        return run.paging_refusal()
    _, b, c = run.split
    with tempfile.TemporaryDirectory() as tmp:
        pages = cut_pages(run.full, PAGE)[: b // PAGE]
        for i, page in enumerate(pages):
            (Path(tmp) / f"{i:04d}.page").write_bytes(page.to_bytes())
        np.save(Path(tmp) / "reference.npy", run.reference)
        child = subprocess.run(
            [sys.executable, __file__, "--restart-child", tmp, str(run.model.path),
             run.layout.name, str(b), str(c)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if child.returncode != 0:
            print(child.stdout + child.stderr, file=sys.stderr)
            return f"the fresh process's restore did not match ({child.returncode})"
        return None


def restart_child(tmp: str, model: str, layout_name: str, b: str, c: str) -> int:
    """The fresh process of ``restart_exact``: restore the pages from disk and compare logits."""
    layout = next(lay for lay in LAYOUTS if lay.name == layout_name)
    pages = [page_from_bytes(p.read_bytes()) for p in sorted(Path(tmp).glob("*.page"))]
    reference = np.load(Path(tmp) / "reference.npy")
    llm = _llama(Path(model), layout)
    try:
        tokens = _tokens(llm, int(c))
        if not native.set_seq_state(llm.ctx, assemble(pages, pages[0].layout, seq_id=0), 0):
            return 1
        return 0 if np.array_equal(_continue(llm, tokens, int(b)), reference) else 1
    finally:
        llm.close()


LANES: dict[str, Callable[[Run], Outcome]] = {
    "page_restore_exact": lane_page_restore,
    "l1_stream_copy_exact": lane_l1_copy,
    "range_export_slice": lane_range_export,
    "append_import_exact": lane_append_import,
    "restart_exact": lane_restart,
    "lone_decode_exact": lane_lone_decode,
    "layer_copy_exact": lane_layer_copy,
}


def certify(path: Path, patches: Path, models: list[str] | None = None) -> int:
    """Run every lane per model and K/V layout on the loaded library's backend; the roster
    keeps the rows other backends certified under the same recipe (a CUDA machine adds its
    rows to the CPU ones), and the ``cachegen`` rows."""
    recipe = library_recipe()
    want = expected_recipe(patches)
    if recipe != want:
        print(
            f"certify: the loaded library is {recipe.describe() if recipe else 'a stock build'}, "
            f"not this checkout's {want.describe()}; build and install it with "
            "scripts/build_patched_llama.sh first",
            file=sys.stderr,
        )
        return 1
    rows: list[RosterRow] = []
    for model in _models(models):
        digest = file_digest(model.path)
        for layout in LAYOUTS:
            run = Run(model, layout)
            try:
                arch = str(run.cold.metadata.get("general.architecture", "unknown"))
                passed: list[str] = []
                failed: list[tuple[str, str]] = []
                for lane, fn in LANES.items():
                    try:
                        why = fn(run)
                    except Exception as exc:  # a lane that crashes did not pass; say why
                        why = f"{type(exc).__name__}: {exc}"
                    print(f"certify: {model.name} {layout.name} {lane}: {why or 'pass'}")
                    if why is None:
                        passed.append(lane)
                    else:
                        failed.append((lane, why))
                key = row_key(arch, native.backend_name(), run.kv_layout)
            finally:
                run.close()
            if passed:
                rows.append(RosterRow(key, tuple(passed), model.name, digest, tuple(failed)))
    try:
        old = load_roster(path)
    except RosterError:
        old = None
    backend = native.backend_name()
    kept = [r for r in old.rows if r.key.backend != backend] if old and old.recipe == want else []
    roster = Roster(
        want,
        (*kept, *rows),
        old.cachegen if old is not None else (),
        old.restore_points if old is not None else (),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(roster.to_json(), "utf-8")
    print(f"certify: wrote {path} ({len(rows)} rows)")
    return 0


#: K/V layouts the cachegen lane qualifies (name, type_k, type_v, flash attention); Q8_0 K/V
#: needs flash attention (a quantized V cannot be transposed)
CACHEGEN_LAYOUTS = (
    Layout("f16-fa_off", F16, F16, False),
    Layout("f16-fa_on", F16, F16, True),
    Layout("q8_0-fa_on", Q8_0, Q8_0, True),
)


def certify_cachegen(
    path: Path, n_cal: int, n_held: int, layouts: list[str] | None, models: list[str] | None
) -> int:
    """The ``cachegen`` lane: qualify every layout of every model, replace those rows only."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import qualify_cachegen

    try:
        roster = load_roster(path)
    except RosterError as exc:
        print(f"certify --cachegen: {exc}", file=sys.stderr)
        return 1
    if roster is None:
        print(f"certify --cachegen: no roster at {path}; run scripts/certify.py", file=sys.stderr)
        return 1
    rows = list(roster.cachegen)
    for model, layout in [(m, lay) for m in _models(models) for lay in CACHEGEN_LAYOUTS]:
        if layouts and layout.name not in layouts:
            continue
        digest = file_digest(model.path)
        row, _ = qualify_cachegen.qualify(
            model.path, model.name, digest, layout.type_k, layout.type_v, layout.flash_attn,
            n_cal=n_cal, n_held=n_held,
        )  # fmt: skip
        verdict = "qualified " + str(row.params) if row.passed else "FAILED: " + row.reason
        print(f"certify: {model.name} {layout.name} cachegen: {verdict}", flush=True)
        rows = [r for r in rows if not r.matches(row.model_digest, row.backend, row.layout_digest)]
        rows.append(row)
        # written after every layout: a long run keeps what it measured
        roster = dataclasses.replace(roster, cachegen=tuple(rows))
        path.write_text(roster.to_json(), "utf-8")
    print(f"certify: wrote {path} ({len(rows)} cachegen rows)")
    return 0


def _gemma3_points(path: Path, backend: str) -> RestorePointRow:
    """Gemma 3's restore points at the positions the runtime keeps (multiples of
    ``SWA_ALIGN`` and ``n_ubatch``: 512 here) and, as the control, at one it does not keep,
    against a cold prefill of the whole prompt by plain ``Llama`` (its full-size SWA cache)."""
    from skippy_llama.runtime.restore_points import SWA_ALIGN

    def last(llm: llama_cpp.Llama) -> np.ndarray[Any, Any]:
        return np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)
        ).copy()

    def open_() -> llama_cpp.Llama:
        # every layer offloaded on a GPU build, as the runtime's users run it (no-op on the CPU)
        return llama_cpp.Llama(
            str(path), n_ctx=2048, n_gpu_layers=-1, n_threads=1, n_threads_batch=1, verbose=False
        )

    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(3, 200_000, size=1300)]
    cold = open_()
    cold.eval(prompt)
    want = last(cold)
    cold.close()
    llm = open_()
    align = int(np.lcm(SWA_ALIGN, llm.context_params.n_ubatch))
    diffs: dict[int, float] = {}
    snapshot = 0
    try:
        for p in (align, 2 * align, 700):
            llm.reset()
            llama_cpp.llama_memory_clear(native.memory(llm.ctx), True)
            llm.eval(prompt[:p])
            blob = bytes(native.get_seq_state(llm.ctx, 0))
            partial = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
            snapshot = int(llama_cpp.llama_state_seq_get_size_ext(llm.ctx, 0, partial)) - 8
            llm.reset()
            llama_cpp.llama_memory_clear(native.memory(llm.ctx), True)
            if not native.set_seq_state(llm.ctx, bytearray(blob), 0):
                diffs[p] = float("inf")
                continue
            llm.input_ids[:p] = prompt[:p]
            llm.n_tokens = p
            llm.eval(prompt[p:])
            diffs[p] = float(np.max(np.abs(last(llm) - want)))
    finally:
        llm.close()
    exact = diffs[align] == 0.0 and diffs[2 * align] == 0.0
    return RestorePointRow(
        architecture="gemma3",
        memory="sliding window",
        backend=backend,
        flash_attn=False,
        model=path.stem,
        model_digest=file_digest(path),
        exact=exact,
        positions=f"multiples of {align} tokens",
        snapshot_bytes=snapshot,
        reason=(
            f"a restore at 700 tokens was {diffs[700]:.3g} off (the window's cells land shifted "
            "and small batches take other kernels): points only on these positions"
            if exact
            else f"restores at {align} and {2 * align} tokens were off by {diffs[align]:.3g} and "
            f"{diffs[2 * align]:.3g}"
        ),
    )


def _aligned_points(model: Path) -> tuple[bool, int]:
    """A restore at multiples of the micro-batch, the rest decoded in the cold prefill's own
    micro-batches, in a ``Llama`` as the runtime builds one (every layer offloaded on a GPU
    build; ``n_batch`` = ``n_ubatch`` as llama-cpp-python sets them, or ``LLCPP_FORCE_UBATCH``
    through tests/force_ngl): (exact, the step in tokens)."""
    from skippy_llama.runtime.restore_probe import aligned_restores_exactly

    llm = llama_cpp.Llama(
        str(model), n_ctx=2048, n_gpu_layers=-1, n_threads=1, n_threads_batch=1, verbose=False
    )
    try:
        step = int(llm.context_params.n_ubatch)
        return aligned_restores_exactly(llm, step), step
    finally:
        llm.close()


def certify_restore_points(path: Path, models: list[str] | None) -> int:
    """The ``restore_points`` lane: a row per synthetic recurrent and hybrid family and for
    Gemma 3 where it is installed; replaces those rows only."""
    from skippy_llama.errors import ModelNotFoundError
    from skippy_llama.runtime.restore_probe import probe_restore_points
    from skippy_llama.testing.synthetic import FAMILIES, write_model

    loaded = library_recipe()
    try:
        roster = load_roster(path)
    except RosterError as exc:
        print(f"certify --restore-points: {exc}", file=sys.stderr)
        return 1
    if roster is not None and loaded != roster.recipe:
        # rows count only under the recipe the runtime's library was built from
        print(
            f"certify --restore-points: the loaded library is "
            f"{loaded.describe() if loaded else 'a stock build'}, the roster certifies "
            f"{roster.recipe.describe()}: build it with scripts/build_patched_llama.sh first",
            file=sys.stderr,
        )
        return 1
    if roster is None:
        print(
            f"certify --restore-points: no roster at {path}; run scripts/certify.py",
            file=sys.stderr,
        )
        return 1
    backend = native.backend_name()
    rows: list[RestorePointRow] = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, memory in FAMILIES.items():
            model = write_model(Path(tmp) / f"{family}.gguf", family)
            report = probe_restore_points(model, prompt_ends=(17, 70), chunk=16)
            exact = report.exact and all(p.control_differs for p in report.points)
            worst = max(p.max_abs_diff for p in report.points)
            positions, reason = "any prompt end", ""
            if not exact:
                # a GPU's kernels change with the batch split: points on micro-batch boundaries,
                # where the rest of a prompt runs in the cold prefill's own micro-batches
                aligned, step = _aligned_points(model)
                if aligned:
                    positions = f"multiples of {step} tokens"
                    reason = f"at any prompt end off by up to {worst:.3g}: micro-batch boundaries"
                    exact = True
                else:
                    reason = (
                        f"restore + suffix off by up to {worst:.3g}, and at multiples of {step} "
                        "tokens too"
                    )
            rows.append(
                RestorePointRow(
                    architecture=report.architecture,
                    memory=memory,
                    backend=backend,
                    flash_attn=False,
                    model=f"synthetic {family} (skippy_llama.testing.synthetic)",
                    model_digest=file_digest(model),
                    exact=exact,
                    positions=positions,
                    snapshot_bytes=report.points[-1].snapshot_bytes,
                    reason=reason,
                )
            )
            print(f"certify: {family} restore points: {positions if exact else 'NOT exact'}")
    if not models or "gemma3" in models:
        try:
            rows.append(_gemma3_points(gemma3_model_path(), backend))
            print(f"certify: gemma3 restore points: {rows[-1].positions}, exact={rows[-1].exact}")
        except ModelNotFoundError as exc:
            print(f"certify: gemma3 skipped ({exc})")
    keep = [
        r
        for r in roster.restore_points
        if not any((r.architecture, r.backend) == (n.architecture, n.backend) for n in rows)
    ]
    roster = dataclasses.replace(roster, restore_points=tuple(keep + rows))
    path.write_text(roster.to_json(), "utf-8")
    print(f"certify: wrote {path} ({len(roster.restore_points)} restore-point rows)")
    return 0


def check(path: Path, patches: Path) -> int:
    """Exit status 1 with the reason when the roster is stale, hand-edited or mismatched."""
    try:
        roster = load_roster(path)
        want = expected_recipe(patches)
    except RosterError as exc:
        print(f"certify --check: {exc}", file=sys.stderr)
        return 1
    if roster is None:
        print(f"certify --check: no roster at {path}; run scripts/certify.py", file=sys.stderr)
        return 1
    problems = []
    if roster.recipe != want:
        problems.append(
            f"the roster certifies {roster.recipe.describe()}, this checkout's patch queue is "
            f"{want.describe()}: re-run scripts/certify.py on a fresh patched build"
        )
    if parse_roster(path.read_text("utf-8")).to_json() != path.read_text("utf-8"):
        problems.append("the roster is not in the form scripts/certify.py writes (edited by hand?)")
    if not roster.rows:
        problems.append("the roster certifies nothing")
    loaded = library_recipe()
    if loaded is not None and loaded != want:
        problems.append(
            f"the loaded library is {loaded.describe()}, not {want.describe()}: rebuild it with "
            "scripts/build_patched_llama.sh"
        )
    for problem in problems:
        print(f"certify --check: {problem}", file=sys.stderr)
    if not problems:
        print(f"certify --check: {path} matches {want.describe()} ({len(roster.rows)} rows)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="only check the roster; run nothing")
    parser.add_argument(
        "--roster", type=Path, default=ROSTER_PATH, help="roster file (default: %(default)s)"
    )
    parser.add_argument(
        "--patches", type=Path, default=PATCHES_DIR, help="patch queue (default: %(default)s)"
    )
    parser.add_argument(
        "--cachegen", action="store_true", help="run the cachegen lane only (see above)"
    )
    parser.add_argument(
        "--restore-points", action="store_true", help="run the restore_points lane only"
    )
    parser.add_argument(
        "--prompts", type=int, default=64, help="cachegen: calibration prompts (default 64)"
    )
    parser.add_argument(
        "--held-out", type=int, default=16, help="cachegen: held-out texts (default 16)"
    )
    parser.add_argument(
        "--layouts", nargs="*", default=None, help="cachegen: only these layouts (by name)"
    )
    parser.add_argument(
        "--models",
        nargs="*",
        choices=sorted(MODELS),
        default=None,
        help="certify on these models only (default: all; a machine without the Gemma 3 "
        "packages can certify SmolLM2 alone)",
    )
    parser.add_argument("--restart-child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.restart_child:
        return restart_child(*args.restart_child)
    if args.cachegen:
        return certify_cachegen(args.roster, args.prompts, args.held_out, args.layouts, args.models)
    if args.restore_points:
        return certify_restore_points(args.roster, args.models)
    if args.check:
        return check(args.roster, args.patches)
    rc = certify(args.roster, args.patches, args.models)
    # the restore points of this backend too: off the CPU the runtime takes them only with
    # this lane's rows (a plain run on a CUDA machine certifies them there)
    return rc or certify_restore_points(args.roster, args.models)


if __name__ == "__main__":
    raise SystemExit(main())
