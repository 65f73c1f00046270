"""Random call sequences on SkippyLlama and on a cold reference must see the same outputs.

The targeted tests (``test_dropin.py``, ``test_skippy_llama.py``, ...) pin one path each; this one
mixes them the way an application does: seeded random scripts of completions (greedy, sampled,
streamed, with a grammar, stops, logit biases, logprobs, prompt logprobs), continuations of a
reply, two interleaved chats (also streamed), low-level ``eval``, ``reset``,
``save_state``/``load_state``, ``kv_cache_clear`` behind the cache's back and
``prepare_next_turn``, over prompts that share prefixes and branch at arbitrary tokens. The same
script runs on ``ColdLlama`` (plain ``Llama`` prefilling every prompt from scratch) and on
SkippyLlama, at the defaults (L1), with every tier on and small budgets (a 1-prefix L1, L2, L3
with 32-token pages), where a second object then runs the script again on the first one's L3, and
with ``logits_all`` (where prompt logprobs are read). Every text, finish reason, logprob and ``eval`` logit must be equal, and the cache must
have served tokens, so the test cannot pass with the cache standing aside.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from modelhelpers import TEXT, last_logits

from skippy_llama.config import Settings
from skippy_llama.costs import CostModel
from skippy_llama.runtime.baseline import ColdLlama
from skippy_llama.runtime.llama import SkippyLlama

# long random scripts on two models each: the longest file of the suite (minutes per test)
pytestmark = [pytest.mark.model, pytest.mark.slow]

N_CTX = 1024
#: Texts whose prefixes the prompts share: cut at random words, so prompts branch anywhere.
SOURCES = (
    TEXT,
    "A recipe for bread: flour, water, salt and yeast, kneaded and left to rise overnight in a "
    "cool room, then shaped, scored with a blade and baked hot until the crust sings. ",
)
TAILS = (" The keeper", " Question: why? Answer:", " Then", " In short,", " Next")
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "steps": {"type": "integer"}},
        "required": ["name", "steps"],
    }
)
USER_TURNS = ("Tell me about lighthouses.", "Why two long flashes?", "And in storms?", "Thanks!")

Op = Callable[[llama_cpp.Llama], Any]


@dataclass
class _Script:
    """A seeded random call sequence, the same for every model it runs on."""

    seed: int
    n_ops: int
    logprobs: bool

    def ops(self) -> list[tuple[str, Op]]:
        rng = random.Random(self.seed)
        state: dict[str, Any] = {"chats": [[], []], "saved": None, "last": None}
        kinds = ["complete", "sample", "shaped", "stream", "continue", "chat", "chat_stream"]
        kinds += ["eval", "clear", "reset", "save", "load", "prepare"]
        kinds += ["logprobs", "echo"] if self.logprobs else []
        weights = {"complete": 4, "continue": 3, "chat": 3, "eval": 2, "sample": 2, "stream": 2}
        chosen = rng.choices(kinds, weights=[weights.get(k, 1) for k in kinds], k=self.n_ops)
        return [(f"{i}:{kind}", _make_op(kind, rng, state)) for i, kind in enumerate(chosen)]

    def run(self, llm: llama_cpp.Llama) -> list[tuple[str, Any]]:
        return [(name, op(llm)) for name, op in self.ops()]


def _prompt(rng: random.Random) -> str:
    source = rng.choice(SOURCES)
    words = source.split(" ")
    return " ".join(words[: rng.randint(8, len(words))]) + rng.choice(TAILS)


def _choice(out: Any) -> Any:
    """The first choice of a (not streamed) completion: llama_cpp types the result as a
    response or a stream, so the test reads it untyped."""
    return out["choices"][0]


def _text(out: Any) -> tuple[str, str]:
    choice = _choice(out)
    return str(choice["text"]), str(choice["finish_reason"])


def _make_op(kind: str, rng: random.Random, state: dict[str, Any]) -> Op:
    """One call of ``kind`` with its arguments drawn now (so every model gets the same)."""
    prompt, max_tokens = _prompt(rng), rng.randint(1, 8)
    if kind == "complete":

        def complete(llm: llama_cpp.Llama) -> Any:
            out = _text(llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0))
            state["last"] = prompt + out[0]
            return out

        return complete
    if kind == "continue":
        extra = rng.choice(TAILS)

        def continue_(llm: llama_cpp.Llama) -> Any:
            base = state["last"] or prompt
            out = _text(llm.create_completion(base + extra, max_tokens=max_tokens, temperature=0))
            state["last"] = base + extra + out[0]
            return out

        return continue_
    if kind == "sample":
        seed, temperature = rng.randint(0, 9999), rng.choice((0.5, 0.8, 1.2))
        return lambda llm: _text(
            llm.create_completion(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed)
        )
    if kind == "stream":
        return lambda llm: "".join(
            _choice(c)["text"]
            for c in llm.create_completion(
                prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
        )
    if kind == "shaped":
        # the sampler paths of test_dropin's _sampling_script, one drawn per call
        shape: dict[str, Any] = rng.choice(
            [
                {"grammar": "json"},
                {"stop": [".", "\n"], "max_tokens": 24},
                {"logit_bias": {198: -100.0, 13: 5.0}},
                {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "seed": rng.randint(0, 99)},
                {"temperature": 0.8, "min_p": 0.1, "seed": rng.randint(0, 99)},
            ]
        )

        def shaped(llm: llama_cpp.Llama) -> Any:
            kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, **shape}
            if kwargs.get("grammar") == "json":
                kwargs["grammar"] = llama_cpp.llama_grammar.LlamaGrammar.from_json_schema(
                    SCHEMA, verbose=False
                )
                kwargs["max_tokens"] = 24
            return _text(llm.create_completion(prompt, **kwargs))

        return shaped
    if kind == "echo":
        return lambda llm: _choice(
            llm.create_completion(prompt, max_tokens=2, temperature=0.0, logprobs=2, echo=True)
        )["logprobs"]
    if kind == "logprobs":
        return lambda llm: _choice(
            llm.create_completion(prompt, max_tokens=3, temperature=0.0, logprobs=2)
        )["logprobs"]
    if kind in ("chat", "chat_stream"):
        which, turn = rng.randrange(2), rng.choice(USER_TURNS)

        def chat(llm: llama_cpp.Llama) -> Any:
            messages = state["chats"][which]
            messages.append({"role": "user", "content": turn})
            if kind == "chat":
                out = llm.create_chat_completion(messages=messages, max_tokens=12, temperature=0)
                reply = _choice(out)["message"]["content"]
            else:
                chunks = llm.create_chat_completion(
                    messages=messages, max_tokens=12, temperature=0, stream=True
                )
                reply = "".join(_choice(c)["delta"].get("content", "") for c in chunks)
            messages.append({"role": "assistant", "content": reply})
            return reply

        return chat
    if kind == "eval":
        more = rng.choice((None, " and more words", " Then the light"))

        def eval_(llm: llama_cpp.Llama) -> Any:
            head = llm.tokenize(prompt.encode())
            llm.reset()
            llm.eval(head)
            first = last_logits(llm).tolist()
            if more is None:
                return first
            tail = llm.tokenize(more.encode(), add_bos=False)
            if isinstance(llm, ColdLlama):
                # the truth is a cold prefill of the whole: where the kernels depend on the batch
                # split (flash attention, GPUs), plain Llama's eval on top of its cells is not it
                llm.reset()  # type: ignore[no-untyped-call]  # llama_cpp.Llama's, unannotated
                llm.eval(head + tail)
            else:
                llm.eval(tail)
            return first, last_logits(llm).tolist()

        return eval_
    if kind == "clear":
        return lambda llm: llm._ctx.kv_cache_clear()
    if kind == "reset":
        return lambda llm: llm.reset()
    if kind == "save":
        return lambda llm: state.__setitem__("saved", llm.save_state())
    if kind == "load":

        def load(llm: llama_cpp.Llama) -> None:
            if state["saved"] is not None:
                llm.load_state(state["saved"])

        return load
    assert kind == "prepare"

    def prepare(llm: llama_cpp.Llama) -> None:
        if isinstance(llm, SkippyLlama):
            llm.prepare_next_turn()  # a chat app's think time; the reference has none

    return prepare


def _cold(path: Path, script: _Script, args: dict[str, Any]) -> list[tuple[str, Any]]:
    llm = ColdLlama(str(path), **args)
    try:
        return script.run(llm)
    finally:
        llm.close()


def _skippy(
    path: Path, script: _Script, args: dict[str, Any], settings: Settings
) -> tuple[list[tuple[str, Any]], Counter[str]]:
    """The script's results on a fresh SkippyLlama, and the hits each tier served."""
    llm = SkippyLlama(str(path), cache_settings=settings, **args)
    try:
        return script.run(llm), Counter(llm.prefix_cache.counters.hits)
    finally:
        llm.close()


