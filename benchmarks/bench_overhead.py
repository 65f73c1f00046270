"""Issue 16 benchmark: what SkippyLlama costs where it has nothing to gain over plain ``Llama``.

Every workload runs for three modes side by side in one pytest session, each on a fresh model
object: ``plain`` (``llama_cpp.Llama``, which already reuses the prefix live in its context),
``skippy`` (``SkippyLlama`` with default settings: L1 on, L2 and L3 off) and ``skippy_l3``
(``SkippyLlama`` with L3 ``fixed`` 1GiB in a fresh temporary directory). Workloads:

* ``chat``: one linear chat (``create_chat_completion``), each turn a ~150-token user message
  and a 48-token greedy reply, growing past 3,000 tokens at 16 turns;
* ``chat_stream``: the same chat with ``stream=True``;
* ``oneshot``: distinct ~500-token documents with no shared prefix, 16 tokens each;
* ``continue``: one ~2,000-token raw prompt, then short continuations, each prompt the previous
  prompt + its reply + ~40 new tokens (``create_completion``, 32 tokens each).

pytest-benchmark times ``SKIPPY_BENCH_ROUNDS`` rounds (default 3) per (workload, mode), each the
total wall time of all requests of a fresh model (loading is outside the timing; ``close()`` is
timed apart as ``close_s``, it waits for the L3 writer). ``extra_info`` holds each request's
fastest time over the rounds (so a burst of other work on a shared machine, which slows one
round, does not decide a ratio), each round's total, the ratios to ``plain`` of the same
workload (the plain test runs first), the summed ``last_cache_event`` steps, and, for the
SkippyLlama modes of ``chat`` (or every workload with ``SKIPPY_BENCH_PROFILE=all``), a cProfile
breakdown of a second, untimed run on another fresh model: inclusive time of the runtime's steps,
grouped by substrings of function names (see ``PROFILE_GROUPS``) so renamed or removed methods
just count zero. Replies are compared with the plain mode's; a difference fails the test.

Usage (``SKIPPY_BENCH_QUICK=1``: 6 turns, 3 documents, 3 continuations)::

    .venv/bin/pytest benchmarks/bench_overhead.py --benchmark-json=benchmarks/results/overhead.json
    .venv/bin/python benchmarks/overhead_table.py benchmarks/results/overhead.json
"""

from __future__ import annotations

import cProfile
import dataclasses
import os
import pstats
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from skippy_llama.config import Settings
from skippy_llama.models import default_model_path
from skippy_llama.runtime.llama import SkippyLlama

MODES = ("plain", "skippy", "skippy_l3")
WORKLOADS = ("chat", "chat_stream", "oneshot", "continue")

#: Profile groups: a function belongs to a group when it lives in skippy_llama and its name
#: contains one of the substrings. Times are inclusive and groups may nest (capture includes
#: get_seq_state); a function absent from the runtime simply adds nothing.
PROFILE_GROUPS: dict[str, tuple[str, ...]] = {
    "lookup": ("lookup",),
    "restore": ("_restore", "_load_pages", "_copy_resident", "restore_checkpoint"),
    "repair": ("_repair",),
    "park_copies": ("_park", "_apply_pending_copies", "_scratch_decode", "checkpoint"),
    "capture": ("_record", "get_seq_state"),
    "l3_writer": ("plan_record", "submit", "enqueue", "compress"),
    "decode": ("_decode",),
}

QUICK = os.environ.get("SKIPPY_BENCH_QUICK", "") not in ("", "0")
#: rounds per (workload, mode); ratios use each request's fastest round
ROUNDS = int(os.environ.get("SKIPPY_BENCH_ROUNDS", "3"))
PROFILE = os.environ.get("SKIPPY_BENCH_PROFILE", "chat")  # "chat", "all" or "off"
N_CTX = 4096


