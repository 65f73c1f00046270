"""``skippy-llama batch --ray`` on a real local Ray instance and the real model, no mocks.

The test process starts Ray (``ray.init(num_cpus=2)``); each batch is the real CLI in a
subprocess that joins it with ``--ray ADDRESS``, two actors of one CPU each. Outputs are
compared with the single-process ``batch`` on the same input: the same set of lines, whether
the driver or an actor was killed on the way. Ray Data's ``map_batches`` runs
``SkippyLlamaPredictor`` on the same Ray instance.

Without Ray installed these tests skip, except under CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from modelhelpers import TEXT

# Ray clusters, actors killed mid-shard: minutes on 2 cores (the default run leaves them out)
pytestmark = [pytest.mark.model, pytest.mark.slow]

DOCS = {
    "light": TEXT,
    "mill": TEXT.replace("lighthouse", "windmill").replace("Ships", "Carts"),
    "bell": TEXT.replace("lighthouse", "bell tower").replace("wick", "rope"),
}
QUESTIONS = [
    "Who climbs the stairs?",
    "How many steps are there?",
    "What is written down?",
    "When does he climb?",
    "What shakes in storms?",
    "What did he hear?",
]
MAX_TOKENS = "6"


def _items() -> list[dict[str, Any]]:
    # documents interleaved, as a queue of questions would arrive
    items: list[dict[str, Any]] = [
        {"id": f"{doc}-{q}", "prompt": f"{text}\nQuestion: {question}\nAnswer:"}
        for q, question in enumerate(QUESTIONS)
        for doc, text in DOCS.items()
    ]
    items.append({"id": "chat", "messages": [{"role": "user", "content": "Name a color."}]})
    return items


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray instance of 2 CPUs, started here; its address for ``--ray``."""
    try:
        import ray
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and Ray is missing ({exc}): pip install 'skippy-llama[ray]'")
        pytest.skip(f"Ray is not installed ({exc})")
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def input_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ray-batch") / "in.jsonl"
    path.write_text("".join(json.dumps(i) + "\n" for i in _items()), encoding="utf-8")
    return path


def _cmd(inp: Path, out: Path, *flags: str, model: Path) -> list[str]:
    return [sys.executable, "-m", "skippy_llama.cli.main", "batch", str(inp), str(out),
            "--model", str(model), "--max-tokens", MAX_TOKENS, *flags]  # fmt: skip


def _ray(address: str) -> tuple[str, ...]:
    return ("--ray", address, "--workers", "2", "--cpus-per-worker", "1")


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(scope="module")
def reference(smollm2_path: Path, input_file: Path) -> list[str]:
    """OUT of one uninterrupted single-process batch, lines sorted."""
    out = input_file.with_name("single.jsonl")
    res = _run(_cmd(input_file, out, "--quiet", "--threads", "1", model=smollm2_path))
    assert res.returncode == 0, res.stderr
    return sorted(_lines(out))


def _wait_for_lines(proc: subprocess.Popen[Any], out: Path, n: int) -> None:
    deadline = time.monotonic() + 300
    while len(_lines(out)) < n:
        assert proc.poll() is None, "the batch ended before the kill"
        assert time.monotonic() < deadline, "no progress in 300 s"
        time.sleep(0.05)


def test_two_actors_write_what_one_process_writes(
    smollm2_path: Path, input_file: Path, reference: list[str], ray_address: str, tmp_path: Path
) -> None:
    out = tmp_path / "ray.jsonl"
    res = _run(_cmd(input_file, out, "--json", *_ray(ray_address), model=smollm2_path))
    assert res.returncode == 0, res.stderr
    assert sorted(_lines(out)) == reference
    summary = json.loads(res.stdout)
    assert summary["workers"] == 2 and summary["run"] == len(_items())
    assert summary["errors"] == 0 and summary["actors_lost"] == 0
    assert len(summary["items_per_actor"]) == 2  # both actors ran items
    # the actors' caches reused each document: prefilled what the trie says this schedule
    # would, and less than round-robin would have
    assert summary["prefilled_tokens"] == summary["prompt_tokens"] - summary["cached_tokens"]
    assert summary["cached_tokens"] > 0.5 * summary["prompt_tokens"]
    assert summary["round_robin_prefill"] > summary["plan_prefill"]
    assert "reuse" in res.stderr and "ETA" in res.stderr  # one progress line across actors

    kept = tmp_path / "kept.jsonl"
    res = _run(_cmd(input_file, kept, "--quiet", "--keep-order", *_ray(ray_address),
                    model=smollm2_path))  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert [json.loads(line)["id"] for line in _lines(kept)] == [i["id"] for i in _items()]
    assert sorted(_lines(kept)) == reference


