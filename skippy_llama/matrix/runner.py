"""Runs the matrix: per backend and K/V type, every workload through a cold plain ``Llama`` and
one ``SkippyLlama`` per tier, request by request, so every ratio compares runs made seconds apart.

For each request the cold baseline goes first (its greedy reply becomes the chat history every
side sees), then the tier instances in an order that rotates from request to request.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import L1Settings, Settings
from ..packages.kvdtype import resolve_kv_dtype
from ..runtime.baseline import ColdLlama, PlainLlama
from ..runtime.llama import SkippyLlama
from ..workload import SYSTEM_PROMPT
from . import workloads
from .config import Backend, KVName, MatrixConfig, TierName, Workload
from .store import StoreStats, store_stats
from .timed import Timing, timed

Say = Callable[[str], None]

TimedCold = timed(ColdLlama)
TimedSkippy = timed(SkippyLlama)
TimedPlain = timed(PlainLlama)


@dataclass
class Answer:
    """One side's answer to one request."""

    text: str
    ttft_ms: float
    request_ms: float
    token_ms: list[float]
    prompt_tokens: int
    tier: str = "cold"
    cached_tokens: int = 0


@dataclass
class Cell:
    """One (backend, K/V, workload, tier) cell: the tier's answers beside the cold ones."""

    backend: str
    kv: KVName
    workload: Workload
    tier: TierName
    labels: list[str]
    phases: list[int]
    answers: list[Answer]
    cold: list[Answer]
    store: StoreStats
    #: pages and manifests left after ``kv-cache prune --target 0`` (l3) / ``clear`` (l2)
    emptied: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def llama_kwargs(cfg: MatrixConfig, backend: Backend, kv: KVName) -> dict[str, Any]:
    """The ``Llama`` arguments every side of a (backend, K/V) group shares."""
    resolution = resolve_kv_dtype(
        user_k=kv, user_v=kv, publisher=None, publisher_unavailable="matrix --kv"
    )
    kwargs: dict[str, Any] = {
        "n_ctx": cfg.n_ctx,
        "n_batch": cfg.n_batch,
        "n_ubatch": cfg.n_batch,
        "seed": 1,
        "verbose": False,
        **resolution.llama_kwargs(),
        **backend.llama_kwargs,
    }
    kwargs["flash_attn"] = cfg.flash_attn == "on" or (
        cfg.flash_attn == "auto" and resolution.needs_flash_attn
    )
    if cfg.threads:
        kwargs.update(n_threads=cfg.threads, n_threads_batch=cfg.threads)
    return kwargs


def tier_settings(
    cfg: MatrixConfig,
    tier: TierName,
    directory: Path | None,
    *,
    minimum_free: str = "1GiB",
    cross_backend: bool = False,
) -> Settings:
    """Settings that turn on exactly ``tier`` (see ``config.TIER_DESCRIPTIONS``)."""
    if tier == "l1":
        return Settings(page_tokens=cfg.page_tokens, l1={"enabled": True}, l3={"mode": "off"})  # type: ignore[call-arg]
    assert directory is not None
    l3 = {
        "mode": "fixed",
        "budget": "2GiB",
        "directory": str(directory),
        "minimum_free": minimum_free,
    }
    l2 = {"budget": "512MiB"} if tier == "l2" else {}
    return Settings(
        page_tokens=cfg.page_tokens,
        cross_backend=cross_backend,
        l1={"enabled": False},
        l2=l2,
        l3=l3,
    )  # type: ignore[call-arg]


def ask(
    llm: Any,
    request: workloads.MatrixRequest,
    history: Sequence[dict[str, str]],
    max_tokens: int,
) -> Answer:
    """Run one request greedily on ``llm`` (a timed instance) and collect its answer."""
    started = time.perf_counter()
    if request.prompt is not None:
        out = llm.create_completion(request.prompt, max_tokens=max_tokens, temperature=0.0)
        text = str(out["choices"][0]["text"])
    else:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            *history,
            {"role": "user", "content": request.user or ""},
        ]
        out = llm.create_chat_completion(messages=messages, max_tokens=max_tokens, temperature=0.0)
        text = str(out["choices"][0]["message"]["content"] or "")
    request_ms = (time.perf_counter() - started) * 1e3
    timing: Timing = llm.matrix_timing or Timing()
    answer = Answer(
        text=text,
        ttft_ms=round(timing.ttft_ms, 3),
        request_ms=round(request_ms, 3),
        token_ms=[round(t, 3) for t in timing.token_ms],
        prompt_tokens=timing.prompt_tokens,
    )
    event = getattr(llm, "last_cache_event", None)
    if isinstance(llm, SkippyLlama) and event is not None:
        answer.tier = event.tier
        answer.cached_tokens = event.cached_tokens
    return answer


