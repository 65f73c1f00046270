"""Batch input checks, the prefix-sharing order and the resumable output file (no model)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from skippy_llama.batch import OutputFile, load_items, prefix_order
from skippy_llama.errors import ConfigError


def _write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_items_are_read_with_their_options(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "in.jsonl",
        json.dumps({"id": "a", "prompt": "Hello", "max_tokens": 5, "temperature": 0.5}),
        "",
        json.dumps({"id": 7, "messages": [{"role": "user", "content": "Hi"}], "seed": 3}),
    )
    a, b = load_items(path)
    assert (a.id, a.line, a.prompt, a.max_tokens, a.temperature) == ("a", 1, "Hello", 5, 0.5)
    assert (b.id, b.line, b.messages, b.seed) == (7, 3, ({"role": "user", "content": "Hi"},), 3)
    assert b.order_text() == "<user>Hi"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ('{"prompt": "x"}', "line 2: 'id' must be"),
        ('{"id": true, "prompt": "x"}', "line 2: 'id' must be"),
        ('{"id": "b"}', "line 2: give exactly one of 'prompt'"),
        ('{"id": "b", "prompt": "x", "messages": []}', "line 2: give exactly one"),
        ('{"id": "b", "prompt": ""}', "line 2: 'prompt' must be a non-empty string"),
        ('{"id": "b", "messages": [{"role": "user"}]}', "line 2: messages[0] must be"),
        ('{"id": "b", "prompt": "x", "max_tokens": 0}', "line 2: 'max_tokens' must be"),
        ('{"id": "b", "prompt": "x", "temperature": -1}', "line 2: 'temperature' must be"),
        ('{"id": "b", "prompt": "x", "seed": "s"}', "line 2: 'seed' must be"),
        ('{"id": "b", "promt": "x"}', "line 2: unknown key(s) 'promt'"),
        ('{"id": "a", "prompt": "again"}', "line 2: id 'a' repeats line 1"),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path / "in.jsonl", '{"id": "a", "prompt": "ok"}', line)
    with pytest.raises(ConfigError) as info:
        load_items(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_missing_and_empty_inputs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_items(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="holds no items"):
        load_items(_write(tmp_path / "empty.jsonl", "", "  "))


def test_prefix_order_walks_the_trie() -> None:
    keys = [[1, 2, 3, 9], [5, 1], [1, 2], [1, 2, 3, 4], [5, 1], [1, 7]]
    order = prefix_order(keys)
    assert order == [2, 3, 0, 5, 1, 4]  # a prefix before its extensions; ties in input order


def test_prefix_order_of_a_subset_is_the_full_order_restricted() -> None:
    rng = random.Random(4)
    keys = [[rng.randrange(4) for _ in range(rng.randrange(1, 6))] for _ in range(60)]
    full = prefix_order(keys)
    keep = sorted(rng.sample(range(60), 25))
    sub = prefix_order([keys[i] for i in keep])
    assert [keep[i] for i in sub] == [i for i in full if i in set(keep)]


def test_output_resume_drops_a_partial_line_and_rejects_foreign_ids(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    out = OutputFile(path)
    assert out.finished_ids({"a", "b"}) == set()
    out.write({"id": "a", "text": "x"})
    out.close()
    with path.open("a") as f:
        f.write('{"id": "b", "te')  # a crash mid-write
    again = OutputFile(path)
    assert again.finished_ids({"a", "b"}) == {"a"}
    assert again.dropped_partial_line
    assert path.read_text() == '{"id": "a", "text": "x"}\n'
    with pytest.raises(ConfigError, match="line 1: id 'a' is not in the input"):
        OutputFile(path).finished_ids({"c"})
    path.write_text("hello\n")
    with pytest.raises(ConfigError, match="line 1: not a batch output record"):
        OutputFile(path).finished_ids({"a"})
