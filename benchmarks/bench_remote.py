"""The remote tier's storage costs on a real loopback ``redis-server`` (model-free).

A 2k-token prefix of SmolLM2-135M pages (16 pages of 128 tokens: 30 layers x 2 x 192 F16 values
a token, 2.95 MB a page, 47 MB in all; random bytes, as incompressible as K/V mantissas) is

- pushed once (bytes out), then again (a repeat push: page bytes out must be 0);
- matched (one pipelined round trip) and fetched (pipelined batches, every page verified),
  against an L3 read of the same prefix (the same pages recorded into a ``DiskTier``, codec
  ``none`` and ``zstd``);
- asked for while the server is down and the breaker is open: the added cost of a ``match`` plus
  a ``fetch`` per request (target: at most 1 ms).

Usage::

    .venv/bin/python benchmarks/bench_remote.py [--repeats 5] [--out benchmarks/results/remote_tier.json]

Needs ``redis-server`` (or ``valkey-server``) on PATH and the ``remote`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from skippy_llama.config import L3Settings, RemoteSettings
from skippy_llama.identity import chain_key, token_bytes
from skippy_llama.tiers.disk import DiskTier
from skippy_llama.tiers.records import PageBlob, PrefixRecord
from skippy_llama.tiers.remote import RemoteStore

ROOT = Path(__file__).resolve().parent.parent
PAGE_TOKENS = 128
TOKEN_BYTES = 30 * 2 * 192 * 2  # SmolLM2-135M: layers x (K, V) x n_embd_k_gqa x F16
N_PAGES = 16  # 2048 tokens


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        sys.exit("bench_remote: no redis-server or valkey-server on PATH")
    port = free_port()
    argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*argv, "--dir", str(directory)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    ping_until_up(url)
    return proc, url


def ping_until_up(url: str) -> None:
    """Wait (up to 30 s) until the server just started at ``url`` answers a PING."""
    client = redis.Redis.from_url(url)
    for _ in range(600):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    client.close()


def make_record() -> tuple[PrefixRecord, list[bytes]]:
    root = bytes(range(16))
    pages, keys = [], []
    parent = root
    for i in range(N_PAGES):
        tokens = list(range(i * PAGE_TOKENS, (i + 1) * PAGE_TOKENS))
        key = chain_key(parent, tokens)
        payload = b"SKPG" + os.urandom(PAGE_TOKENS * TOKEN_BYTES - 4)
        pages.append(PageBlob(key, parent, PAGE_TOKENS, token_bytes(tokens), payload, PAGE_TOKENS))
        keys.append(key)
        parent = key
    return PrefixRecord(root.hex(), "bench", "bench", PAGE_TOKENS * N_PAGES, tuple(pages)), keys


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/remote_tier.json")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    proc, url = start_server(scratch)
    secret = scratch / "remote.key"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    record, keys = make_record()
    root = bytes.fromhex(record.cache_identity)
    payloads = [page.data for page in record.pages]
    out: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "server": None,
        "prefix": {"tokens": record.n_tokens, "pages": N_PAGES, "bytes": sum(map(len, payloads))},
    }
    try:
        tier = RemoteStore(RemoteSettings(url=url, secret_file=secret), clock=time.monotonic)
        out["server"] = tier.server_status()["version"]
        t0 = time.perf_counter()
        first = tier.push(record)
        push_s = time.perf_counter() - t0
        repeat_s, again = timed(lambda: tier.push(record), args.repeats)
        match_s, depth = timed(lambda: tier.match(root, keys), args.repeats)
        fetch_s, pages = timed(lambda: tier.fetch(keys, root=root), args.repeats)
        assert depth == N_PAGES and pages == payloads, "remote round trip is wrong"
        out["remote"] = {
            "push_s": push_s,
            "push_page_bytes": first.bytes_sent,
            "repeat_push_s": repeat_s,
            "repeat_push_page_bytes": again.bytes_sent,
            "match_s": match_s,
            "fetch_s": fetch_s,
            "fetch_MB_per_s": out["prefix"]["bytes"] / fetch_s / 1e6,
        }
        out["l3"] = {}
        for codec in ("none", "zstd"):
            directory = scratch / f"l3-{codec}"
            settings = L3Settings(
                mode="fixed",
                budget="1GiB",
                directory=directory,
                minimum_free="1GiB",
                compression=codec,
                policy="lru",
            )
            with DiskTier(settings, close_at_exit=False) as disk:
                disk.record(record)
                disk.flush(120)
                read_s, got = timed(
                    lambda disk=disk: [bytes(p) for p in disk.read(keys)], args.repeats
                )
                assert got == payloads, f"L3 ({codec}) read is wrong"
            out["l3"][codec] = {"read_s": read_s}
        # the server goes away: the breaker opens after 3 failures, then a request costs
        proc.kill()
        proc.wait()
        down = RemoteStore(RemoteSettings(url=url, secret_file=secret, timeout_ms=100))
        for _ in range(3):
            down.match(root, keys)
        assert down.status()["breaker"]["state"] == "open"
        calls = 10_000
        t0 = time.perf_counter()
        for _ in range(calls):
            down.match(root, keys)
            down.fetch(keys, root=root)
        per_request = (time.perf_counter() - t0) / calls
        out["breaker_open"] = {
            "per_request_s": per_request,
            "calls": calls,
            "failures": down.status()["failures"],
        }
        down.close()
        tier.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