@dataclass(frozen=True)
class Sizes:
    """Workload sizes; ``QUICK`` shrinks them to check that the benchmark works."""

    chat_turns: int = 6 if QUICK else 16
    user_tokens: int = 150
    reply_tokens: int = 48
    documents: int = 3 if QUICK else 8
    document_tokens: int = 500
    oneshot_tokens: int = 16
    long_prompt_tokens: int = 2000
    continuations: int = 3 if QUICK else 8
    continuation_tokens: int = 40
    continue_reply_tokens: int = 32


SIZES = Sizes()

_WORDS = [
    "river",
    "stone",
    "lantern",
    "harbor",
    "maple",
    "copper",
    "orbit",
    "signal",
    "meadow",
    "pocket",
    "winter",
    "thunder",
    "violet",
    "engine",
    "candle",
    "forest",
    "basket",
    "silver",
    "mirror",
    "garden",
    "planet",
    "ribbon",
    "falcon",
    "cotton",
    "bridge",
    "needle",
    "marble",
    "tunnel",
    "island",
    "pepper",
    "rocket",
    "saddle",
    "window",
    "feather",
    "canyon",
    "button",
    "crystal",
    "ladder",
    "velvet",
    "compass",
    "glacier",
    "puzzle",
    "anchor",
    "timber",
    "oyster",
    "blanket",
    "kettle",
    "meteor",
    "walnut",
    "harvest",
]


def text_of(tokenize: Callable[[str], list[int]], n_tokens: int, seed: int) -> str:
    """Deterministic English-like text of about ``n_tokens`` tokens (within a few tokens).

    Sentences are added until the text reaches ``n_tokens``; every seed gives different text
    from its first word on (for up to ``len(_WORDS)`` consecutive seeds), so such texts share no
    prefix.
    """
    rng = random.Random(seed)
    sentences: list[str] = []
    while True:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
        if not sentences:
            words[0] = _WORDS[seed % len(_WORDS)]
        sentences.append(" ".join(words).capitalize() + f" (note {seed}-{len(sentences)}).")
        text = " ".join(sentences)
        if len(tokenize(text)) >= n_tokens:
            return text


@dataclass
class Run:
    """What one mode did on one workload."""

    replies: list[str] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    last_token_s: list[float] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    context_tokens: list[int] = field(default_factory=list)  # tokens live after each request


def _tokenizer(llm: llama_cpp.Llama) -> Callable[[str], list[int]]:
    def tokenize(text: str) -> list[int]:
        return list(llm.tokenize(text.encode(), add_bos=False, special=False))

    return tokenize


def _note(llm: llama_cpp.Llama, run: Run, started: float) -> None:
    run.request_s.append(time.perf_counter() - started)
    run.context_tokens.append(llm.n_tokens)
    event = getattr(llm, "last_cache_event", None)
    if event is not None:
        run.events.append(event.to_dict())


def _stream_reply(chunks: Iterator[Any], run: Run, started: float) -> str:
    parts: list[str] = []
    first = last = None
    for chunk in chunks:
        content = chunk["choices"][0].get("delta", {}).get("content")
        if content:
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            parts.append(content)
    run.ttft_s.append((first or time.perf_counter()) - started)
    run.last_token_s.append((last or time.perf_counter()) - started)
    return "".join(parts)


def chat_messages(tokenize: Callable[[str], list[int]], turns: int) -> list[str]:
    """The user messages of the linear chat, each about ``SIZES.user_tokens`` tokens."""
    return [
        "Summarize the notes below in one sentence.\n" + text_of(tokenize, SIZES.user_tokens, t)
        for t in range(turns)
    ]


def run_chat(llm: llama_cpp.Llama, *, stream: bool) -> Run:
    run = Run()
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a concise assistant."}]
    for message in chat_messages(_tokenizer(llm), SIZES.chat_turns):
        history.append({"role": "user", "content": message})
        started = time.perf_counter()
        result: Any = llm.create_chat_completion(
            messages=history,  # type: ignore[arg-type]
            max_tokens=SIZES.reply_tokens,
            temperature=0.0,
            stream=stream,
        )
        if stream:
            reply = _stream_reply(result, run, started)
        else:
            reply = result["choices"][0]["message"]["content"] or ""
        _note(llm, run, started)
        run.replies.append(reply)
        history.append({"role": "assistant", "content": reply})
    return run


