"""GPU figures: restore vs cold prefill per tier, exactness, capture cost, and a linear chat.

Runs on any build (CPU too, slowly); meant for the lent H200 with the 1.1B F16 model that
``../shared/gpu/make_model.py`` writes. For each prefix length N it measures, beside plain
``llama_cpp.Llama``'s one-shot prefill of the same N + 64 tokens (the cold time):

- L1: the prefix checkpointed in the live context, restored, then the 64-token suffix;
- L3: a second model object reading the pages the first recorded (page cache warm), twice:
  the first restore of a fresh process (reported), then one with its buffers reused (``runs``);
  ``l3`` as the runtime does by default (pages copied per layer where the roster certifies
  ``layer_copy_exact``: through the staging arenas on a device, from their bytes on the CPU;
  else chunked blob imports), ``l3_one_import`` the same pages assembled into one blob and
  imported whole (the path before issue 45);
- L2: a third object with L1 off, its later requests served from the RAM mirror: ``l2`` as
  the runtime does by default (from the host arena by per-layer copies where the roster
  certifies ``layer_copy_exact``, patch 0006; ``arena`` says whether it did), ``l2_blob`` with
  the arena detached (pages kept as bytes, assembled into one blob and imported, the path before
  issue 45), and ``l2_chunked`` (``l2_blob`` in chunks, ``KVSeam.chunk_ram_restores``); every
  restore run gives its rate (``restore_gbps``: K/V bytes restored over the restore's time);

with the max |Δ| of the last logits against the cold run (canonical batching makes it 0), the
time of the L3 record after a request (``record_s``: on the request path; nothing where records
wait, as on GPU builds) and of the waiting record when it is made (``waiting_record_s``). ``--chat`` adds a linear raw-text chat (turns of
``--turn`` new tokens, 48-token greedy replies; ``--chat 8192 32000`` for several lengths) for
plain Llama, SkippyLlama defaults and SkippyLlama with L3 on (``--chat-modes``), in one process,
``--rounds`` interleaved rounds: total and last-turn time over plain's, the time spent in
SkippyLlama's steps, the tokens each decoded in batches (exactness decodes a reply again, and
on GPU builds the cells since the last ``n_ubatch`` boundary: ``prefilled_over_plain``), and
whether replies agree. Each restore run also says where its time went (``phases_ms``).
``--oneshot 2048`` adds the overhead where nothing can be reused (8 unrelated prompts).

Every restore is printed and recorded as GB/s (``restore_gbps``) beside the bus's rate measured
in the same run by the runtime's load-time probe (``bus_gbps``, ``of_bus``; the probe's method
and rates are the report's ``bus``, ``skippy_llama/runtime/bus.py``), with the planner's
decision (``planned``: the tier, its expected and the cold estimate). ``l3_first_process`` is
the first L3 restore of a fresh process (a subprocess on a copy of the store, its kernels
warmed by one unrelated prompt): issue 45 wants it never slower than cold. On GPU builds the
L3 arms restore through the staging arenas (``KVSeam.staging``) where the roster certifies
``layer_copy_exact``; ``--staged`` takes that path on the CPU too (to prove it there).

    python benchmarks/bench_gpu.py MODEL.gguf --sizes 2048 8192 32000 --chat 8192 \
        --oneshot 2048 --out benchmarks/results/gpu.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from record_paths import BEFORE_MODE, ParksAsBefore, capture_as_before

from skippy_llama import hostmem
from skippy_llama.config import Settings
from skippy_llama.runtime import native, seam
from skippy_llama.runtime.llama import SkippyLlama

sys.path.insert(0, str(Path(__file__).resolve().parent))

from restore_common import (
    gbps,
    last_logits,
    report_head,
    spread,
    timed_eval,
    timed_phases,
    timed_request,
    wrap_timed,
)

SUFFIX = 64
#: L2's budget in the L2 arms: room for a 32k-token prefix of the 1.1B F16 model (700 MB) with
#: its host arena small enough to be page-locked at load (``arena_setup.PIN_ARENA_MAX_BYTES``)
L2_BUDGET = "4GiB"


def _bus(llm: SkippyLlama) -> dict[str, Any] | None:
    """The runtime's load-time bus probe as this model got it (kept per process)."""
    return llm.bus.to_json() if llm.bus is not None else None


