"""The matrix's family rows (issue 46): what each architecture family gets from each tier.

Most new open models keep state that is not per token (recurrent, hybrid) or only a window of
it (sliding-window attention); their prefixes are served from restore points
(``skippy_llama.restore_points``). Per family, a shared-document workload runs through every
tier that keeps restore points, each answer beside a cold plain ``Llama`` (tokens and the
first-token logits compared bit for bit):

1. ``cold``: document + question 1 on a fresh ``SkippyLlama`` (L3 on; the remote server too
   when given): its prefill keeps restore points (every 256 tokens of the document, and the
   prompt's end), which L3 stores and the remote tier takes;
2. ``l1``: question 2 on the same instance (the process's own points);
3. ``l2``: question 3 after L1's points are dropped (the RAM mirror of L3);
4. ``l3``: question 4 on a new instance on the same L3 directory (a restart);
5. ``remote``: question 5 on a new instance with an empty L3 and the shared server (only with
   a server: ``remote``);
6. ``bundle``: the document's deepest point (and the shallower ones it extends) exported from
   the first L3 as a signed bundle, imported into an empty L3, question 6 on a new instance
   there.

Families: the synthetic recurrent and hybrid GGUFs of :mod:`skippy_llama.testing.synthetic`
(written into the work directory) and Gemma 3 270M (sliding window) when installed. A family
whose restore points are off on this build (a GPU build, the stock library) gets rows saying
so, served as plain ``Llama``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import Settings
from ..runtime import native
from ..runtime.baseline import ColdLlama
from ..runtime.llama import SkippyLlama

Say = Callable[[str], None]

#: The family columns, in the order the workload serves them.
FAMILY_TIERS = ("l1", "l2", "l3", "remote", "bundle")
#: Tokens of the shared document and of each question; answers are greedy.
DOC_TOKENS = 600
QUESTION_TOKENS = 12
ANSWER_TOKENS = 4
N_CTX = 1024


@dataclass
class FamilyRow:
    """One (family, tier) row: where the answer came from, and whether it equals cold."""

    family: str
    memory: str
    tier: str
    served: str  # the tier the restore came from (``cold``: none)
    cached_tokens: int
    prompt_tokens: int
    exact: bool | None  # None: not run
    ttft_ratio: float | None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Family:
    """A family to run: its name, what its memory keeps, and the model file."""

    name: str
    memory: str
    path: Path
    vocab: int  # token ids drawn below this


def available_families(work: Path, wanted: Sequence[str] | None = None) -> list[Family]:
    """The synthetic families (written under ``work``) and Gemma 3 270M when installed,
    filtered by name when ``wanted``."""
    from ..errors import ModelNotFoundError
    from ..models import gemma3_model_path
    from ..testing.synthetic import FAMILIES, write_model

    out = []
    for name, memory in FAMILIES.items():
        if wanted is None or name in wanted:
            work.mkdir(parents=True, exist_ok=True)
            out.append(Family(name, memory, write_model(work / f"{name}.gguf", name), 300))
    if wanted is None or "gemma3" in wanted:
        try:
            path = gemma3_model_path()
        except ModelNotFoundError:
            path = None
        if path is not None:
            out.append(
                Family("gemma3", "sliding window (SWA layers + full attention)", path, 200_000)
            )
    return out


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, vocab, size=n)]


def _answer(llm: Any, prompt: list[int]) -> tuple[list[int], bytes, float]:
    """Greedy tokens, the first token's logits (bytes) and the TTFT in seconds."""
    t0 = time.perf_counter()
    tokens: list[int] = []
    first = b""
    ttft = 0.0
    for token in llm.generate(prompt, temp=0.0, top_k=1):
        if not tokens:
            ttft = time.perf_counter() - t0
            # the prompt's last logits (before the first sampled token is decoded)
            first = native.last_logits(llm.ctx, llm.n_vocab()).tobytes()
        tokens.append(token)
        if len(tokens) == ANSWER_TOKENS:
            break
    return tokens, first, ttft


