"""Remote restore over a shaped link: CacheGen pages against native pages (issue 43.4).

A local ``redis-server`` sits behind a throttling TCP proxy written here (asyncio, no root, its
own process so it never competes with the restore for the GIL): every byte in each direction
leaves the proxy no sooner than a link of ``--links`` (Mbit/s) would have serialized it, one
link per direction shared by all connections. Loopback latency only: the link's bandwidth is
what is shaped. The proxy's achieved rate is measured first (one large GET through it) and
recorded.

Per repeat, a new 2k-token prompt (a window of this repository's documents, so that nothing is
cached between repeats):

- ``cold_s``: plain ``llama_cpp.Llama``'s time to the first token of the prompt;
- node A (native) and node A' (``remote.codec = "cachegen"``) answer the prompt, each with its
  own L3 directory; their L3 writers push the pages to the server directly (not through the
  proxy: pushing is set-up here);
- per link, a fresh node B (empty L3, the server reached through that link's proxy) answers the
  prompt from the remote tier, once native and once CacheGen: ``native_s``, ``cachegen_s``,
  their ratio, the bytes each fetched, and the tier and tokens the restore served.

The CacheGen parameters are ``--bits`` for every layer third, K and V (``--k-bits`` /
``--v-bits`` for other sets); the roster row that makes them the instance's codec is planted
for the benchmark (as the integration tests do), and whether the real roster qualifies the model
and layout is recorded beside it. The quality gate (``skippy_llama/codecs/quality.py``) is
then measured on the same prompts teacher-forced: each prompt's 2,048-token prefix restored from
native pages and from the codec's pages (encoded and decoded as the remote tier does), the next
64 tokens scored against each other (next-token argmax agreement, mean KL, perplexity rise).

Usage (needs ``redis-server`` or ``valkey-server`` on PATH, the ``remote`` and ``cachegen``
extras)::

    .venv/bin/python benchmarks/bench_remote_cachegen.py [--repeats 3] [--links 1000 100]
        [--bits 6] [--out benchmarks/results/remote-cachegen.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

from cachegen_common import commit, load_average, qualifier  # noqa: E402

#: bytes the proxy reads and forwards at a time: large, so a loaded machine's Python keeps up
CHUNK = 256 << 10


# ------------------------------------------------------------------------------ the proxy


class Link:
    """One direction of a link of ``mbit`` Mbit/s: a byte leaves when the link has serialized
    every byte before it (a virtual clock, so sleeping late never lowers the rate it averages)."""

    def __init__(self, mbit: float) -> None:
        self.bytes_per_s = mbit * 1e6 / 8
        self.free_at = 0.0

    async def carry(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        self.free_at = max(now, self.free_at) + n / self.bytes_per_s
        if self.free_at > now:
            await asyncio.sleep(self.free_at - now)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    try:
        while data := await reader.read(CHUNK):
            await link.carry(len(data))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def _serve(listen: int, target: int, mbit: float) -> None:
    up, down = Link(mbit), Link(mbit)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, server_writer, up), _pump(server_reader, writer, down))

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def start_proxy(listen: int, target: int, mbit: float) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--proxy", str(listen), str(target), str(mbit)],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        raise RuntimeError("the throttling proxy did not start")
    return proc


def measure_link(direct: str, shaped: str, megabytes: int = 16) -> float:
    """Mbit/s one GET of a ``megabytes`` value achieves through the proxy (``shaped``; the
    server's own URL as ``shaped`` measures the unshaped loopback)."""
    import redis

    value = os.urandom(megabytes << 20)
    with redis.Redis.from_url(direct) as client:
        client.set(b"bench:link", value)
    with redis.Redis.from_url(shaped, socket_timeout=600) as client:
        client.ping()
        started = time.perf_counter()
        got = client.get(b"bench:link")
        seconds = time.perf_counter() - started
    assert got == value
    with redis.Redis.from_url(direct) as client:
        client.delete(b"bench:link")
    return len(value) * 8 / seconds / 1e6


# ------------------------------------------------------------------------------ the benchmark


def _plant(params: Any) -> None:
    """Make ``params`` the cachegen row of whatever model and layout asks (this process)."""
    from skippy_llama.roster import CacheGenRow
    from skippy_llama.runtime import identity_params

    class Planted:
        def cachegen_row(self, digest: str, backend: str, layout: str) -> CacheGenRow:
            return CacheGenRow(
                "bench", digest, backend, layout, "F16", "F16", False, params.identity(),
                {"argmax_agree": 0.0, "mean_kl": 0.0, "ppl_rise": 0.0, "size_ratio": 0.0},
            )  # fmt: skip

    setattr(identity_params, "load_roster", Planted)  # noqa: B010 (a module attribute, replaced)


def _roster_row(llm: Any) -> dict[str, Any] | None:
    """What the real roster says about this model's F16 layout, for the record."""
    from skippy_llama.identity import file_digest
    from skippy_llama.roster import load_roster

    digest = file_digest(llm.model_path)
    roster = load_roster()
    for row in roster.cachegen if roster is not None else ():
        if row.model_digest == digest and not row.flash_attn and row.type_k == "F16":
            return {"params": row.params, "reason": row.reason}
    return None


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, str]:
    started = time.perf_counter()
    done = llm.create_completion(prompt, max_tokens=1, temperature=0.0)
    return time.perf_counter() - started, str(done["choices"][0]["text"])