def _record_plans(llm: SkippyLlama) -> list[Any]:
    """Keep every plan ``llm``'s cache hands the runtime (an instance attribute wraps it)."""
    plans: list[Any] = []
    cache = llm.prefix_cache
    original = cache.plan

    def plan(*args: Any, **kwargs: Any) -> Any:
        made = original(*args, **kwargs)
        plans.append(made)
        return made

    cache.plan = plan  # type: ignore[method-assign]
    return plans


def _planned(plans: list[Any]) -> dict[str, Any] | None:
    """The request's first plan (a fallback plans again): what the planner chose and why."""
    if not plans:
        return None
    plan = plans[0]

    def ms(seconds: float | None) -> float | None:
        return round(seconds * 1e3, 2) if seconds is not None else None

    return {
        "tier": plan.tier,
        "n_tokens": plan.n_tokens,
        "expected_ms": ms(plan.expected_s),
        "cold_ms": ms(plan.cold_s),
        "skipped": list(plan.skipped),
    }


def _beside_bus(run: dict[str, Any], bus_gbps: float | None) -> None:
    """Put the bus's rate of the same run beside a restore's, and their ratio."""
    rate = run.get("restore_gbps")
    run["bus_gbps"] = bus_gbps
    run["of_bus"] = round(rate / bus_gbps, 4) if rate and bus_gbps else None


def _print_restore(n: int, tier: str, i: int, run: dict[str, Any]) -> None:
    """One restore as a line: its GB/s beside the bus's, and against the cold prefill."""
    print(
        f"restore n={n} {tier}[{i}]: tier={run['tier']} cached={run['cached']} "
        f"restore={run['restore_ms']} ms {run['restore_gbps']} GB/s "
        f"(bus {run['bus_gbps']} GB/s, of_bus {run['of_bus']}) "
        f"warm/cold={run['warm_over_cold']} planned={run['planned']}",
        flush=True,
    )


def _settings(store: Path, *, l1: bool = True, l2: str | None = None) -> Settings:
    return Settings(
        l1={"enabled": l1},
        l2={"budget": l2},
        l3={"mode": "fixed", "budget": "64GiB", "directory": str(store), "minimum_free": "1GiB"},
    )