class _Run:
    """One family's workload (see the module docstring)."""

    def __init__(
        self,
        family: Family,
        work: Path,
        threads: int,
        remote: tuple[str, Path] | None,
    ) -> None:
        self.family = family
        self.work = work
        self.threads = threads
        self.remote = remote
        self.doc = _tokens(DOC_TOKENS, 7, family.vocab)
        self.kwargs: dict[str, Any] = {
            "n_ctx": N_CTX,
            "n_threads": threads,
            "n_threads_batch": threads,
            "verbose": False,
        }
        self.cold = ColdLlama(str(family.path), **self.kwargs)

    def close(self) -> None:
        self.cold.close()

    def settings(self, l3: Path, *, l2: bool = False, remote: bool = False) -> Settings:
        extra: dict[str, Any] = {}
        if l2:
            extra["l2"] = {"budget": "256MiB"}
        if remote and self.remote is not None:
            extra["remote"] = {"url": self.remote[0], "secret_file": str(self.remote[1])}
        l3_settings = {
            "mode": "fixed",
            "budget": "2GiB",
            "directory": str(l3),
            "minimum_free": "1GiB",
        }
        return Settings(l3=l3_settings, **extra)  # type: ignore[arg-type]

    def open(self, settings: Settings) -> SkippyLlama:
        return SkippyLlama(str(self.family.path), cache_settings=settings, **self.kwargs)

    def prompt(self, question: int) -> list[int]:
        return self.doc + _tokens(QUESTION_TOKENS, 100 + question, self.family.vocab)

    def row(self, tier: str, llm: SkippyLlama, question: int, note: str = "") -> FamilyRow:
        prompt = self.prompt(question)
        tokens, logits, ttft = _answer(llm, prompt)
        cold_tokens, cold_logits, cold_ttft = _answer(self.cold, prompt)
        event = llm.last_cache_event
        return FamilyRow(
            self.family.name,
            self.family.memory,
            tier,
            str(event.tier) if event is not None else "plain",
            int(event.cached_tokens) if event is not None else 0,
            len(prompt),
            tokens == cold_tokens and logits == cold_logits,
            ttft / cold_ttft if cold_ttft > 0 else None,
            note,
        )

    def not_run(self, tier: str, note: str) -> FamilyRow:
        return FamilyRow(self.family.name, self.family.memory, tier, "-", 0, 0, None, None, note)

    def rows(self) -> list[FamilyRow]:
        from ..handoff.bundle import generate_keypair, load_trust, read_signed
        from ..handoff.points import export_points, import_points, read_point_bundle
        from ..tiers.l3.tier import DiskTier

        work = self.work / self.family.name
        first = work / "l3-a"
        rows: list[FamilyRow] = []
        llm = self.open(self.settings(first, l2=True, remote=True))
        try:
            on = llm.restore_points is not None
            rows.append(self.row("cold", llm, 1))
            if not on:
                note = "restore points off on this build: served as plain Llama"
                return rows + [self.not_run(t, note) for t in FAMILY_TIERS]
            rows.append(self.row("l1", llm, 2))
            assert llm.restore_points is not None
            llm.restore_points.store.clear()  # L1's own points: L2 serves next
            rows.append(self.row("l2", llm, 3))
        finally:
            llm.close()
        with_l3 = self.open(self.settings(first))
        try:
            rows.append(self.row("l3", with_l3, 4, "a new instance on the same L3 (restart)"))
        finally:
            with_l3.close()
        if self.remote is None:
            rows.append(self.not_run("remote", "no server given (--remote-url)"))
        else:
            other = self.open(self.settings(work / "l3-remote", remote=True))
            try:
                rows.append(self.row("remote", other, 5, "a new instance, empty L3"))
            finally:
                other.close()
        key, pub, out = work / "bundle.pem", work / "bundle.pub.pem", work / "doc.skb"
        generate_keypair(key, pub)
        source = DiskTier(self.settings(first).l3, close_at_exit=False)
        try:
            metas = [m for m in source.point_metas() if m.n_tokens <= DOC_TOKENS]
            deepest = max(metas, key=lambda m: m.n_tokens)
            exported = export_points(source, deepest.key.hex(), out, key)
        finally:
            source.close()
        target = DiskTier(self.settings(work / "l3-bundle").l3, close_at_exit=False)
        try:
            import_points(target, read_point_bundle(out, read_signed(out, load_trust(pub))))
        finally:
            target.close()
        imported = self.open(self.settings(work / "l3-bundle"))
        try:
            note = f"points at {exported.tokens} tokens, {exported.bytes} bytes"
            rows.append(self.row("bundle", imported, 6, note))
        finally:
            imported.close()
        return rows


def run_families(
    families: Sequence[Family],
    work: Path,
    *,
    threads: int = 1,
    remote: tuple[str, Path] | None = None,
    say: Say = print,
) -> dict[str, Any]:
    """The family rows of every family in ``families`` (see the module docstring); a family
    whose run fails is reported with its error and the others still run."""
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    for family in families:
        say(f"-- family {family.name}: {family.memory}")
        try:
            run = _Run(family, work / "families", threads, remote)
        except Exception as exc:
            errors.append({"family": family.name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        try:
            for row in run.rows():
                rows.append(row.to_dict())
                ratio = "-" if row.ttft_ratio is None else f"{row.ttft_ratio:.3f}"
                say(
                    f"   {row.tier}: served {row.served} ({row.cached_tokens}/"
                    f"{row.prompt_tokens} tokens), exact {row.exact}, TTFT {ratio}x cold"
                )
        except Exception as exc:
            errors.append({"family": family.name, "error": f"{type(exc).__name__}: {exc}"})
            say(f"!! family {family.name} failed: {exc}")
        finally:
            run.close()
    return {
        "doc_tokens": DOC_TOKENS,
        "question_tokens": QUESTION_TOKENS,
        "answer_tokens": ANSWER_TOKENS,
        "n_ctx": N_CTX,
        "threads": threads,
        "remote": remote is not None,
        "load": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "rows": rows,
        "errors": errors,
    }