def _node(model: str, store: Path, url: str, secret: Path, codec: str) -> Any:
    from skippy_llama.config import Settings
    from skippy_llama.costs import AlwaysRestore
    from skippy_llama.runtime.llama import SkippyLlama

    settings = Settings(
        l1={"enabled": False},
        l3={"mode": "fixed", "budget": "4GiB", "directory": str(store), "minimum_free": "1GiB"},
        remote={"url": url, "secret_file": str(secret), "codec": codec, "timeout_ms": 60_000},
    )
    return SkippyLlama(
        model, n_ctx=4096, verbose=False, seed=0, cache_settings=settings,
        cost_model=AlwaysRestore(),
    )  # fmt: skip


def _answer(
    model: str, store: Path, url: str, secret: Path, codec: str, prompt: list[int]
) -> dict[str, Any]:
    llm = _node(model, store, url, secret, codec)
    try:
        seconds, text = _ttft(llm, prompt)
        event = llm.last_cache_event
        assert event is not None
        remote = llm.prefix_cache.status()["remote"]["activity"]
        fetched = {k: remote[k] for k in ("bytes_in", "pages_fetched", "cachegen_pages_fetched")}
        assert llm.flush_cache(600)  # A's push (B's finds every page present)
        pushed = llm.prefix_cache.status()["remote"]["activity"]["bytes_out"]
        identity = llm.cache_identity.codec_name
    finally:
        llm.close()
    return {
        "ttft_s": round(seconds, 4),
        "text": text,
        "tier": event.tier,
        "cached_tokens": event.cached_tokens,
        "codec": identity,
        "pushed_bytes": pushed,
        **fetched,
    }


