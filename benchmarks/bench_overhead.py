"""Issue 16 benchmark: what SkippyLlama costs where it has nothing to gain over plain ``Llama``.

Every workload runs for four modes in one pytest session, each on a fresh model object:
``plain`` (``llama_cpp.Llama``, which already reuses the prefix live in its context),
``plain_exact`` (the same, but reusing only the previous prompt's cells, not its reply's: what
exactness costs without any cache, see ``PromptReuseLlama``), ``skippy``
(``SkippyLlama`` with default settings: L1 on, L2 and L3 off) and ``skippy_l3`` (``SkippyLlama``
with L3 ``fixed`` 1GiB in a fresh temporary directory); ``SKIPPY_BENCH_MODES`` picks others, such
as ``skippy_l3_eager`` and ``skippy_l3_defer`` (L3 records made at once, or left waiting as on GPU
builds) and ``skippy_l3_before`` (the record path and park rule before issue 45 item 4,
``record_paths.py``: a same-session baseline). Workloads:

* ``chat``: one linear chat (``create_chat_completion``), each turn a ~150-token user message
  and a greedy reply of at most 48 tokens (SmolLM2 stops after 12), growing past 3,000 tokens
  at 16 turns;
* ``chat_stream``: the same chat with ``stream=True``;
* ``oneshot``: distinct ~500-token documents with no shared prefix, 16 tokens each;
* ``continue``: one ~2,000-token raw prompt, then short continuations, each prompt the previous
  prompt + its reply + ~40 new tokens (``create_completion``, 32 tokens each);
* ``chat_idle`` and ``continue_idle``: ``chat`` and ``continue`` with a user's think time after
  each reply, in which SkippyLlama runs ``prepare_next_turn`` (the reply re-decoded as a batch,
  so the next request reuses it; a chat app calls it while its user types, ``serve`` calls it in
  gaps between requests). Only the requests are timed, as in every workload; the think-time
  work is kept apart as ``idle_s``. Plain ``Llama`` has nothing to do there.

The patterns users run (issue 42), each streamed so that the time to the first token is
measured the same way for every mode (``ttft_s``):

* ``doc_questions``: one ~1,300-token document, then questions as new completions, each prompt
  the document + a question + an answer cue, differing from the previous prompt only in its
  last ~14 tokens (16 tokens each; retrieval and document chat);
* ``doc_chat``: the same as chat completions: the document as the system prompt, the question
  as the user's message, each a new chat of two messages;
* ``doc_restart``: interleaved documents after a restart: a first model object asks question 0
  of every document and closes (setup, untimed: for the L3 modes it warms a store), then the
  timed model object, a new one on the same store (a process restart as L3 sees it: L1 and L2
  empty), asks them in the order A, B, B, A, C, C, A, B with new questions.

Rounds are interleaved: on a shared 2-core machine the speed drifts by 7-10 % over minutes, so
running all rounds of one mode before the next let drift decide a ratio (the same chat measured
1.14x and 1.01x plain within an hour). Each test is one round of one mode (``CASES``, parametrized
as (workload, round, mode)): per workload, round ``r`` runs the modes back to back in an
order rotated by ``r`` (``round_order``: plain/skippy/skippy_l3, then skippy/skippy_l3/plain, ...,
so no mode always runs first or last) before round ``r + 1`` starts. A round is every request of
the workload on a fresh model (and a fresh L3 directory, so a round never reuses an earlier
round's pages), timed by pytest-benchmark (``pedantic``, one round, one iteration; building the
model is its setup, outside the timing); ``close()`` is timed apart as ``close_s`` (it waits for
the L3 writer). ``SKIPPY_BENCH_ROUNDS`` rounds (default 5).

Each test's ``extra_info`` holds that round's per-request wall times, their total, and the same
in process CPU time (``time.process_time()`` deltas: user + sys of every thread of the process,
i.e. llama.cpp's decode threads, the L3 writer and Python). The CPU time is a second view, not a
replacement: on shared cores the time a thread waits for a core taken by other work inflates
wall time but not CPU time, so CPU ratios are harder for drift to decide; but CPU time misses
waiting that SkippyLlama causes itself (I/O, locks) and counts work off the caller's path (the L3
writer thread) that costs no wall time on idle cores, and threads that spin while waiting for
each other (ggml's thread pool does) accrue CPU time while a core is taken from their partner,
so under heavy contention CPU time grows with wall time too (the table's CPU ÷ wall column shows
it). Both are reported. The ratios are computed by ``tests/overhead_table.py`` from the rounds: per
round, a mode's total over plain's total of the same round, summarized as the median over rounds
with min-max (wall and CPU, total and last request); and the older view, each request's fastest
round summed, over plain's. ``extra_info`` also holds
the summed ``last_cache_event`` steps. Every round's replies are compared with plain's (its
round 0, which runs first); a difference fails the test.

After the timed tests, ``test_profile`` runs, for the SkippyLlama modes of ``chat`` (every workload
with ``SKIPPY_BENCH_PROFILE=all``, none with ``off``), a cProfile breakdown of one untimed run
on another fresh model (its pytest-benchmark time includes loading and cProfile's cost; only its
``extra_info`` matters): inclusive time of the runtime's steps, grouped by substrings of function
names (see ``PROFILE_GROUPS``) so renamed or removed methods just count zero.

Usage (``SKIPPY_BENCH_QUICK=1``: 6 turns, 3 documents, 3 continuations, 4 questions, restart
order A, B, B, A over 2 documents; ``-k doc_`` runs the document workloads alone)::

    .venv/bin/pytest benchmarks/bench_overhead.py --benchmark-json=benchmarks/results/overhead.json
    .venv/bin/python tests/overhead_table.py benchmarks/results/overhead.json
    .venv/bin/python tests/overhead_table.py --readme benchmarks/results/overhead.json
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
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

# the workloads, sizes and round order are shared with their test (tests/overhead_workloads.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from overhead_workloads import (
    BEFORE_MODE,
    CASES,
    DEFER_MODES,
    MODES,
    QUICK,
    SIZES,
    WORKLOADS,
    chat_messages,
    continuation_parts,
    document,
    documents,
    question_messages,
    question_prompt,
    restart_requests,
    restart_warmup,
    round_order,
)
from record_paths import ParksAsBefore, capture_as_before

#: Profile groups: a function belongs to a group when it lives in skippy_llama and its name
#: contains one of the substrings. Times are inclusive and groups may nest (capture includes
#: get_seq_state); a function absent from the runtime simply adds nothing.
PROFILE_GROUPS: dict[str, tuple[str, ...]] = {
    "plan": ("plan", "walk", "match"),
    "restore": ("restore_prefix", "execute", "_load_pages", "_copy_checkpoint", "commit"),
    "repair": ("repair", "displace"),
    "park_copies": ("park", "checkpoint"),
    "capture": ("after_request", "capture", "get_seq_state"),
    "l3_writer": ("plan_record", "submit", "enqueue", "compress"),
    "decode": ("decode",),
}

PROFILE = os.environ.get("SKIPPY_BENCH_PROFILE", "chat")  # "chat", "all" or "off"
N_CTX = 4096


@dataclass(frozen=True)
class Stamp:
    """A point in wall time and in the process's CPU time (user + sys of all its threads)."""

    wall: float
    cpu: float

    @staticmethod
    def now() -> Stamp:
        return Stamp(time.perf_counter(), time.process_time())

    def since(self) -> tuple[float, float]:
        """Wall and CPU seconds from this stamp to now."""
        now = Stamp.now()
        return now.wall - self.wall, now.cpu - self.cpu


