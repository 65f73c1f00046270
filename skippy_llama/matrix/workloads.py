"""The matrix's request lists, built from the texts of :mod:`skippy_llama.workload` (pure).

Requests are ordered so that the live sequence is always another conversation's: chats
round-robin by turn, document questions alternate between documents. A hit then has to come
from the tier under test, not from the prompt the context happens to hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..workload import CHAT_TURNS, DOC_QUESTIONS, DOCUMENTS, ticket_log
from .config import MatrixConfig, Workload

#: Extra turns and questions, so the full preset can ask more than the built-in sample holds.
_MORE_CHATS: dict[str, list[str]] = {
    "dana": [
        "My answers stop mid-sentence. Is something broken?",
        "I set the limit to 32 tokens. Should I raise it?",
        "Does a longer answer make the first token slower?",
    ],
}
_MORE_QUESTIONS = [
    "Summarise the document in one sentence.",
    "Which ticket was closed last, and how?",
    "Name one number the document mentions.",
]


@dataclass(frozen=True)
class MatrixRequest:
    """One request: a raw ``prompt``, or the next ``user`` turn of ``chat`` (chat template
    applied, history from the cold reference's replies so every side sees the same prompt)."""

    label: str
    prompt: str | None = None
    chat: str | None = None
    user: str | None = None
    #: restart workload: 1 = first instance, 2 = a fresh instance reopening L3
    phase: int = 1


def _document(doc: str, tickets: int, offset: int, sentences: int | None) -> str:
    text = DOCUMENTS[doc]
    if sentences is not None:
        text = ". ".join(text.split(". ")[:sentences]).rstrip(".") + "."
    if tickets:
        text += "\n\nClosed support tickets:\n" + "\n".join(ticket_log(tickets, start=offset))
    return text


def _doc_prompt(cfg: MatrixConfig, doc: str, question: str, offset: int) -> str:
    text = _document(doc, cfg.doc_tickets, offset, cfg.doc_sentences)
    return (
        "Read the document and answer the question in one sentence.\n\n"
        # "Answer: The" rather than "Answer:": SmolLM2 ends most of these at once otherwise,
        # and an empty reply compares nothing and times no decode
        f"Document:\n{text}\n\nQuestion: {question}\nAnswer: The"
    )


def _questions(doc: str, n: int) -> list[str]:
    return [*DOC_QUESTIONS[doc], *_MORE_QUESTIONS][:n]


def chats(cfg: MatrixConfig) -> list[MatrixRequest]:
    """``n_chats`` chats sharing the system prompt, ``n_turns`` turns each, round-robin."""
    pool = {**CHAT_TURNS, **_MORE_CHATS}
    names = list(pool)[: cfg.n_chats]
    return [
        MatrixRequest(label=f"{name} t{turn + 1}", chat=name, user=pool[name][turn])
        for turn in range(min(cfg.n_turns, 3))
        for name in names
    ]


def documents(
    cfg: MatrixConfig, n_questions: int | None = None, n_docs: int | None = None
) -> list[MatrixRequest]:
    """``n_docs`` documents × ``n_questions`` questions, alternating documents."""
    docs = list(DOC_QUESTIONS)[: n_docs or cfg.n_docs]
    n = n_questions or cfg.n_questions
    return [
        MatrixRequest(
            label=f"{doc} q{i + 1}", prompt=_doc_prompt(cfg, doc, _questions(doc, n)[i], 7 * d)
        )
        for i in range(n)
        for d, doc in enumerate(docs)
    ]


def restart(cfg: MatrixConfig) -> list[MatrixRequest]:
    """The documents workload cut in two: question 1 of every document in phase 1, the other
    questions in phase 2, on fresh instances that find only what L3 kept."""
    out = []
    for req in documents(cfg, cfg.restart_questions, cfg.restart_docs):
        phase = 1 if req.label.endswith(" q1") else 2
        out.append(MatrixRequest(label=f"p{phase} {req.label}", prompt=req.prompt, phase=phase))
    return out


def noreuse(cfg: MatrixConfig) -> list[MatrixRequest]:
    """Distinct one-shot prompts that share no prefix (each starts with other words)."""
    openings = ["Ticket review", "Weekly summary", "Incident notes", "Release checklist"]
    out = []
    for i in range(cfg.n_noreuse):
        doc = list(DOCUMENTS)[i % len(DOCUMENTS)]
        body = "\n".join(ticket_log(2 + cfg.doc_tickets // 2, start=11 * i + 3))
        text = _document(doc, 0, 0, cfg.doc_sentences)
        prompt = (
            f"{openings[i % len(openings)]} {i + 1}.\n{body}\n\n{text}\n\n"
            "Question: what is this text about?\nAnswer: The"
        )
        out.append(MatrixRequest(label=f"oneshot {i + 1}", prompt=prompt))
    return out


def build(workload: Workload, cfg: MatrixConfig) -> list[MatrixRequest]:
    """The requests of one workload."""
    if workload == "chats":
        return chats(cfg)
    if workload == "documents":
        return documents(cfg)
    return restart(cfg)