def bench_size(
    model: str, n: int, common: dict[str, Any], rng: np.random.Generator, staged: bool = False
) -> dict[str, Any]:
    plain = llama_cpp.Llama(model, **common)
    vocab = plain.n_vocab()
    base = [int(t) for t in rng.integers(100, vocab - 100, n)]
    query = base + [int(t) for t in rng.integers(100, vocab - 100, SUFFIX)]
    other = [int(t) for t in rng.integers(100, vocab - 100, 256)]
    cold_s = min(timed_eval(plain, query) for _ in range(2))
    cold = last_logits(plain)
    plain.close()
    row: dict[str, Any] = {"tokens": n, "cold_s": round(cold_s, 4)}
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        recorder = SkippyLlama(model, cache_settings=_settings(store, l1=False), **common)
        row["bus"] = bus = _bus(recorder)
        bus_gbps = bus["gb_per_s"] if bus else None
        record_s: list[float] = []
        original = recorder.recorder.after_request

        def timed_record(event: Any) -> None:
            started = time.perf_counter()
            original(event)
            record_s.append(time.perf_counter() - started)

        recorder.recorder.after_request = timed_record  # type: ignore[method-assign]
        # an earlier question about the same document: L3 gets the document's every granule
        # (a record stops two tokens short of its prompt, so the document alone would leave
        # its last granule out and the restores below would prefill it with the suffix)
        recorder.eval(base + other[:SUFFIX])
        # a GPU build's record waits (off the request path): made here, as idle time or
        # close() would make it
        started = time.perf_counter()
        recorder.recorder.flush()
        waited_s = time.perf_counter() - started
        recorder.close()
        sk = SkippyLlama(model, cache_settings=Settings(), **common)
        sk.eval(base)
        sk.eval(other)  # leaves the prefix: it is checkpointed
        warm_s = timed_eval(sk, query)
        event = sk.last_cache_event
        row["l1"] = {
            "warm_over_cold": round(warm_s / cold_s, 4),
            "cached": event.cached_tokens if event else 0,
            "tier": event.tier if event else None,
            "max_abs_dlogit": float(np.abs(last_logits(sk) - cold).max()),
        }
        row["record_s"] = round(record_s[0], 4) if record_s else None
        row["record_over_cold"] = round(record_s[0] / cold_s, 4) if record_s else None
        row["waiting_record_s"] = round(waited_s, 4)
        sk.close()
        tiers: list[tuple[str, dict[str, Any]]] = [
            ("l3", {"l1": False}),
            ("l3_one_import", {"l1": False}),
            ("l2", {"l1": False, "l2": L2_BUDGET}),
            ("l2_blob", {"l1": False, "l2": L2_BUDGET}),
            ("l2_chunked", {"l1": False, "l2": L2_BUDGET}),
        ]
        # each L3 reader records its own query's pages: the one-import reader gets a copy of
        # the store as the recorder left it, so both restore the same prefix
        twin = Path(tmp) / "twin"
        shutil.copytree(store, twin)
        # the first restore of a fresh process reads its own copy too (written now: in the
        # page cache, as the others are)
        first = Path(tmp) / "first"
        shutil.copytree(store, first)
        for tier, kwargs in tiers:
            where = twin if tier == "l3_one_import" else store
            llm = SkippyLlama(model, cache_settings=_settings(where, **kwargs), **common)
            # l3: chunked (GPU builds' default; forced here on any build); l3_one_import: the
            # same restore read whole, then imported whole
            llm.pipeline_restores = tier != "l3_one_import"
            if tier in ("l3_one_import", "l2_blob", "l2_chunked"):
                # the paths before issue 45: pages assembled into a state blob and imported
                # (no per-layer copies from page bytes or staging arenas)
                llm.seam.page_copies = False
            # l2: one blob (the default); l2_chunked: in chunks like a restore that reads L3
            llm.seam.chunk_ram_restores = tier == "l2_chunked"
            ram = llm.prefix_cache.ram
            if tier in ("l2_blob", "l2_chunked") and ram is not None:
                # the path before issue 45: L2 keeps page bytes, a restore assembles a blob
                ram.detach_arena()
                llm.seam.layer_copies = False
            # L3: the first restore of a fresh process (a restart: its buffers are new), then a
            # second one (buffers reused); L2 promotes on a second fill (at once from 4,096
            # tokens): its last runs read it, the last one reported (buffers settled)
            runs = []
            phases = timed_phases(llm)
            plans = _record_plans(llm)
            for i in range(2 if tier.startswith("l3") else 4):
                plans.clear()
                run = timed_request(llm, query, cold, cold_s, phases)[0]
                _beside_bus(run, bus_gbps)
                run["planned"] = _planned(plans)
                runs.append(run)
                _print_restore(n, tier, i, run)
            row[tier] = {**runs[0 if tier.startswith("l3") else -1], "runs": runs}
            row[tier]["pinned"] = llm.cache_status()["pinned_host_buffers"]
            if tier.startswith("l3"):
                # where L3's pages went: per-layer copies (through the staging arenas on a
                # device) or an assembled blob, and why not copies
                row[tier]["page_copies"] = llm.seam.page_copies
                row[tier]["staged"] = llm.seam.staging is not None
                row[tier]["page_copy_refusal"] = llm.page_copy_refusal
            if tier.startswith("l2"):
                row[tier]["arena"] = llm.seam.layer_copies
                row[tier]["arena_refusal"] = llm.arena_refusal
                row[tier]["arena_pinned"] = ram.arena_pinned if ram is not None else False
            llm.close()
        fresh = _first_process(model, first, query, common, staged)
        if fresh is not None:
            fresh["warm_over_cold"] = round(fresh.pop("seconds") / cold_s, 4)
            fresh["max_abs_dlogit"] = float(np.abs(np.array(fresh.pop("logits")) - cold).max())
            _beside_bus(fresh, (fresh["bus"] or {}).get("gb_per_s"))
            _print_restore(n, "l3_first_process", 0, fresh)
        row["l3_first_process"] = fresh
    return row


