"""GPU figures: restore vs cold prefill per tier, exactness, capture cost, and a linear chat.

Runs on any build (CPU too, slowly); meant for the lent H200 with the 1.1B F16 model that
``../shared/gpu/make_model.py`` writes. For each prefix length N it measures, beside plain
``llama_cpp.Llama``'s one-shot prefill of the same N + 64 tokens (the cold time):

- L1: the prefix checkpointed in the live context, restored, then the 64-token suffix;
- L3: a second model object reading the pages the first recorded (page cache warm), twice:
  the first restore of a fresh process (reported), then one with its buffers reused (``runs``);
  ``l3`` chunked (``SkippyLlama.pipeline_restores``, where the append import is certified),
  ``l3_one_import`` the same restore read whole and imported whole;
- L2: a third object with L1 off, its second request served from the RAM mirror;

with the max |Δ| of the last logits against the cold run (canonical batching makes it 0), the
time of the L3 record after a request (``record_s``: on the request path; nothing where records
wait, as on GPU builds) and of the waiting record when it is made (``waiting_record_s``). ``--chat`` adds a linear raw-text chat (turns of
``--turn`` new tokens, 48-token greedy replies; ``--chat 8192 32000`` for several lengths) for
plain Llama, SkippyLlama defaults and SkippyLlama with L3 on (``--chat-modes``), in one process,
``--rounds`` interleaved rounds: total and last-turn time over plain's, the time spent in
SkippyLlama's steps, and whether replies agree.

    python benchmarks/bench_gpu.py MODEL.gguf --sizes 2048 8192 32000 --chat 8192 \
        --out benchmarks/results/gpu.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from skippy_llama import hostmem
from skippy_llama.config import Settings
from skippy_llama.runtime import native
from skippy_llama.runtime.llama import SkippyLlama

SUFFIX = 64


def _logits(llm: llama_cpp.Llama) -> np.ndarray[Any, Any]:
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def _timed_eval(llm: llama_cpp.Llama, tokens: list[int]) -> float:
    llm.reset()
    started = time.perf_counter()
    llm.eval(tokens)
    llama_cpp.llama_synchronize(llm.ctx)
    return time.perf_counter() - started


def _settings(store: Path, *, l1: bool = True, l2: str | None = None) -> Settings:
    return Settings(
        l1={"enabled": l1},
        l2={"budget": l2},
        l3={"mode": "fixed", "budget": "64GiB", "directory": str(store), "minimum_free": "1GiB"},
    )


def bench_size(
    model: str, n: int, common: dict[str, Any], rng: np.random.Generator
) -> dict[str, Any]:
    plain = llama_cpp.Llama(model, **common)
    vocab = plain.n_vocab()
    base = [int(t) for t in rng.integers(100, vocab - 100, n)]
    query = base + [int(t) for t in rng.integers(100, vocab - 100, SUFFIX)]
    other = [int(t) for t in rng.integers(100, vocab - 100, 256)]
    cold_s = min(_timed_eval(plain, query) for _ in range(2))
    cold = _logits(plain)
    plain.close()
    row: dict[str, Any] = {"tokens": n, "cold_s": round(cold_s, 4)}
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        recorder = SkippyLlama(model, cache_settings=_settings(store, l1=False), **common)
        record_s: list[float] = []
        original = recorder.recorder.after_request

        def timed_record(event: Any) -> None:
            started = time.perf_counter()
            original(event)
            record_s.append(time.perf_counter() - started)

        recorder.recorder.after_request = timed_record  # type: ignore[method-assign]
        recorder.eval(base)  # L3 gets the prefix (all but its last two tokens)
        # a GPU build's record waits (off the request path): made here, as idle time or
        # close() would make it
        started = time.perf_counter()
        recorder.recorder.flush()
        waited_s = time.perf_counter() - started
        recorder.close()
        sk = SkippyLlama(model, cache_settings=Settings(), **common)
        sk.eval(base)
        sk.eval(other)  # leaves the prefix: it is checkpointed
        warm_s = _timed_eval(sk, query)
        event = sk.last_cache_event
        row["l1"] = {
            "warm_over_cold": round(warm_s / cold_s, 4),
            "cached": event.cached_tokens if event else 0,
            "tier": event.tier if event else None,
            "max_abs_dlogit": float(np.abs(_logits(sk) - cold).max()),
        }
        row["record_s"] = round(record_s[0], 4) if record_s else None
        row["record_over_cold"] = round(record_s[0] / cold_s, 4) if record_s else None
        row["waiting_record_s"] = round(waited_s, 4)
        sk.close()
        tiers: list[tuple[str, dict[str, Any]]] = [
            ("l3", {"l1": False}),
            ("l3_one_import", {"l1": False}),
            ("l2", {"l1": False, "l2": "32GiB"}),
        ]
        # each L3 reader records its own query's pages: the one-import reader gets a copy of
        # the store as the recorder left it, so both restore the same prefix
        twin = Path(tmp) / "twin"
        shutil.copytree(store, twin)
        for tier, kwargs in tiers:
            where = twin if tier == "l3_one_import" else store
            llm = SkippyLlama(model, cache_settings=_settings(where, **kwargs), **common)
            # l3: chunked (GPU builds' default; forced here on any build); l3_one_import: the
            # same restore read whole, then imported whole
            llm.pipeline_restores = tier != "l3_one_import"
            # L3: the first restore of a fresh process (a restart: its buffers are new), then a
            # second one (buffers reused); L2 promotes on a second fill (at once from 4,096
            # tokens): its last run reads it
            runs = []
            for _ in range(2 if tier.startswith("l3") else 3):
                seconds = _timed_eval(llm, query)
                event = llm.last_cache_event
                runs.append(
                    {
                        "warm_over_cold": round(seconds / cold_s, 4),
                        "cached": event.cached_tokens if event else 0,
                        "tier": event.tier if event else None,
                        "restore_ms": round(event.restore_ms, 2) if event else None,
                        "max_abs_dlogit": float(np.abs(_logits(llm) - cold).max()),
                    }
                )
            row[tier] = {**runs[0 if tier.startswith("l3") else -1], "runs": runs}
            row[tier]["pinned"] = llm.cache_status()["pinned_host_buffers"]
            llm.close()
    return row


#: SkippyLlama steps timed in the chat (inclusive wall time, summed over the chat): where its
#: extra time over plain ``Llama`` goes
CHAT_STEPS = ("execute", "park", "after_request", "capture", "flush")
#: where each step lives: the seam, the runtime or its recorder
_STEP_OWNER = {
    "execute": "seam",
    "capture": "seam",
    "after_request": "recorder",
    "flush": "recorder",
}


def _timed_steps(llm: SkippyLlama) -> dict[str, float]:
    """Wrap ``llm``'s steps (instance attributes) to sum their wall time into the result."""
    spent = dict.fromkeys(CHAT_STEPS, 0.0)

    def wrap(name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started

        return timed

    for name in CHAT_STEPS:
        owner = getattr(llm, _STEP_OWNER[name]) if name in _STEP_OWNER else llm
        setattr(owner, name, wrap(name, getattr(owner, name)))
    return spent


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
    history: list[int] = []
    times = []
    got = []
    for user in user_turns:
        history = history + user
        started = time.perf_counter()
        res = llm.create_completion(history, max_tokens=48, temperature=0.0)
        times.append(time.perf_counter() - started)
        reply = llm.tokenize(res["choices"][0]["text"].encode(), add_bos=False)
        got.append(reply)
        history = history + reply
    started = time.perf_counter()
    llm.close()
    row: dict[str, Any] = {
        "total_s": round(sum(times), 4),
        "last_turn_s": round(times[-1], 4),
        "close_s": round(time.perf_counter() - started, 4),
        "turn_s": [round(t, 4) for t in times],
    }
    if spent is not None:
        row["steps_s"] = {k: round(v, 4) for k, v in spent.items()}
    return row, got


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
        makers = {
            "plain": lambda: llama_cpp.Llama(model, **common),
            "skippy": lambda: SkippyLlama(model, cache_settings=Settings(), **common),
        }

        def with_l3(defer: bool, pin: bool = True) -> Any:
            def make() -> SkippyLlama:
                store = Path(tempfile.mkdtemp(dir=tmp))  # a fresh store per round
                settings = _settings(store).model_copy(update={"pin_host_buffers": pin})
                llm = SkippyLlama(model, cache_settings=settings, **common)
                if not defer:
                    llm.defer_record_tokens = 0
                return llm

            return make

        makers["skippy_l3"] = with_l3(True)
        makers["skippy_l3_eager"] = with_l3(False)
        makers["skippy_l3_pageable"] = with_l3(True, pin=False)
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
                ratios = sorted(
                    row[key] / base[key] for row, base in zip(rows, runs["plain"], strict=True)
                )
                summary[label] = {
                    "median": round(float(np.median(ratios)), 4),
                    "min": round(ratios[0], 4),
                    "max": round(ratios[-1], 4),
                }
            summary["replies_equal_plain"] = all(g == replies["plain"][0] for g in replies[name])
        # every round of a mode must answer alike (each starts from a fresh object)
        summary["replies_stable"] = all(g == replies[name][0] for g in replies[name])
        out[name] = summary
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
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    parser.add_argument("--flash-attn", type=int, default=1)
    parser.add_argument(
        "--buffers",
        choices=["default", "bytearray", "huge"],
        default="default",
        help="host buffers for KV bytes, to compare: the runtime's (lazily zeroed mappings), "
        "plain bytearrays, or mappings with transparent huge pages",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.buffers == "bytearray":
        hostmem.MAPPED_BYTES = 1 << 62
    elif args.buffers == "huge":
        hostmem.HUGE_PAGES = True
    n_ctx = max([*args.sizes, *args.chat]) + 1024
    common = {
        "n_ctx": n_ctx,
        "n_gpu_layers": args.n_gpu_layers,
        "flash_attn": bool(args.flash_attn),
        "verbose": False,
    }
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {
        "backend": native.backend_name(),
        "devices": native.device_names(),
        "settings": {k: v for k, v in common.items() if k != "verbose"},
        "buffers": args.buffers,
        "sizes": [],
    }
    for n in args.sizes:
        row = bench_size(args.model, n, common, rng)
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
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