@dataclass
class Run:
    """What one mode did on one workload in one round."""

    replies: list[str] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)
    request_cpu_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    last_token_s: list[float] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    context_tokens: list[int] = field(default_factory=list)  # tokens live after each request
    idle_s: list[float] = field(default_factory=list)  # think-time work (``_think``), untimed


def _think(llm: llama_cpp.Llama, run: Run) -> None:
    """A user reading the reply and typing: SkippyLlama prepares the next turn meanwhile (plain
    ``Llama`` has nothing to do). Outside every request's timing; its time is kept apart."""
    prepare = getattr(llm, "prepare_next_turn", None)
    if prepare is not None:
        started = time.perf_counter()
        prepare()
        run.idle_s.append(time.perf_counter() - started)


def _tokenizer(llm: llama_cpp.Llama) -> Callable[[str], list[int]]:
    def tokenize(text: str) -> list[int]:
        return list(llm.tokenize(text.encode(), add_bos=False, special=False))

    return tokenize


def _note(llm: llama_cpp.Llama, run: Run, started: Stamp) -> None:
    wall, cpu = started.since()
    run.request_s.append(wall)
    run.request_cpu_s.append(cpu)
    run.context_tokens.append(llm.n_tokens)
    event = getattr(llm, "last_cache_event", None)
    if event is not None:
        run.events.append(event.to_dict())


