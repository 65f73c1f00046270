"""Workloads for ``skippy-llama run``: the built-in sample and JSONL files.

The built-in sample mirrors the two traffic shapes the cache is for: interleaved multi-turn chats
that share one system prompt, and a batch of questions over shared documents.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

SYSTEM_PROMPT = (
    "You are Harbor, the support assistant of a small company that makes open-source tools for "
    "running language models on laptops and home servers. Answer in two or three short sentences. "
    "Be concrete and friendly. If a question is about installation, mention that the tools need "
    "Python 3.10 or newer and about four gigabytes of free memory for small models. If a question "
    "is about performance, explain that prompt processing is the slow part on a CPU and that "
    "reusing a cached prefix of the prompt avoids recomputing it. If a question is about privacy, "
    "say that nothing leaves the user's machine unless they configure a remote server themselves. "
    "Never invent version numbers, prices or release dates. When you do not know something, say "
    "so and suggest where the user could look, such as the project's documentation or its issue "
    "tracker. Keep a calm tone even when the user is frustrated, and thank them for reporting "
    "problems, because bug reports help everyone who uses the tools."
)

DOCUMENTS = {
    "tides": (
        "Tides are the regular rise and fall of sea level caused mainly by the gravitational pull "
        "of the Moon and, to a lesser degree, the Sun. The Moon pulls the ocean on the side of the "
        "Earth facing it into a bulge, and a second bulge forms on the opposite side, where the "
        "Earth is pulled away from the water. As the Earth rotates through both bulges each day, "
        "most coasts see two high tides and two low tides roughly every twenty-four hours and "
        "fifty minutes. When the Sun, Moon and Earth line up at new and full moon, their pulls "
        "add together and produce spring tides, with the highest highs and lowest lows. At the "
        "quarter moons the Sun and Moon pull at right angles and the range is smallest; these are "
        "neap tides. The shape of coastlines and the depth of the sea floor change tides a great "
        "deal: the Bay of Fundy in Canada funnels water into a narrowing basin and has a range of "
        "up to sixteen metres, while parts of the Mediterranean see only a few centimetres. Tidal "
        "currents can be strong in straits and estuaries, and sailors have used tide tables for "
        "centuries to plan when to enter harbours. Today tides are also studied as a source of "
        "renewable energy, with barrages and underwater turbines turning the moving water into "
        "electricity."
    ),
    "bread": (
        "Bread is made from flour, water, salt and a leavening agent. When flour is mixed with "
        "water, two proteins, glutenin and gliadin, bond into gluten, an elastic network that "
        "traps gas. Yeast ferments the sugars in the dough and releases carbon dioxide and "
        "alcohol; the gas inflates the gluten network and the dough rises. Kneading aligns and "
        "strengthens the gluten, while a long, cool fermentation develops flavour because enzymes "
        "and bacteria have more time to work. Sourdough relies on a culture of wild yeasts and "
        "lactic acid bacteria instead of commercial yeast, which gives the loaf its tang and helps "
        "it keep longer. During baking the water in the dough turns to steam and the gas expands, "
        "giving a final burst of rise called oven spring. Above about seventy degrees Celsius the "
        "proteins set and the starches gelatinise, fixing the crumb. The crust browns through the "
        "Maillard reaction and caramelisation, which create hundreds of aroma compounds. Bakers "
        "often add steam in the first minutes of baking so the crust stays soft long enough for "
        "the loaf to expand, and then let it dry so the crust becomes crisp. Once out of the oven, "
        "bread should cool before slicing, since the crumb is still setting as moisture moves "
        "outwards."
    ),
}

CHAT_TURNS = {
    "ana": [
        "Hi! I want to try your tools on my old laptop. What do I need?",
        "It has eight gigabytes of memory. Is that enough?",
        "Great. Will my prompts be sent anywhere?",
    ],
    "ben": [
        "Why is the first answer so slow on my CPU?",
        "And the second question about the same text was much faster. Why?",
        "Can I make that speed-up survive a restart?",
    ],
    "caro": [
        "The installer crashed with a Python error. What should I do?",
        "I have Python 3.8. Is that the problem?",
        "Thanks, it works now. Where do I report other bugs?",
    ],
}

DOC_QUESTIONS = {
    "tides": [
        "Why are there two high tides a day?",
        "What is the difference between spring tides and neap tides?",
        "Why does the Bay of Fundy have such large tides?",
    ],
    "bread": [
        "What does kneading do to the dough?",
        "Why does sourdough taste sour?",
        "What is oven spring?",
    ],
}


_NAMES = ["Ana", "Ben", "Caro", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai"]
_PLATFORMS = [
    "an old ThinkPad running Debian",
    "a Raspberry Pi 5 with a fan",
    "a MacBook Air with eight gigabytes of memory",
    "a Windows desktop with an old graphics card",
    "a home server with sixty-four gigabytes of memory",
    "a Steam Deck in desktop mode",
    "a fanless mini PC under a television",
]
_PROBLEMS = [
    "the first answer took almost a minute to appear",
    "the installer stopped with an error about Python 3.8",
    "the model file would not download behind the office proxy",
    "answers were cut off after a few words",
    "memory use kept growing during a long chat",
    "the local server refused connections from another laptop",
    "the cache directory slowly filled the whole disk",
    "the chat template printed strange tags in every reply",
    "the fan became very loud during prompt processing",
]
_FIXES = [
    "upgrading Python and reinstalling the package",
    "setting the proxy variables before the download",
    "raising the maximum number of generated tokens",
    "giving the cache a fixed budget and a reserve of free space",
    "binding the server to the local network address",
    "choosing a smaller quantized model",
    "updating the chat template shipped with the model",
    "limiting the number of CPU threads",
]


def ticket_log(n_tickets: int, start: int = 0) -> list[str]:
    """``n_tickets`` deterministic closed-ticket lines (about 45 tokens each), to make long prompts."""
    lines = []
    for i in range(start, start + n_tickets):
        lines.append(
            f"Ticket {101 + i}: {_NAMES[i % len(_NAMES)]} reported that "
            f"{_PROBLEMS[(3 * i) % len(_PROBLEMS)]} on {_PLATFORMS[(5 * i + 2) % len(_PLATFORMS)]}. "
            f"It was resolved by {_FIXES[(7 * i + 1) % len(_FIXES)]}, and the ticket was closed "
            f"after {1 + (i * 4) % 9} days."
        )
    return lines


def handbook(n_tickets: int) -> str:
    """A long shared prefix: instructions, both documents and a deterministic ticket log."""
    lines = [
        SYSTEM_PROMPT,
        "",
        "Reference material for support staff follows: two background articles and the log of "
        "recently closed support tickets.",
        "",
        "Article on tides:",
        DOCUMENTS["tides"],
        "",
        "Article on bread:",
        DOCUMENTS["bread"],
        "",
        "Closed support tickets:",
        *ticket_log(n_tickets),
    ]
    return "\n".join(lines)


@dataclass
class Request:
    """One request of a workload: a plain prompt or the next user turn of a chat."""

    label: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    chat: str | None = None
    max_tokens: int = 24
    extra: dict[str, Any] = field(default_factory=dict)


def builtin_workload(max_tokens: int = 24) -> list[Request]:
    """Interleaved chats (round-robin by turn) followed by questions over shared documents."""
    requests: list[Request] = []
    for turn in range(max(len(t) for t in CHAT_TURNS.values())):
        for name, turns in CHAT_TURNS.items():
            if turn < len(turns):
                requests.append(
                    Request(
                        label=f"chat {name} turn {turn + 1}",
                        messages=[{"role": "user", "content": turns[turn]}],
                        chat=name,
                        max_tokens=max_tokens,
                    )
                )
    for doc, questions in DOC_QUESTIONS.items():
        for i, question in enumerate(questions):
            prompt = (
                f"Read the document and answer the question in one sentence.\n\n"
                f"Document:\n{DOCUMENTS[doc]}\n\nQuestion: {question}\nAnswer:"
            )
            requests.append(
                Request(label=f"doc {doc} q{i + 1}", prompt=prompt, max_tokens=max_tokens)
            )
    return requests


def load_jsonl(path: Path, max_tokens: int = 24) -> list[Request]:
    """Read ``{"prompt": ...}`` or ``{"messages": [...]}`` requests, one JSON object per line.

    Raises:
        ConfigError: the file is missing or a line is not a valid request (names the line).
    """
    if not path.is_file():
        raise ConfigError(f"--prompts {str(path)!r} does not exist; pass a JSONL file")
    requests = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ConfigError(
                f"{path} line {lineno}: expected an object with 'prompt' or 'messages'"
            )
        tokens = obj.get("max_tokens", max_tokens)
        if not isinstance(tokens, int) or tokens < 1:
            raise ConfigError(f"{path} line {lineno}: max_tokens must be a positive integer")
        label = str(obj.get("label", f"line {lineno}"))
        if isinstance(obj.get("prompt"), str):
            requests.append(Request(label=label, prompt=obj["prompt"], max_tokens=tokens))
        elif isinstance(obj.get("messages"), list) and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in obj["messages"]
        ):
            requests.append(Request(label=label, messages=obj["messages"], max_tokens=tokens))
        else:
            raise ConfigError(
                f"{path} line {lineno}: needs 'prompt' (a string) or 'messages' "
                "(a list of {'role': ..., 'content': ...})"
            )
    if not requests:
        raise ConfigError(f"--prompts {str(path)!r} holds no requests")
    return requests