def _first_difference(want: list[Any], got: list[Any]) -> str:
    for (name, w), (_, g) in zip(want, got, strict=True):
        if w != g:
            return f"op {name}: cold {str(w)[:200]!r} != skippy {str(g)[:200]!r}"
    return "none"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_defaults_match_a_cold_model_on_random_call_sequences(
    smollm2_path: Path, seed: int
) -> None:
    script = _Script(seed, n_ops=28, logprobs=False)
    args: dict[str, Any] = {"n_ctx": N_CTX, "verbose": False, "seed": 7}
    want = _cold(smollm2_path, script, args)
    got, hits = _skippy(smollm2_path, script, args, Settings())
    assert got == want, _first_difference(want, got)
    assert hits["l1"] > 0, "the cache served nothing: the comparison proves nothing"


@pytest.mark.parametrize("seed", [3, 4])
def test_every_tier_matches_a_cold_model_on_random_call_sequences(
    smollm2_path: Path, tmp_path: Path, seed: int, always_restore: CostModel
) -> None:
    # restores forced: a GPU build's cost model may serve every short prompt from L1 or cold,
    # leaving L2/L3 untested
    script = _Script(seed, n_ops=24, logprobs=False)
    args: dict[str, Any] = {"n_ctx": N_CTX, "verbose": False, "seed": 7}
    want = _cold(smollm2_path, script, args)
    settings = Settings(
        page_tokens=32,
        l1={"max_prefixes": 1},
        l2={"budget": "256MiB"},
        l3={"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path), "minimum_free": "1GiB"},
    )
    args["cost_model"] = always_restore
    got, _ = _skippy(smollm2_path, script, args, settings)
    assert got == want, _first_difference(want, got)
    # a second object starts on the first one's L3 pages
    again, hits = _skippy(smollm2_path, script, args, settings)
    assert again == want, _first_difference(want, again)
    assert hits["l3"] + hits["l2"] > 0, hits


def test_logits_all_matches_a_cold_model_on_random_call_sequences(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """With ``logits_all`` (prompt logprobs, ``llm.scores``) nothing is restored, but the cells
    this object decoded are reused, and every row read must equal a cold model's."""
    script = _Script(5, n_ops=28, logprobs=True)
    args: dict[str, Any] = {"n_ctx": N_CTX, "verbose": False, "seed": 7, "logits_all": True}
    want = _cold(smollm2_path, script, args)
    l3 = {"mode": "fixed", "budget": "1GiB", "directory": str(tmp_path), "minimum_free": "1GiB"}
    got, hits = _skippy(smollm2_path, script, args, Settings(page_tokens=32, l3=l3))
    assert got == want, _first_difference(want, got)
    assert hits["l3"] == hits["l2"] == 0, hits
    assert any(name.endswith(("echo", "logprobs")) for name, _ in want)