def _stream_reply(chunks: Iterator[Any], run: Run, started: Stamp, *, chat: bool = True) -> str:
    """The streamed reply's text (chat deltas or completion texts); notes its first and last
    token's times."""
    parts: list[str] = []
    first = last = None
    for chunk in chunks:
        choice = chunk["choices"][0]
        content = choice.get("delta", {}).get("content") if chat else choice.get("text")
        if content:
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            parts.append(content)
    run.ttft_s.append((first or time.perf_counter()) - started.wall)
    run.last_token_s.append((last or time.perf_counter()) - started.wall)
    return "".join(parts)


def run_chat(llm: llama_cpp.Llama, *, stream: bool, think: bool = False) -> Run:
    run = Run()
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a concise assistant."}]
    for message in chat_messages(_tokenizer(llm), SIZES.chat_turns):
        history.append({"role": "user", "content": message})
        started = Stamp.now()
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
        if think:
            _think(llm, run)
        run.replies.append(reply)
        history.append({"role": "assistant", "content": reply})
    return run


def run_oneshot(llm: llama_cpp.Llama) -> Run:
    run = Run()
    for prompt in documents(_tokenizer(llm)):
        started = Stamp.now()
        result: Any = llm.create_completion(
            prompt, max_tokens=SIZES.oneshot_tokens, temperature=0.0
        )
        _note(llm, run, started)
        run.replies.append(result["choices"][0]["text"])
    return run


def run_continue(llm: llama_cpp.Llama, think: bool = False) -> Run:
    run = Run()
    prompt = ""
    for part in continuation_parts(_tokenizer(llm)):
        prompt += part
        started = Stamp.now()
        result: Any = llm.create_completion(
            prompt, max_tokens=SIZES.continue_reply_tokens, temperature=0.0
        )
        _note(llm, run, started)
        if think:
            _think(llm, run)
        reply = result["choices"][0]["text"]
        run.replies.append(reply)
        prompt += reply
    return run


def _ask(llm: llama_cpp.Llama, run: Run, prompt: str) -> None:
    """One streamed completion over a document, timed to its first and last token."""
    started = Stamp.now()
    chunks: Any = llm.create_completion(
        prompt, max_tokens=SIZES.answer_tokens, temperature=0.0, stream=True
    )
    reply = _stream_reply(chunks, run, started, chat=False)
    _note(llm, run, started)
    run.replies.append(reply)


def run_doc_questions(llm: llama_cpp.Llama) -> Run:
    run = Run()
    doc = document(_tokenizer(llm), 0)
    for q in range(SIZES.doc_questions):
        _ask(llm, run, question_prompt(doc, q))
    return run


def run_doc_chat(llm: llama_cpp.Llama) -> Run:
    run = Run()
    doc = document(_tokenizer(llm), 0)
    for q in range(SIZES.doc_questions):
        started = Stamp.now()
        chunks: Any = llm.create_chat_completion(
            messages=question_messages(doc, q),  # type: ignore[arg-type]
            max_tokens=SIZES.answer_tokens,
            temperature=0.0,
            stream=True,
        )
        reply = _stream_reply(chunks, run, started)
        _note(llm, run, started)
        run.replies.append(reply)
    return run


