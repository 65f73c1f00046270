"""Node B's time to first token from the remote tier, on the real request path (SmolLM2, a
loopback ``redis-server``, a 2k-token document), side by side with a cold prefill and a local L3
restore of the same prompt, and the remote tier's cost where it never hits.

Per repeat, in one process:

- ``cold_s``: plain ``llama_cpp.Llama``'s time to the first token of the prompt;
- node A (L3 directory A, the remote tier on) answers the prompt: L3 records it, L3's writer
  pushes the pages; ``repeat_push_bytes`` is what a second node's push of the same prefix sent;
- ``l3_s``: a fresh ``SkippyLlama`` on directory A restores the prompt from its L3;
- ``remote_s``: a fresh ``SkippyLlama`` on an empty directory restores it from the remote tier.

Then, where nothing is reused (distinct one-shot prompts, interleaved): plain ``Llama`` against
``SkippyLlama`` with the remote tier on (a server that never hits) and against the remote tier
with the server down (the breaker open): ``plan_ms_*`` is the planner's time per request.
Outputs are compared with the cold ones.

Usage::

    .venv/bin/python benchmarks/bench_remote_restore.py [--repeats 3] [--out benchmarks/results/remote_restore.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_remote import ROOT, start_server

from skippy_llama.config import Settings
from skippy_llama.models import default_model_path
from skippy_llama.runtime.llama import SkippyLlama

SENTENCE = (
    "The harbour master logged every ship that passed the breakwater, its flag, its cargo and "
    "the hour of the tide. "
)
QUESTION = "\nQuestion: what did the harbour master log?\nAnswer:"
KWARGS: dict[str, Any] = {"n_ctx": 4096, "verbose": False, "seed": 0}


def document(llm: llama_cpp.Llama, tokens: int) -> str:
    text = SENTENCE
    while len(llm.tokenize(text.encode())) < tokens:
        text += SENTENCE
    return text


def ttft(llm: llama_cpp.Llama, prompt: str) -> tuple[float, str]:
    started = time.perf_counter()
    done = llm.create_completion(prompt, max_tokens=1, temperature=0.0)
    assert isinstance(done, dict)
    return time.perf_counter() - started, str(done["choices"][0]["text"])


def settings(store: Path, url: str, secret: Path) -> Settings:
    l3 = {"mode": "fixed", "budget": "4GiB", "directory": str(store), "minimum_free": "1GiB"}
    return Settings(l3=l3, remote={"url": url, "secret_file": str(secret)})


def restore(model: str, cfg: Settings, prompt: str) -> tuple[float, str, dict[str, Any]]:
    llm = SkippyLlama(model, cache_settings=cfg, **KWARGS)
    try:
        seconds, text = ttft(llm, prompt)
        event = llm.last_cache_event
        assert event is not None
        remote = llm.prefix_cache.status().get("remote", {})
        disk = llm.prefix_cache.disk
        assert disk is not None and disk.flush(120)  # B's record, and its push
        remote = llm.prefix_cache.status().get("remote", remote)
    finally:
        llm.close()
    return seconds, text, {"tier": event.tier, "cached": event.cached_tokens, "remote": remote}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--one-shots", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/remote_restore.json")
    args = parser.parse_args()
    model = str(default_model_path())
    plain = llama_cpp.Llama(model, **KWARGS)
    doc = document(plain, args.tokens)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server, url = start_server(work)
        secret = work / "remote.key"
        secret.write_bytes(os.urandom(32))
        secret.chmod(0o600)
        try:
            for repeat in range(args.repeats):
                prompt = f"{doc}\n(copy {repeat}){QUESTION}"  # a new prefix each repeat
                plain.reset()
                cold_s, want = ttft(plain, prompt)
                node_a = work / f"a{repeat}"
                _, first, a = restore(model, settings(node_a, url, secret), prompt)
                l3_s, from_l3, l3 = restore(model, settings(node_a, url, secret), prompt)
                node_b = work / f"b{repeat}"
                remote_s, from_remote, b = restore(model, settings(node_b, url, secret), prompt)
                activity = b["remote"].get("activity", {})
                rows.append(
                    {
                        "prompt_tokens": len(plain.tokenize(prompt.encode())),
                        "cold_s": round(cold_s, 4),
                        "l3_s": round(l3_s, 4),
                        "remote_s": round(remote_s, 4),
                        "remote_vs_cold": round(remote_s / cold_s, 3),
                        "remote_vs_l3": round(remote_s / l3_s, 3),
                        "tiers": [a["tier"], l3["tier"], b["tier"]],
                        "remote_cached_tokens": b["cached"],
                        "pushed_bytes_node_a": a["remote"].get("activity", {}).get("bytes_out"),
                        "repeat_push_bytes": activity.get("bytes_out"),
                        "repeat_push_pages_present": activity.get("pages_present"),
                        "outputs_equal": want == first == from_l3 == from_remote,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            never = never_hits(model, plain, url, secret, work, args.one_shots, server)
        finally:
            if server.poll() is None:
                server.kill()
            plain.close()
    summary = {
        "remote_vs_cold_median": statistics.median(r["remote_vs_cold"] for r in rows),
        "remote_vs_l3_median": statistics.median(r["remote_vs_l3"] for r in rows),
        "outputs_equal": all(r["outputs_equal"] for r in rows),
        **never,
    }
    result = {
        "machine": os.uname().machine,
        "cpus": os.cpu_count(),
        "rows": rows,
        "summary": summary,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


def never_hits(
    model: str,
    plain: llama_cpp.Llama,
    url: str,
    secret: Path,
    work: Path,
    n: int,
    server: Any,
) -> dict[str, Any]:
    """Distinct one-shot prompts: plain ``Llama`` against the remote tier that never hits,
    then with the server down (breaker open), interleaved prompt by prompt."""
    cfg = Settings(remote={"url": url, "secret_file": str(secret)})
    skippy = SkippyLlama(model, cache_settings=cfg, **KWARGS)
    totals = {"remote_on": 0.0, "server_down": 0.0}
    plain_s = {"remote_on": 0.0, "server_down": 0.0}
    plans: dict[str, list[float]] = {"remote_on": [], "server_down": []}
    equal = True
    try:
        for phase in ("remote_on", "server_down"):
            if phase == "server_down":
                server.kill()
                server.wait()
            for i in range(n):
                prompt = f"{phase} {i}: " + SENTENCE * (4 + i)
                plain.reset()
                seconds, want = ttft(plain, prompt)
                plain_s[phase] += seconds
                seconds, got = ttft(skippy, prompt)
                totals[phase] += seconds
                equal &= want == got
                event = skippy.last_cache_event
                assert event is not None
                plans[phase].append(event.lookup_ms)
    finally:
        skippy.close()
    return {
        "never_hit_vs_plain": round(totals["remote_on"] / plain_s["remote_on"], 3),
        "server_down_vs_plain": round(totals["server_down"] / plain_s["server_down"], 3),
        "plan_ms_remote_on_median": round(statistics.median(plans["remote_on"]), 3),
        "plan_ms_server_down_median": round(statistics.median(plans["server_down"]), 3),
        "never_hit_outputs_equal": equal,
    }


if __name__ == "__main__":
    main()