def documents(tokenize: Callable[[str], list[int]]) -> list[str]:
    """Distinct one-shot prompts, each about ``SIZES.document_tokens`` tokens, no shared prefix."""
    return [
        text_of(tokenize, SIZES.document_tokens, 1000 + d) + "\nIn short:"
        for d in range(SIZES.documents)
    ]


def run_oneshot(llm: llama_cpp.Llama) -> Run:
    run = Run()
    for prompt in documents(_tokenizer(llm)):
        started = time.perf_counter()
        result: Any = llm.create_completion(
            prompt, max_tokens=SIZES.oneshot_tokens, temperature=0.0
        )
        _note(llm, run, started)
        run.replies.append(result["choices"][0]["text"])
    return run


def continuation_parts(tokenize: Callable[[str], list[int]]) -> list[str]:
    """The long first prompt, then the short texts appended after each reply."""
    return [text_of(tokenize, SIZES.long_prompt_tokens, 2000)] + [
        "\n" + text_of(tokenize, SIZES.continuation_tokens, 3000 + c)
        for c in range(SIZES.continuations)
    ]


def run_continue(llm: llama_cpp.Llama) -> Run:
    run = Run()
    prompt = ""
    for part in continuation_parts(_tokenizer(llm)):
        prompt += part
        started = time.perf_counter()
        result: Any = llm.create_completion(
            prompt, max_tokens=SIZES.continue_reply_tokens, temperature=0.0
        )
        _note(llm, run, started)
        reply = result["choices"][0]["text"]
        run.replies.append(reply)
        prompt += reply
    return run


RUNNERS: dict[str, Callable[[llama_cpp.Llama], Run]] = {
    "chat": lambda llm: run_chat(llm, stream=False),
    "chat_stream": lambda llm: run_chat(llm, stream=True),
    "oneshot": run_oneshot,
    "continue": run_continue,
}


def make_model(mode: str, l3_dir: Path) -> llama_cpp.Llama:
    """A fresh model object of ``mode``, default threads, greedy-deterministic."""
    common: dict[str, Any] = {"n_ctx": N_CTX, "verbose": False, "seed": 1}
    threads = os.environ.get("SKIPPY_BENCH_THREADS")
    if threads:
        common.update(n_threads=int(threads), n_threads_batch=int(threads))
    path = str(default_model_path())
    if mode == "plain":
        return llama_cpp.Llama(path, **common)
    if mode == "skippy":
        return SkippyLlama(path, cache_settings=Settings(), **common)
    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(l3_dir), "minimum_free": "1GiB"}
    return SkippyLlama(path, cache_settings=Settings(l3=l3), **common)