def _doc_requests(llm: llama_cpp.Llama, requests: list[tuple[int, int]]) -> Run:
    run = Run()
    tokenize = _tokenizer(llm)
    docs = {d: document(tokenize, d) for d in sorted({d for d, _ in requests})}
    for doc, q in requests:
        _ask(llm, run, question_prompt(docs[doc], q))
    return run


def run_doc_restart(llm: llama_cpp.Llama) -> Run:
    return _doc_requests(llm, restart_requests())


def warm_restart(llm: llama_cpp.Llama) -> None:
    """The first process of ``doc_restart``: every document's question 0 (untimed)."""
    _doc_requests(llm, restart_warmup())


#: per workload, what a first model object does on the same store before the timed one is
#: built (SkippyLlama modes only: plain ``Llama`` keeps nothing across objects)
WARMUPS: dict[str, Callable[[llama_cpp.Llama], None]] = {"doc_restart": warm_restart}

RUNNERS: dict[str, Callable[[llama_cpp.Llama], Run]] = {
    "chat": lambda llm: run_chat(llm, stream=False),
    "chat_stream": lambda llm: run_chat(llm, stream=True),
    "chat_idle": lambda llm: run_chat(llm, stream=False, think=True),
    "oneshot": run_oneshot,
    "continue": run_continue,
    "continue_idle": lambda llm: run_continue(llm, think=True),
    "doc_questions": run_doc_questions,
    "doc_chat": run_doc_chat,
    "doc_restart": run_doc_restart,
}


class PromptReuseLlama(llama_cpp.Llama):
    """Plain ``Llama`` that reuses only the previous request's prompt cells, never its reply's.

    The cells of a reply were decoded one token at a time, and llama.cpp's single-row kernels
    give them other low bits than the batched prefill a cold prompt gets; SkippyLlama therefore
    prefills a previous reply again as part of the next prompt (see ``SkippyLlama._repair``).
    This mode pays the same, with no cache at all: SkippyLlama over it is what the cache costs,
    and it over plain is what exactness costs.
    """

    _prompt_tokens = 0

    def generate(self, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        self.n_tokens = min(self.n_tokens, self._prompt_tokens)
        self._prompt_tokens = len(tokens)
        return super().generate(tokens, *args, **kwargs)


def make_model(mode: str, l3_dir: Path) -> llama_cpp.Llama:
    """A fresh model object of ``mode``, default threads, greedy-deterministic."""
    common: dict[str, Any] = {"n_ctx": N_CTX, "verbose": False, "seed": 1}
    threads = os.environ.get("SKIPPY_BENCH_THREADS")
    if threads:
        common.update(n_threads=int(threads), n_threads_batch=int(threads))
    path = str(default_model_path())
    if mode == "plain":
        return llama_cpp.Llama(path, **common)
    if mode == "plain_exact":
        return PromptReuseLlama(path, **common)
    if mode == "skippy":
        return SkippyLlama(path, cache_settings=Settings(), **common)
    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(l3_dir), "minimum_free": "1GiB"}
    if mode == BEFORE_MODE:
        before = SkippyLlama(
            path, cache_settings=Settings(l3=l3), cost_model=ParksAsBefore(), **common
        )
        return capture_as_before(before)
    llm = SkippyLlama(path, cache_settings=Settings(l3=l3), **common)
    if mode in DEFER_MODES:
        llm.defer_record_tokens = DEFER_MODES[mode]
    return llm


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
    keys = (
        "lookup_ms",
        "restore_ms",
        "prefill_ms",
        "record_ms",
        "repaired_tokens",
        "cached_tokens",
    )
    return {k: round(sum(float(e.get(k, 0)) for e in events), 3) for k in keys}


#: per workload, the first test's replies and which test it was, for the equality checks
_REPLIES: dict[str, tuple[str, list[str]]] = {}