def _first_process(
    model: str, store: Path, query: list[int], common: dict[str, Any], staged: bool
) -> dict[str, Any] | None:
    """The first L3 restore of a fresh process (``--first-restore``), run in a subprocess on
    ``store``; None when it failed (its output is printed)."""
    spec = store.parent / "first.json"
    spec.write_text(json.dumps({"store": str(store), "query": query, "common": common}))
    cmd = [sys.executable, __file__, model, "--first-restore", str(spec)]
    if staged:
        cmd.append("--staged")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        print(done.stdout[-4000:], done.stderr[-4000:], flush=True)
        return None
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def first_restore(model: str, spec_path: Path) -> dict[str, Any]:
    """In a fresh process: load SkippyLlama on the spec's store (L1 off), warm the kernels with
    one unrelated prompt (its record made at once, off the timed request), then time the
    query, whose prefix L3 holds: the process's first L3 restore, as the planner chose it."""
    spec = json.loads(spec_path.read_text())
    common = spec["common"]
    query = spec["query"]
    llm = SkippyLlama(model, cache_settings=_settings(Path(spec["store"]), l1=False), **common)
    try:
        rng = np.random.default_rng(99)
        warm = [int(t) for t in rng.integers(100, llm.n_vocab() - 100, 256)]
        timed_eval(llm, warm)
        llm.recorder.flush()
        plans = _record_plans(llm)
        phases = timed_phases(llm)
        seconds = timed_eval(llm, query)
        event = llm.last_cache_event
        return {
            "seconds": seconds,
            "cached": event.cached_tokens if event else 0,
            "tier": event.tier if event else None,
            "restore_ms": round(event.restore_ms, 2) if event else None,
            "restore_gbps": gbps(event),
            "planned": _planned(plans),
            "phases_ms": {k: round(v * 1e3, 2) for k, v in phases.items()},
            "bus": _bus(llm),
            "page_copies": llm.seam.page_copies,
            "staged": llm.seam.staging is not None,
            "logits": last_logits(llm).tolist(),
        }
    finally:
        llm.close()


#: SkippyLlama steps timed in the chat (inclusive wall time, summed over the chat): where its
#: extra time over plain ``Llama`` goes
CHAT_STEPS = ("execute", "park", "after_request", "capture", "flush")
#: where each step lives: the seam, the runtime or its recorder
_STEP_OWNER = {
    "execute": "seam",
    "park": "seam",
    "capture": "seam",
    "after_request": "recorder",
    "flush": "recorder",
}


def _timed_steps(llm: SkippyLlama) -> dict[str, float]:
    """Wrap ``llm``'s steps (instance attributes) to sum their wall time into the result."""
    return wrap_timed(
        {
            name: (getattr(llm, _STEP_OWNER[name]) if name in _STEP_OWNER else llm, name)
            for name in CHAT_STEPS
        }
    )


class _DecodeCounter:
    """Tokens each model object hands ``llama_decode``: in batches (prefills, a reply decoded
    again) and alone (generated tokens). Counted at ``LlamaContext.decode``, the one call
    ``Llama.eval`` and SkippyLlama's decodes go through, so plain and SkippyLlama are counted
    alike: the difference is the tokens exactness makes SkippyLlama decode again."""

    def __init__(self) -> None:
        self.batched: dict[int, int] = {}
        self._original = llama_cpp._internals.LlamaContext.decode
        counts = self.batched
        original = self._original

        def decode(ctx: Any, batch: Any) -> Any:
            n = int(batch.n_tokens())
            if n > 1:
                counts[id(ctx)] = counts.get(id(ctx), 0) + n
            return original(ctx, batch)

        llama_cpp._internals.LlamaContext.decode = decode  # type: ignore[method-assign, assignment]

    def batched_tokens(self, llm: llama_cpp.Llama) -> int:
        return self.batched.get(id(llm._ctx), 0)

    def close(self) -> None:
        llama_cpp._internals.LlamaContext.decode = self._original  # type: ignore[method-assign]