def test_driver_killed_then_resumed_writes_the_same_lines(
    smollm2_path: Path, input_file: Path, reference: list[str], ray_address: str, tmp_path: Path
) -> None:
    out = tmp_path / "resumed.jsonl"
    argv = _cmd(input_file, out, "--quiet", *_ray(ray_address), model=smollm2_path)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_lines(proc, out, 3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(_lines(out))
    assert 3 <= done < len(_items())
    res = _run([*argv, "--json"])
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["already_done"] == done and summary["run"] == len(_items()) - done
    assert sorted(_lines(out)) == reference  # nothing twice, nothing missing


def test_actor_killed_mid_shard_its_items_finish_elsewhere(
    smollm2_path: Path, input_file: Path, reference: list[str], ray_address: str, tmp_path: Path
) -> None:
    import ray

    from skippy_llama.batch.ray_runner import INFO_GROUP, NAMESPACE

    out = tmp_path / "killed.jsonl"
    argv = _cmd(input_file, out, "--json", *_ray(ray_address), model=smollm2_path)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_lines(proc, out, 2)
    actor = ray.get_actor(f"batch-{proc.pid}-0", namespace=NAMESPACE)
    pid = cast(int, ray.get(actor.pid.options(concurrency_group=INFO_GROUP).remote()))
    os.kill(pid, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["actors_lost"] == 1 and summary["items_retried"] >= 1
    assert summary["errors"] == 0 and summary["items_given_up"] == 0
    lines = _lines(out)
    assert len(lines) == len(set(lines)) == len(_items())  # nothing written twice
    assert sorted(lines) == reference


def test_item_running_when_its_actor_dies_past_its_retries_is_an_error(
    smollm2_path: Path, input_file: Path, reference: list[str], ray_address: str, tmp_path: Path
) -> None:
    import ray

    from skippy_llama.batch.ray_runner import INFO_GROUP, NAMESPACE

    out = tmp_path / "given-up.jsonl"
    argv = _cmd(input_file, out, "--json", "--item-retries", "0", *_ray(ray_address),
                model=smollm2_path)  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_lines(proc, out, 2)
    actor = ray.get_actor(f"batch-{proc.pid}-1", namespace=NAMESPACE)
    pid = cast(int, ray.get(actor.pid.options(concurrency_group=INFO_GROUP).remote()))
    os.kill(pid, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr  # a failed item: exit 1, as without Ray
    summary = json.loads(stdout)
    assert summary["actors_lost"] == 1 and summary["items_given_up"] == summary["errors"] == 1
    records = [json.loads(line) for line in _lines(out)]
    (failed,) = [r for r in records if "error" in r]
    assert failed["error"].startswith("WorkerDied: a Ray worker died while running this item")
    want = {r["id"]: r for r in map(json.loads, reference) if r["id"] != failed["id"]}
    assert {r["id"]: r for r in records if "error" not in r} == want
    assert len(records) == len(_items())


def test_bad_line_stops_before_ray_or_a_model_starts(
    smollm2_path: Path, ray_address: str, tmp_path: Path
) -> None:
    import ray

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "ok"}\n{"id": 2, "prompt": "x", "max_tokens": -3}\n')
    never = tmp_path / "never.jsonl"
    # an address where no Ray listens: the line is named before anything connects
    for address in (ray_address, "127.0.0.1:9"):
        res = _run(_cmd(bad, never, *_ray(address), model=smollm2_path))
        assert res.returncode == 2, res.stderr
        assert f"{bad} line 2: 'max_tokens' must be a positive integer" in res.stderr
        assert not never.exists()
    assert ray.util.list_named_actors(all_namespaces=True) == []
    res = _run(_cmd(bad, never, "--workers", "0", model=smollm2_path))
    assert res.returncode == 2 and "--workers 0 must be at least 1" in res.stderr


def test_ray_data_map_batches_answers_as_the_batch_does(
    smollm2_path: Path, reference: list[str], ray_address: str
) -> None:
    import ray

    from skippy_llama.batch.ray_data import SkippyLlamaPredictor
    from skippy_llama.errors import ConfigError

    rows = [{"id": i["id"], "prompt": i.get("prompt"), "messages": i.get("messages")}
            for i in _items()]  # fmt: skip
    ds = ray.data.from_items(rows).map_batches(
        SkippyLlamaPredictor,
        fn_constructor_kwargs={"model": str(smollm2_path), "max_tokens": int(MAX_TOKENS)},
        concurrency=1,
        num_cpus=1,
        batch_size=len(rows),
    )
    got = {r["id"]: r for r in ds.take_all()}
    want = {r["id"]: r for r in map(json.loads, reference)}
    assert set(got) == set(want)
    for key, record in want.items():
        row = got[key]
        assert row["error"] == ""
        assert (row["text"], row["finish_reason"], row["prompt_tokens"]) == (
            record["text"],
            record["finish_reason"],
            record["prompt_tokens"],
        )
    # the batch ran in trie order: each document's later questions reused it
    assert sum(r["cached_tokens"] for r in got.values()) > 0.5 * sum(
        r["prompt_tokens"] for r in got.values()
    )
    predictor = SkippyLlamaPredictor(str(smollm2_path), n_threads=1)
    with pytest.raises(ConfigError, match=r"<Ray Data batch> line 2: 'prompt' must be"):
        predictor({"prompt": ["fine", ""]})