class GroupRunner:
    """Runs every workload of one (backend, K/V type) group; see the module docstring."""

    def __init__(
        self, cfg: MatrixConfig, model: str, backend: Backend, kv: KVName, work: Path, say: Say
    ) -> None:
        self.cfg, self.model, self.backend, self.kv = cfg, model, backend, kv
        self.work, self.say = work, say
        self.kwargs = llama_kwargs(cfg, backend, kv)
        self.cold = TimedCold(model, **self.kwargs)
        #: cold answers by prompt key, for the gate runs that repeat workload prompts
        self.cold_by_prompt: dict[str, Answer] = {}

    def close(self) -> None:
        self.cold.close()

    def _skippy(self, settings: Settings) -> Any:
        return TimedSkippy(self.model, cache_settings=settings, **self.kwargs)

    def _dir(self, *parts: str) -> Path:
        path = self.work.joinpath(self.backend.name, self.kv, *parts)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True, mode=0o700)
        return path

    def run_workload(self, workload: Workload) -> list[Cell]:
        """One workload through the cold baseline and every tier, side by side."""
        cfg = self.cfg
        requests = workloads.build(workload, cfg)
        dirs = {t: (self._dir(workload, t) if t != "l1" else None) for t in cfg.tiers}
        settings = {t: tier_settings(cfg, t, dirs[t]) for t in cfg.tiers}
        llms = {t: self._skippy(settings[t]) for t in cfg.tiers}
        answers: dict[TierName, list[Answer]] = {t: [] for t in cfg.tiers}
        cold: list[Answer] = []
        histories: dict[str, list[dict[str, str]]] = {}
        phase = 1
        try:
            for i, req in enumerate(requests):
                if req.phase != phase:
                    # the restart: fresh instances find only what L3 (and nothing else) kept
                    for t in cfg.tiers:
                        llms[t].close()
                        llms[t] = self._skippy(settings[t])
                    phase = req.phase
                history = histories.setdefault(req.chat or "", [])
                ref = ask(self.cold, req, history, cfg.max_tokens)
                cold.append(ref)
                if req.prompt is not None:
                    self.cold_by_prompt[req.prompt] = ref
                order = list(cfg.tiers[i % len(cfg.tiers) :] + cfg.tiers[: i % len(cfg.tiers)])
                for t in order:
                    answers[t].append(ask(llms[t], req, history, cfg.max_tokens))
                self.say(
                    f"   {req.label}: cold {ref.ttft_ms:.0f} ms; "
                    + ", ".join(
                        f"{t} {answers[t][-1].ttft_ms:.0f} ms ({answers[t][-1].tier})"
                        for t in cfg.tiers
                    )
                )
                if req.chat is not None:
                    history.extend(
                        [
                            {"role": "user", "content": req.user or ""},
                            {"role": "assistant", "content": ref.text},
                        ]
                    )
            stats = {t: store_stats(llms[t]) for t in cfg.tiers}
        finally:
            for llm in llms.values():
                llm.close()
        cells = []
        for t in cfg.tiers:
            cell = Cell(
                backend=self.backend.name,
                kv=self.kv,
                workload=workload,
                tier=t,
                labels=[r.label for r in requests],
                phases=[r.phase for r in requests],
                answers=answers[t],
                cold=cold,
                store=stats[t],
            )
            directory = dirs[t]
            if directory is not None:
                from .store import empty_store

                cell.emptied = empty_store(settings[t], "clear" if t == "l2" else "prune")
            cells.append(cell)
        return cells

    def low_space(self) -> dict[str, Any]:
        """An L3 store whose free-space floor is above the free space: requests are served
        (and equal cold), nothing is written."""
        from .store import floor_above_free

        directory = self._dir("low-space")
        floor = floor_above_free(directory)
        settings = tier_settings(self.cfg, "l3", directory, minimum_free=floor)
        requests = workloads.documents(self.cfg)[:1]
        llm = self._skippy(settings)
        try:
            same = []
            for req in requests:
                ref = self.cold_by_prompt.get(req.prompt or "") or ask(
                    self.cold, req, [], self.cfg.max_tokens
                )
                same.append(ask(llm, req, [], self.cfg.max_tokens).text == ref.text)
            stats = store_stats(llm)
        finally:
            llm.close()
        return {
            "minimum_free": floor,
            "requests": len(requests),
            "outputs_equal_cold": all(same),
            "state": stats.state,
            "writes": stats.writes,
            "bytes_written": stats.bytes_written,
            "dropped_low_space": stats.dropped_low_space,
            "pass": stats.writes == 0 and stats.bytes_written == 0 and all(same),
        }

    def noreuse(self) -> list[dict[str, Any]]:
        """Distinct one-shot prompts: SkippyLlama (defaults; and with L3) against plain Llama."""
        cfg = self.cfg
        requests = workloads.noreuse(cfg)
        modes: dict[str, Any] = {
            "plain": TimedPlain(self.model, **self.kwargs),
            # SkippyLlama's defaults (L1 on), stated so that SKIPPY_* variables cannot change them
            "skippy": self._skippy(tier_settings(cfg, "l1", None)),
            "skippy_l3": self._skippy(
                tier_settings(cfg, "l3", self._dir("noreuse")).model_copy(
                    update={"l1": L1Settings()}
                )
            ),
        }
        out: dict[str, list[Answer]] = {m: [] for m in modes}
        names = list(modes)
        try:
            for i, req in enumerate(requests):
                for m in names[i % len(names) :] + names[: i % len(names)]:
                    out[m].append(ask(modes[m], req, [], cfg.max_tokens))
                    self.say(f"    noreuse {req.label} {m}: {out[m][-1].ttft_ms:.0f} ms")
        finally:
            for llm in modes.values():
                llm.close()
        return [
            {
                "backend": self.backend.name,
                "kv": self.kv,
                "mode": m,
                "labels": [r.label for r in requests],
                "answers": [asdict(a) for a in out[m]],
                "plain": [asdict(a) for a in out["plain"]],
            }
            for m in names
        ]