def _chat_turns(n: int, turn: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    user_turns = []
    total = 0
    while total + turn + 48 < n:
        user_turns.append([int(t) for t in rng.integers(100, 30000, turn)])
        total += turn + 48
    return user_turns


def _chat_round(make: Any, user_turns: list[list[int]]) -> tuple[dict[str, Any], list[list[int]]]:
    llm = make()
    spent = _timed_steps(llm) if isinstance(llm, SkippyLlama) else None
    counter = _DecodeCounter()
    history: list[int] = []
    times = []
    prefilled = []
    got = []
    try:
        for user in user_turns:
            history = history + user
            before = counter.batched_tokens(llm)
            started = time.perf_counter()
            res = llm.create_completion(history, max_tokens=48, temperature=0.0)
            times.append(time.perf_counter() - started)
            prefilled.append(counter.batched_tokens(llm) - before)
            reply = llm.tokenize(res["choices"][0]["text"].encode(), add_bos=False)
            got.append(reply)
            history = history + reply
    finally:
        counter.close()
    started = time.perf_counter()
    llm.close()
    row: dict[str, Any] = {
        "total_s": round(sum(times), 4),
        "last_turn_s": round(times[-1], 4),
        "close_s": round(time.perf_counter() - started, 4),
        "turn_s": [round(t, 4) for t in times],
        # tokens decoded in batches per turn (the prompt's new tokens, plus what exactness
        # decodes again: the previous reply and the cells since the last n_ubatch boundary)
        "prefilled_tokens": sum(prefilled),
        "last_turn_prefilled": prefilled[-1],
    }
    if spent is not None:
        row["steps_s"] = {k: round(v, 4) for k, v in spent.items()}
    return row, got


def _makers(model: str, common: dict[str, Any], tmp: str) -> dict[str, Any]:
    """A fresh model object per call, by mode: plain ``Llama``, SkippyLlama's defaults, and
    SkippyLlama with L3 on (a fresh store under ``tmp`` each time) with its records left
    waiting as GPU builds do (``skippy_l3``), made after every request (``_eager``) or with
    pageable host buffers (``_pageable``)."""

    def with_l3(defer: bool, pin: bool = True) -> Any:
        def make() -> SkippyLlama:
            store = Path(tempfile.mkdtemp(dir=tmp))
            settings = _settings(store).model_copy(update={"pin_host_buffers": pin})
            llm = SkippyLlama(model, cache_settings=settings, **common)
            if not defer:
                llm.defer_record_tokens = 0
            return llm

        return make

    def before() -> SkippyLlama:
        store = Path(tempfile.mkdtemp(dir=tmp))
        llm = SkippyLlama(
            model, cache_settings=_settings(store), cost_model=ParksAsBefore(), **common
        )
        return capture_as_before(llm)

    return {
        "plain": lambda: llama_cpp.Llama(model, **common),
        "skippy": lambda: SkippyLlama(model, cache_settings=Settings(), **common),
        BEFORE_MODE: before,
        "skippy_l3": with_l3(True),
        "skippy_l3_eager": with_l3(False),
        "skippy_l3_pageable": with_l3(True, pin=False),
    }


def bench_chat(
    model: str, n: int, turn: int, common: dict[str, Any], rounds: int, names: list[str]
) -> dict[str, Any]:
    """A linear raw-text chat up to ``n`` tokens, every mode on a fresh model object per round;
    rounds interleave the modes in an order rotated by the round, so drift of the machine's
    speed between minutes does not decide a ratio. Ratios: per round, a mode's total (and last
    turn) over plain's of the same round; the median over rounds, with min and max."""
    user_turns = _chat_turns(n, turn)
    out: dict[str, Any] = {"turns": len(user_turns), "tokens": n, "rounds": rounds}
    with tempfile.TemporaryDirectory() as tmp:
        makers = _makers(model, common, tmp)
        modes = ["plain", *[m for m in names if m != "plain"]]
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        replies: dict[str, list[list[list[int]]]] = {m: [] for m in modes}
        for r in range(rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for name in order:
                row, got = _chat_round(makers[name], user_turns)
                runs[name].append(row)
                replies[name].append(got)
                print(json.dumps({"n": n, "round": r, "mode": name, **row}), flush=True)
    for name in modes:
        rows = runs[name]
        summary: dict[str, Any] = {"runs": rows}
        if name != "plain":
            for key, label in (("total_s", "total_over_plain"), ("last_turn_s", "last_over_plain")):
                summary[label] = spread(
                    [row[key] / base[key] for row, base in zip(rows, runs["plain"], strict=True)]
                )
            summary["prefilled_over_plain"] = round(
                rows[0]["prefilled_tokens"] / runs["plain"][0]["prefilled_tokens"], 4
            )
            summary["replies_equal_plain"] = all(g == replies["plain"][0] for g in replies[name])
        # every round of a mode must answer alike (each starts from a fresh object)
        summary["replies_stable"] = all(g == replies[name][0] for g in replies[name])
        out[name] = summary
    return out


def bench_oneshot(
    model: str,
    length: int,
    prompts: int,
    common: dict[str, Any],
    rounds: int,
    names: tuple[str, ...] = ("skippy", "skippy_l3"),
) -> dict[str, Any]:
    """The overhead where nothing can be reused: ``prompts`` unrelated prompts of ``length``
    tokens, 16 greedy tokens each, on one model object per mode and round (plain ``Llama``,
    then ``names``: SkippyLlama's defaults, SkippyLlama with L3 on: every prompt is recorded,
    none is read; ``skippy_l3_before``: L3 on with the record path and park rule before issue
    45 item 4, ``record_paths.py``). Ratios: per round, a mode's total over plain's; the median
    over rounds, with min and max."""
    rng = np.random.default_rng(11)
    work = [[int(t) for t in rng.integers(100, 30000, length)] for _ in range(prompts)]
    out: dict[str, Any] = {"tokens": length, "prompts": prompts, "rounds": rounds}
    with tempfile.TemporaryDirectory() as tmp:
        makers = _makers(model, common, tmp)
        modes = ["plain", *[m for m in names if m != "plain"]]
        totals: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(rounds):
            shift = r % len(modes)
            for name in modes[shift:] + modes[:shift]:
                llm = makers[name]()
                started = time.perf_counter()
                for prompt in work:
                    llm.create_completion(prompt, max_tokens=16, temperature=0.0)
                totals[name].append(time.perf_counter() - started)
                llm.close()
                print(
                    json.dumps(
                        {
                            "oneshot": length,
                            "round": r,
                            "mode": name,
                            "total_s": round(totals[name][-1], 4),
                        }
                    ),
                    flush=True,
                )
    for name in modes[1:]:
        out[name] = {
            "total_over_plain": spread(
                [a / b for a, b in zip(totals[name], totals["plain"], strict=True)]
            ),
            "total_s": [round(t, 4) for t in totals[name]],
        }
    out["plain"] = {"total_s": [round(t, 4) for t in totals["plain"]]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--sizes", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument(
        "--chat", type=int, nargs="*", default=[], help="linear chats up to these many tokens"
    )
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds per chat")
    parser.add_argument(
        "--chat-modes",
        default="skippy,skippy_l3",
        help="comma-separated, beside plain: skippy, skippy_l3 (records left waiting as shipped "
        "on GPU builds), skippy_l3_eager (records made after every request), skippy_l3_pageable "
        "(skippy_l3 with pin_host_buffers off)",
    )
    parser.add_argument("--turn", type=int, default=600, help="new tokens per chat turn")
    parser.add_argument(
        "--oneshot",
        type=int,
        nargs="*",
        default=[],
        help="prompt lengths of the nothing-to-reuse workload (8 unrelated prompts each)",
    )
    parser.add_argument(
        "--oneshot-modes",
        default="skippy,skippy_l3",
        help="comma-separated, beside plain: skippy, skippy_l3, skippy_l3_before (the record "
        "path and park rule before issue 45 item 4: a same-run baseline)",
    )
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--flash-attn", type=int, default=1)
    parser.add_argument(
        "--n-ubatch",
        type=int,
        default=None,
        help="llama.cpp's n_ubatch for every model (default: its own, 512); on GPU builds cached "
        "prefixes end on its multiples, so it sets how much a chat turn decodes again",
    )
    parser.add_argument(
        "--buffers",
        choices=["default", "bytearray", "huge"],
        default="default",
        help="host buffers for KV bytes, to compare: the runtime's (lazily zeroed mappings), "
        "plain bytearrays, or mappings with transparent huge pages",
    )
    parser.add_argument(
        "--chunk-mib",
        type=int,
        default=None,
        help="state per chunk of a pipelined restore (default: the runtime's PIPELINE_BYTES, 64)",
    )
    parser.add_argument(
        "--staged",
        action="store_true",
        help="set up every SkippyLlama's page paths as where the KV cache is on a device (L3 "
        "pages through the staging arenas), also on the CPU: proves that path there",
    )
    parser.add_argument(
        "--first-restore",
        type=Path,
        default=None,
        help=argparse.SUPPRESS,  # internal: the l3_first_process subprocess
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.staged:
        _force_staging()
    if args.first_restore is not None:
        print(json.dumps(first_restore(args.model, args.first_restore)), flush=True)
        return
    if args.chunk_mib:
        seam.PIPELINE_BYTES = args.chunk_mib << 20
    if args.buffers == "bytearray":
        hostmem.MAPPED_BYTES = 1 << 62
    elif args.buffers == "huge":
        hostmem.HUGE_PAGES = True
    n_ctx = max([*args.sizes, *args.chat, *args.oneshot]) + 1024
    common = {
        "n_ctx": n_ctx,
        "n_gpu_layers": args.n_gpu_layers,
        "flash_attn": bool(args.flash_attn),
        "verbose": False,
    }
    if args.n_ubatch:
        common["n_ubatch"] = args.n_ubatch
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {
        **report_head(),
        "devices": native.device_names(),
        "settings": {k: v for k, v in common.items() if k != "verbose"},
        "buffers": args.buffers,
        "chunk_bytes": seam.PIPELINE_BYTES,
        "sizes": [],
    }
    for n in args.sizes:
        row = bench_size(args.model, n, common, rng, args.staged)
        report["bus"] = report.get("bus") or row.get("bus")
        print(json.dumps(row), flush=True)
        report["sizes"].append(row)
    names = args.chat_modes.split(",")
    report["chats"] = []
    for n in args.chat:
        chat = bench_chat(args.model, n, args.turn, common, args.rounds, names)
        print(json.dumps({k: v for k, v in chat.items() if not isinstance(v, dict)}), flush=True)
        for name in names:
            print(name, {k: v for k, v in chat[name].items() if k != "runs"}, flush=True)
        report["chats"].append(chat)
    report["oneshot"] = []
    for n in args.oneshot:
        modes = tuple(args.oneshot_modes.split(","))
        row = bench_oneshot(args.model, n, 8, common, max(args.rounds, 1), modes)
        print(
            "oneshot",
            n,
            {k: v.get("total_over_plain") for k, v in row.items() if isinstance(v, dict)},
            flush=True,
        )
        report["oneshot"].append(row)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def _force_staging() -> None:
    """``--staged``: every SkippyLlama opens its page paths with ``on_device=True``."""
    from skippy_llama.runtime import arena_setup
    from skippy_llama.runtime import llama as runtime

    real = arena_setup.open_page_paths

    def on_device(*args: Any, **kwargs: Any) -> arena_setup.PagePaths:
        kwargs["on_device"] = True
        return real(*args, **kwargs)

    setattr(runtime, "open_page_paths", on_device)  # noqa: B010 - not exported


if __name__ == "__main__":
    main()