def profile_groups(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per ``PROFILE_GROUPS`` group: inclusive time of the group's outermost calls.

    Calls of a group's function from another function of the same group are not counted again,
    so a recursive or nested match is not doubled.
    """
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    result: dict[str, float] = {}
    for group, needles in PROFILE_GROUPS.items():
        members = {
            key for key in table if "skippy_llama" in key[0] and any(n in key[2] for n in needles)
        }
        total = 0.0
        for key in members:
            callers = table[key][4]
            if not callers:
                total += table[key][3]
            total += sum(edge[3] for caller, edge in callers.items() if caller not in members)
        result[group] = round(total, 4)
    return result


def profiled(mode: str, workload: str) -> dict[str, Any]:
    """cProfile breakdown of one untimed run of ``workload`` on a fresh model of ``mode``."""
    with tempfile.TemporaryDirectory(prefix="skippy-overhead-prof-") as tmp:
        llm = make_model(mode, Path(tmp))
        profiler = cProfile.Profile()
        profiler.enable()
        started = time.perf_counter()
        RUNNERS[workload](llm)
        wall = time.perf_counter() - started
        profiler.disable()
        llm.close()
    stats = pstats.Stats(profiler)
    return {"profiled_wall_s": round(wall, 3), "groups_s": profile_groups(stats)}


def _event_sums(events: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("lookup_ms", "restore_ms", "prefill_ms", "repaired_tokens", "cached_tokens")
    return {k: round(sum(float(e.get(k, 0)) for e in events), 3) for k in keys}


#: plain mode's run per workload, for ratios and the equality check of the later modes
_PLAIN: dict[str, Run] = {}


@pytest.mark.parametrize(
    ("workload", "mode"), [(w, m) for w in WORKLOADS for m in MODES], ids=lambda v: str(v)
)
def test_overhead(benchmark: Any, workload: str, mode: str) -> None:
    """``ROUNDS`` rounds: every request of ``workload`` on a fresh ``mode`` model (and a fresh L3
    directory, so a round never reuses an earlier round's pages), timed in total."""
    benchmark.group = workload
    runs: list[Run] = []
    close_s: list[float] = []
    held: list[tuple[llama_cpp.Llama, tempfile.TemporaryDirectory[str]]] = []

    def release() -> None:
        while held:
            llm, tmp = held.pop()
            started = time.perf_counter()
            llm.close()
            close_s.append(time.perf_counter() - started)
            tmp.cleanup()

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        release()
        tmp = tempfile.TemporaryDirectory(prefix="skippy-overhead-l3-")
        held.append((make_model(mode, Path(tmp.name)), tmp))
        return (held[-1][0],), {}

    def one_round(llm: llama_cpp.Llama) -> Run:
        runs.append(RUNNERS[workload](llm))
        return runs[-1]

    benchmark.pedantic(one_round, setup=setup, rounds=ROUNDS, iterations=1)
    release()
    # the fastest round per request: a burst of other work on the machine slows one round of
    # one mode, never all of them (the ratios compare these minima, side by side)
    run = dataclasses.replace(
        runs[0], request_s=[min(times) for times in zip(*(r.request_s for r in runs), strict=True)]
    )
    if run.ttft_s:
        run.ttft_s = [min(t) for t in zip(*(r.ttft_s for r in runs), strict=True)]
        run.last_token_s = [min(t) for t in zip(*(r.last_token_s for r in runs), strict=True)]
    for other in runs[1:]:
        assert other.replies == runs[0].replies, f"{mode}: a round's replies differ from round 1"

    total = sum(run.request_s)
    info: dict[str, Any] = {
        "workload": workload,
        "mode": mode,
        "quick": QUICK,
        "sizes": SIZES.__dict__,
        "rounds": len(runs),
        "total_s": round(total, 4),
        "round_totals_s": [round(sum(r.request_s), 4) for r in runs],
        "last_request_s": round(run.request_s[-1], 4),
        "close_s": round(max(close_s), 4),
        "request_s": [round(s, 4) for s in run.request_s],
        "context_tokens": run.context_tokens,
    }
    if run.ttft_s:
        info["ttft_s"] = [round(s, 4) for s in run.ttft_s]
        info["last_token_s"] = [round(s, 4) for s in run.last_token_s]
    if run.events:
        info["events"] = _event_sums(run.events)
        info["last_event"] = run.events[-1]
    if mode == "plain":
        _PLAIN[workload] = run
    elif workload in _PLAIN:
        plain = _PLAIN[workload]
        info["ratio_total"] = round(total / sum(plain.request_s), 4)
        info["ratio_last"] = round(run.request_s[-1] / plain.request_s[-1], 4)
        if PROFILE in ("all", workload):
            info["profile"] = profiled(mode, workload)
    benchmark.extra_info.update(info)
    if mode != "plain" and workload in _PLAIN:
        assert run.replies == _PLAIN[workload].replies, f"{mode} replies differ from plain Llama"