def quality(model: str, windows: list[list[int]], prefix: int, params: Any) -> dict[str, Any]:
    """The gate's figures on the benchmark's own prompts (see the module docstring)."""
    import llama_cpp

    q = qualifier()
    from skippy_llama.codecs.quality import GATE, Quality, Scores

    q.PREFIX_PAGES = prefix // q.PAGE
    llm = llama_cpp.Llama(
        model, n_ctx=prefix + q.SCORED + 64, logits_all=True, verbose=False, seed=0
    )
    scores = Scores()
    stored = native_bytes = 0
    try:
        for tokens in windows:
            sections = q._capture(llm, tokens[:prefix])
            ref = q._teacher_forced(llm, sections, tokens)
            lossy, s, n = q._lossy(sections, params)
            stored += s
            native_bytes += n
            scores.add(ref, q._teacher_forced(llm, lossy, tokens), tokens[prefix + 1 :])
    finally:
        llm.close()
    # one set of prompts: the perplexity is of the same positions (no separate held-out texts)
    figures = Quality.of(scores, scores)
    return {
        "positions": scores.positions,
        "argmax_agree": round(figures.agree_share, 5),
        "mean_kl": round(figures.mean_kl, 6),
        "max_kl": round(scores.max_kl, 4),
        "ppl_rise": round(figures.ppl_rise, 5),
        "size_ratio": round(stored / native_bytes, 4),
        "gate_failures": figures.failures(GATE),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--links", type=float, nargs="+", default=[1000.0, 100.0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--bits", type=int, default=6)
    parser.add_argument("--k-bits", type=int, nargs=3, default=None)
    parser.add_argument("--v-bits", type=int, nargs=3, default=None)
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import llama_cpp
    from bench_remote import free_port, start_server

    q = qualifier()
    SCORED, texts = q.SCORED, q.texts

    from skippy_llama.codecs.cachegen import CacheGenParams
    from skippy_llama.models import default_model_path

    params = CacheGenParams(
        tuple(args.k_bits or (args.bits,) * 3), tuple(args.v_bits or (args.bits,) * 3)
    )
    model = str(default_model_path())
    rows: list[dict[str, Any]] = []
    links: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server, direct = start_server(work)
        port = int(direct.rsplit(":", 1)[1].split("/")[0])
        proxies: dict[float, tuple[subprocess.Popen[bytes], str]] = {}
        try:
            links["loopback"] = round(measure_link(direct, direct), 1)
            for mbit in args.links:
                listen = free_port()
                proxies[mbit] = (start_proxy(listen, port, mbit), f"redis://127.0.0.1:{listen}/0")
                links[f"{mbit:g}"] = round(measure_link(direct, proxies[mbit][1]), 1)
            print(json.dumps({"measured_link_mbit": links}), flush=True)
            secret = work / "remote.key"
            secret.write_bytes(os.urandom(32))
            secret.chmod(0o600)
            plain = llama_cpp.Llama(model, n_ctx=4096, verbose=False, seed=0)
            windows = texts(plain, args.repeats, args.tokens + SCORED + 1, held_out=False)
            roster = _roster_row(plain)
            _plant(params)
            for repeat, window in enumerate(windows):
                prompt = window[: args.tokens]
                plain.reset()
                cold_s, want = _ttft(plain, prompt)
                row: dict[str, Any] = {"repeat": repeat, "prompt_tokens": len(prompt)}
                row["cold_s"] = round(cold_s, 4)
                a = {
                    codec: _answer(model, work / f"a-{codec}-{repeat}", direct, secret, codec,
                                   prompt)
                    for codec in ("native", "cachegen")
                }  # fmt: skip
                row["node_a"] = {c: {k: a[c][k] for k in ("tier", "codec", "pushed_bytes")}
                                 for c in a}  # fmt: skip
                for mbit, (_, shaped) in proxies.items():
                    b = {
                        codec: _answer(model, work / f"b-{codec}-{repeat}-{mbit:g}", shaped,
                                       secret, codec, prompt)
                        for codec in ("native", "cachegen")
                    }  # fmt: skip
                    row[f"link_{mbit:g}"] = {
                        "native": b["native"],
                        "cachegen": b["cachegen"],
                        "cachegen_vs_native": round(
                            b["cachegen"]["ttft_s"] / b["native"]["ttft_s"], 3
                        ),
                        "native_vs_cold": round(b["native"]["ttft_s"] / cold_s, 3),
                        "cachegen_vs_cold": round(b["cachegen"]["ttft_s"] / cold_s, 3),
                        "native_output_equals_cold": b["native"]["text"] == want,
                        "cachegen_output_equals_cold": b["cachegen"]["text"] == want,
                    }
                print(json.dumps(row), flush=True)
                rows.append(row)
            plain.close()
        finally:
            for proc, _ in proxies.values():
                proc.kill()
            server.kill()
        gate = None if args.no_quality else quality(model, windows, args.tokens, params)
    summary: dict[str, Any] = {"cold_s_median": statistics.median(r["cold_s"] for r in rows)}
    for mbit in args.links:
        key = f"link_{mbit:g}"
        summary[key] = {
            "cachegen_vs_native_median": statistics.median(
                r[key]["cachegen_vs_native"] for r in rows
            ),
            "native_s_median": statistics.median(r[key]["native"]["ttft_s"] for r in rows),
            "cachegen_s_median": statistics.median(r[key]["cachegen"]["ttft_s"] for r in rows),
            "all_restored_remote": all(
                r[key][c]["tier"] == "remote" for r in rows for c in ("native", "cachegen")
            ),
            "native_outputs_equal_cold": all(r[key]["native_output_equals_cold"] for r in rows),
        }
    doc = {
        "benchmark": "bench_remote_cachegen",
        "command": " ".join(["benchmarks/bench_remote_cachegen.py", *sys.argv[1:]]),
        "commit": commit(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "load": load_average(), "threads": os.environ.get("LLCPP_FORCE_THREADS")},
        "params": params.identity(),
        "roster_row_planted": True,
        "real_roster_row": roster,
        "measured_link_mbit": links,
        "quality_on_these_prompts": gate,
        "rows": rows,
        "summary": summary,
    }  # fmt: skip
    print(json.dumps({"summary": summary, "quality": gate}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n", "utf-8")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--proxy":
        asyncio.run(_serve(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
        raise SystemExit(0)
    raise SystemExit(main())