def _check_replies(workload: str, test: str, replies: list[str]) -> None:
    """Every round of every mode must reply as the workload's first test did: plain ``Llama``'s
    round 0 (another test only when that one is deselected, e.g. with ``-k``)."""
    first, reference = _REPLIES.setdefault(workload, (test, replies))
    assert replies == reference, f"{workload}: {test} replies differ from {first}'s"


def _r(values: list[float]) -> list[float]:
    return [round(v, 4) for v in values]


@pytest.mark.parametrize(
    ("workload", "round_index", "mode"), CASES, ids=[f"{w}-r{r}-{m}" for w, r, m in CASES]
)
def test_overhead(benchmark: Any, workload: str, round_index: int, mode: str) -> None:
    """One round of ``workload`` on a fresh ``mode`` model (and a fresh L3 directory): every
    request, timed in total; ``close()`` timed apart."""
    benchmark.group = workload
    held: list[tuple[llama_cpp.Llama, tempfile.TemporaryDirectory[str]]] = []
    runs: list[Run] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        tmp = tempfile.TemporaryDirectory(prefix="skippy-overhead-l3-")
        warm = WARMUPS.get(workload)
        if warm is not None and mode.startswith("skippy"):
            first = make_model(mode, Path(tmp.name))
            warm(first)
            first.close()  # lands its L3 records: the next object starts from a warm store
        held.append((make_model(mode, Path(tmp.name)), tmp))
        return (held[-1][0],), {}

    def one_round(llm: llama_cpp.Llama) -> None:
        runs.append(RUNNERS[workload](llm))

    started_unix = time.time()
    benchmark.pedantic(one_round, setup=setup, rounds=1, iterations=1)
    ((llm, tmp),) = held
    (run,) = runs
    closing = Stamp.now()
    llm.close()
    close_s, close_cpu_s = closing.since()
    tmp.cleanup()

    info: dict[str, Any] = {
        "workload": workload,
        "round": round_index,
        "mode": mode,
        "position": round_order(round_index).index(mode),
        "started_unix": round(started_unix, 3),
        "quick": QUICK,
        "sizes": SIZES.__dict__,
        "total_s": round(sum(run.request_s), 4),
        "cpu_s": round(sum(run.request_cpu_s), 4),
        "last_request_s": round(run.request_s[-1], 4),
        "last_request_cpu_s": round(run.request_cpu_s[-1], 4),
        "close_s": round(close_s, 4),
        "close_cpu_s": round(close_cpu_s, 4),
        "request_s": _r(run.request_s),
        "request_cpu_s": _r(run.request_cpu_s),
        "context_tokens": run.context_tokens,
    }
    if run.idle_s:
        info["idle_s"] = round(sum(run.idle_s), 4)
    if run.ttft_s:
        info["ttft_s"] = _r(run.ttft_s)
        info["ttft_total_s"] = round(sum(run.ttft_s), 4)
        info["last_ttft_s"] = round(run.ttft_s[-1], 4)
        info["last_token_s"] = _r(run.last_token_s)
    if run.events:
        info["events"] = _event_sums(run.events)
        info["last_event"] = run.events[-1]
    benchmark.extra_info.update(info)
    _check_replies(workload, f"r{round_index} {mode}", run.replies)


PROFILED = [
    (w, m) for w in WORKLOADS for m in MODES if m.startswith("skippy") and PROFILE in ("all", w)
]


@pytest.mark.parametrize(("workload", "mode"), PROFILED, ids=[f"{w}-{m}" for w, m in PROFILED])
def test_profile(benchmark: Any, workload: str, mode: str) -> None:
    """The cProfile breakdown of one run of ``workload`` on a fresh ``mode`` model, after the
    timed tests; pytest-benchmark's time here includes loading and cProfile's own cost, so it is
    no overhead figure (``extra_info`` holds the breakdown)."""
    benchmark.group = f"{workload} (profiled)"
    profile = benchmark.pedantic(profiled, args=(mode, workload), rounds=1, iterations=1)
    benchmark.extra_info.update({"workload": workload, "mode": mode, "profile": profile})
