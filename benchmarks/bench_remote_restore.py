"""The parts of node B's time to first token from the remote tier, on SmolLM2 and a loopback
``redis-server``, at a 2k-token document (the issue-31 target: ≤ 0.3× cold, within 1.5× of a
local L3 restore).

Until the planner consults the remote tier, a remote restore is measured in its parts:

- ``cold_s``: plain ``llama_cpp.Llama``'s time to the first token of the prompt;
- ``l3_restore_s``: a fresh ``SkippyLlama`` restoring the document from its local L3;
- ``remote_fetch_s``: node B's ``match`` + ``fetch`` (every page verified) of the document's
  pages that node A pushed.

A remote restore costs about ``remote_fetch_s`` plus what ``l3_restore_s`` spends outside its
L3 read (the pages go to llama.cpp the same way), which ``remote_vs_l3_upper`` bounds as
``(remote_fetch_s + l3_restore_s) / l3_restore_s``.

Usage::

    .venv/bin/python benchmarks/bench_remote_restore.py [--repeats 3] [--out benchmarks/results/remote_restore.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_remote import ROOT, start_server

from skippy_llama.config import L3Settings, RemoteSettings, Settings
from skippy_llama.handoff.l3 import prefix_record, read_prefix
from skippy_llama.identity import page_keys
from skippy_llama.models import default_model_path
from skippy_llama.runtime.llama import SkippyLlama
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.remote import RemoteTier

N_CTX = 4096
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had done before him. There were one hundred and twelve of them, worn smooth "
    "in the middle by generations of boots. At the top he trimmed the wick, polished the great "
    "lens until it shone, and wound the clockwork that turned the light. "
)


def l3(directory: Path) -> L3Settings:
    return L3Settings(mode="fixed", budget="2GiB", directory=directory, minimum_free="1GiB")


def ttft(llm: llama_cpp.Llama, prompt: str) -> float:
    t0 = time.perf_counter()
    llm.create_completion(prompt, max_tokens=1, temperature=0.0)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/remote_restore.json")
    args = parser.parse_args()
    model = str(default_model_path())
    scratch = Path(tempfile.mkdtemp(prefix="bench-remote-restore-"))
    proc, url = start_server(scratch)
    secret = scratch / "remote.key"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    try:
        cold = llama_cpp.Llama(model, n_ctx=N_CTX, verbose=False)
        words = len(cold.tokenize(TEXT.encode()))
        prompt = TEXT * (2048 // words) + "The keeper wrote that"
        n_tokens = len(cold.tokenize(prompt.encode()))
        cold_s = []
        for _ in range(args.repeats):
            cold.reset()
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(cold.ctx), True)
            cold_s.append(ttft(cold, prompt))
        cold.close()

        store_a = scratch / "a"
        node = SkippyLlama(
            model, n_ctx=N_CTX, verbose=False, cache_settings=Settings(l3=l3(store_a))
        )
        ttft(node, prompt)
        root = node.prefix_cache.root
        page_tokens = node.prefix_cache.page_tokens
        keys = page_keys(root, node.tokenize(prompt.encode()), page_tokens)
        node.close()
        l3_s = []
        for _ in range(args.repeats):
            fresh = SkippyLlama(
                model, n_ctx=N_CTX, verbose=False, cache_settings=Settings(l3=l3(store_a))
            )
            l3_s.append(ttft(fresh, prompt))
            event = fresh.last_cache_event
            assert event is not None and event.tier == "l3", event
            fresh.close()

        remote = RemoteSettings(url=url, secret_file=secret)
        with DiskTier(l3(store_a), reconcile=False, close_at_exit=False) as disk:
            records = [prefix_record(m, read_prefix(disk, m)) for m in disk._tree.manifests()[0]]
        with RemoteTier(remote) as node_a:
            t0 = time.perf_counter()
            for record in records:
                node_a.push(record)
            push_s = time.perf_counter() - t0
        fetch_s = []
        with RemoteTier(remote, identity=root) as node_b:
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                depth = node_b.match(root, keys)
                pages = node_b.fetch(keys[:depth])
                fetch_s.append(time.perf_counter() - t0)
            assert len(pages) == depth > 0
        cold_m, l3_m, fetch_m = (statistics.median(x) for x in (cold_s, l3_s, fetch_s))
        out: dict[str, Any] = {
            "command": " ".join([sys.executable, *sys.argv]),
            "commit": subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip(),
            "cores": os.cpu_count(),
            "prompt_tokens": n_tokens,
            "remote_pages": depth,
            "remote_bytes": sum(map(len, pages)),
            "cold_s": cold_s,
            "l3_restore_s": l3_s,
            "push_s": push_s,
            "remote_fetch_s": fetch_s,
            "remote_fetch_vs_cold": fetch_m / cold_m,
            "remote_vs_l3_upper": (fetch_m + l3_m) / l3_m,
            "remote_vs_cold_upper": (fetch_m + l3_m) / cold_m,
        }
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
