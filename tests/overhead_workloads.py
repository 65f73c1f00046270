"""The workloads and round order of the overhead benchmark (``benchmarks/bench_overhead.py``).

They live here, not in ``benchmarks/``, so that the test of their sizes and order
(``tests/integration/test_bench_overhead_workloads.py``) runs in CI without the tests depending
on ``benchmarks/``; the benchmark imports them from here. Pure: text builders take a tokenizer,
nothing loads a model. ``SKIPPY_BENCH_QUICK``, ``SKIPPY_BENCH_ROUNDS`` and ``SKIPPY_BENCH_MODES``
are read at import, as the benchmark documents.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass

from skippy_llama.runtime.llama import DEFER_RECORD_TOKENS

#: ``skippy_l3`` with its L3 records made at once (``eager``) or left waiting (``defer``) whatever
#: the backend's default (``SkippyLlama.defer_record_tokens``)
DEFER_MODES = {"skippy_l3_eager": 0, "skippy_l3_defer": DEFER_RECORD_TOKENS}
#: ``skippy_l3`` with the record path and park rule before issue 45 item 4 (records captured
#: through the state format, parks whatever prefixes do): a same-session baseline
#: (``benchmarks/record_paths.py``)
BEFORE_MODE = "skippy_l3_before"
ALL_MODES = ("plain", "plain_exact", "skippy", "skippy_l3", *DEFER_MODES, BEFORE_MODE)
#: modes to run (``SKIPPY_BENCH_MODES``, comma-separated; ``plain`` always runs: every ratio is
#: to it)
MODES = tuple(
    m
    for m in ALL_MODES
    if m == "plain"
    or m in os.environ.get("SKIPPY_BENCH_MODES", "plain_exact,skippy,skippy_l3").split(",")
)
WORKLOADS = (
    "chat",
    "chat_stream",
    "chat_idle",
    "oneshot",
    "continue",
    "continue_idle",
    "doc_questions",
    "doc_chat",
    "doc_restart",
)
#: workloads that start from a store warmed by an earlier model object (``bench_overhead``'s
#: ``WARMUPS``): a first process's requests, then a new process's
RESTART_WORKLOADS = ("doc_restart",)

QUICK = os.environ.get("SKIPPY_BENCH_QUICK", "") not in ("", "0")
#: rounds per workload, each running every mode once (``round_order``)
ROUNDS = int(os.environ.get("SKIPPY_BENCH_ROUNDS", "5"))


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
    #: same document, next question: a document of ~1,300 tokens, then questions that each
    #: replace the last ~14 tokens of the previous prompt (issue 42)
    doc_tokens: int = 1300
    doc_questions: int = 4 if QUICK else 8
    answer_tokens: int = 16
    #: interleaved documents after a restart: the documents and the order the new process asks
    #: them in (a letter per request; the first process asked each document once)
    restart_docs: int = 2 if QUICK else 3
    restart_order: str = "ABBA" if QUICK else "ABBACCAB"


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


def chat_messages(tokenize: Callable[[str], list[int]], turns: int) -> list[str]:
    """The user messages of the linear chat, each about ``SIZES.user_tokens`` tokens."""
    return [
        "Summarize the notes below in one sentence.\n" + text_of(tokenize, SIZES.user_tokens, t)
        for t in range(turns)
    ]


def documents(tokenize: Callable[[str], list[int]]) -> list[str]:
    """Distinct one-shot prompts, each about ``SIZES.document_tokens`` tokens, no shared prefix."""
    return [
        text_of(tokenize, SIZES.document_tokens, 1000 + d) + "\nIn short:"
        for d in range(SIZES.documents)
    ]


def continuation_parts(tokenize: Callable[[str], list[int]]) -> list[str]:
    """The long first prompt, then the short texts appended after each reply."""
    return [text_of(tokenize, SIZES.long_prompt_tokens, 2000)] + [
        "\n" + text_of(tokenize, SIZES.continuation_tokens, 3000 + c)
        for c in range(SIZES.continuations)
    ]


#: how each question starts: distinct first words, so two questions share no token after the
#: document's ``Question:``
_OPENERS = ("What", "Which", "Where", "How", "Why", "Who", "When", "Name", "Count", "List")


def document(tokenize: Callable[[str], list[int]], index: int) -> str:
    """Document ``index`` of the document workloads: about ``SIZES.doc_tokens`` tokens."""
    return text_of(tokenize, SIZES.doc_tokens, 4000 + index)


def question(index: int) -> str:
    """Question ``index`` (about 12 tokens), unlike every other from its first word on."""
    rng = random.Random(5000 + index)
    a, b, c = (rng.choice(_WORDS) for _ in range(3))
    return f"{_OPENERS[index % len(_OPENERS)]} {a} lies between the {b} and the {c}?"


def question_prompt(doc: str, index: int) -> str:
    """A completion prompt over ``doc``: prompts of two questions differ only in their last
    ~14 tokens (the question and the answer cue)."""
    return f"{doc}\n\nQuestion: {question(index)}\nAnswer:"


def question_messages(doc: str, index: int) -> list[dict[str, str]]:
    """The chat form of :func:`question_prompt`: the document as the system prompt, the
    question as the user's message."""
    return [{"role": "system", "content": doc}, {"role": "user", "content": question(index)}]


def restart_requests() -> list[tuple[int, int]]:
    """(document, question) of each request of the new process in ``doc_restart``, in order;
    question 0 of every document is the first process's (:func:`restart_warmup`)."""
    asked: dict[int, int] = {}
    out = []
    for letter in SIZES.restart_order:
        doc = ord(letter) - ord("A")
        asked[doc] = asked.get(doc, 0) + 1
        out.append((doc, asked[doc]))
    return out


def restart_warmup() -> list[tuple[int, int]]:
    """(document, question) of the first process's requests: question 0 of every document."""
    return [(doc, 0) for doc in range(SIZES.restart_docs)]


def round_order(round_index: int) -> tuple[str, ...]:
    """The modes in the order round ``round_index`` runs them: ``MODES`` rotated by the round.

    Rotating (ABC, BCA, CAB, ...) puts every mode in every position over the rounds, so what a
    position costs (the previous test's memory freed, caches warm or cold) does not always land
    on the same mode.
    """
    shift = round_index % len(MODES)
    return MODES[shift:] + MODES[:shift]


#: (workload, round, mode) in run order: per workload, round-major, modes rotated per round
CASES = [(w, r, m) for w in WORKLOADS for r in range(ROUNDS) for m in round_order(r)]
