"""CacheGen pages in L3, end to end, side by side with native pages (issue 33's benchmark).

For ``l3.codec`` = native and = cachegen (SmolLM2, F16 K/V, CPU):

1. process 1 (SkippyLlama, L3 fixed on a fresh directory, L1 off): ``--prompts`` prompts of about
   2,048 tokens (distinct documents cut from this repository's README and benchmark notes) are
   completed (one token), so their pages are written to L3 by the writer thread; the writer's
   encode time and the stored bytes per token come from L3's counters;
2. process 2 (fresh, same directory): each prompt again with another last line: the prefix is
   restored from L3 (read, verified, decoded, assembled, ``set_data``), the rest prefilled; the
   time to first token (``create_completion`` with ``max_tokens=1``) is compared with a cold
   prefill of the same prompt by plain ``llama_cpp.Llama`` in the same process.
3. overhead where nothing is reused (same process, interleaved): ``--overhead`` distinct
   prompts of ~400 tokens with 32 generated tokens each, SkippyLlama (L3 on, the codec under test)
   against plain ``llama_cpp.Llama``: total request time ratio (the writer encodes after the
   reply, in the background, at a lower thread priority).

The cachegen run uses the roster's ``cachegen`` row for this model and layout; without a passing
row the codec would store native pages, so ``--params K,K,K/V,V,V`` forces a parameter set (the
result is then labelled unqualified: a measurement of cost, not of a qualified configuration).

Usage::

    .venv/bin/python benchmarks/bench_cachegen_l3.py [--prompts 4] [--overhead 6]
        [--params 6,6,6/6,6,6] [--out benchmarks/results/cachegen-l3.json]
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(ROOT))
PREFIX_TOKENS = 2048
OVERHEAD_TOKENS = 400
QUESTION = "\n\nQuestion {i}: in one sentence, what does the text above say about {topic}?\n"
TOPICS = ("restores", "pages", "the disk tier", "benchmarks", "CacheGen", "identity")


def _documents(llm: Any, n: int, tokens: int) -> list[str]:
    sources = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    text = "\n".join(s.read_text("utf-8") for s in sources)
    ids = llm.tokenize(text.encode(), add_bos=False)
    docs = []
    for i in range(n):
        chunk = ids[i * tokens : (i + 1) * tokens]
        if len(chunk) < tokens:
            raise SystemExit("not enough text for the prompts")
        docs.append(llm.detokenize(chunk).decode("utf-8", "replace"))
    return docs


def _force(params: str | None) -> None:
    """Make the identity builder choose ``params`` as if the roster qualified them."""
    if not params:
        return
    from skippy_llama.codecs.cachegen import CacheGenParams
    from skippy_llama.roster import CacheGenRow, load_roster
    from skippy_llama.runtime import identity_params, native

    k, v = (tuple(int(b) for b in part.split(",")) for part in params.split("/"))
    forced = CacheGenParams(k, v, group_tokens=128)
    # identity_params imports load_roster from skippy_llama.roster: the name it calls is its own
    real = identity_params.load_roster  # type: ignore[attr-defined]

    def patched() -> Any:
        import dataclasses

        roster = real()
        assert roster is not None

        def rows(digest: str, layout: str) -> Any:
            row = CacheGenRow(
                "forced", digest, native.backend_name(), layout, "F16", "F16", False,
                forced.identity(), {"size_ratio": 0.0}, "forced by bench_cachegen_l3 --params",
            )  # fmt: skip
            return dataclasses.replace(roster, cachegen=(row,))

        class Forced:
            def cachegen_row(self, digest: str, backend: str, layout: str) -> Any:
                return rows(digest, layout).cachegen_row(digest, backend, layout)

        return Forced()

    identity_params.load_roster = patched  # type: ignore[attr-defined,assignment]
    del load_roster


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    from skippy_llama import SkippyLlama
    from skippy_llama.config import Settings
    from skippy_llama.models import default_model_path

    _force(spec.get("params"))
    settings = Settings(
        l1={"enabled": False},
        l3={"mode": "fixed", "budget": "4GiB", "directory": spec["dir"], "minimum_free": "1GiB",
            "codec": spec["codec"], "compression": "zstd"},
    )  # fmt: skip
    model = str(default_model_path())
    kw: dict[str, Any] = {
        "n_ctx": 4096,
        "n_batch": 512,
        "verbose": False,
        "seed": 1,
        "n_threads": 2,
    }
    llm = SkippyLlama(model, cache_settings=settings, **kw)
    disk = llm.prefix_cache.disk
    assert disk is not None
    out: dict[str, Any] = {"identity_codec": llm.cache_identity.codec_name}
    docs = _documents(llm, spec["prompts"], PREFIX_TOKENS)
    if spec["phase"] == "write":
        for doc in docs:
            llm.create_completion(doc + QUESTION.format(i=0, topic=TOPICS[0]), max_tokens=1)
        assert disk.flush(300)
        counters = disk._parts.counters
        out["stored_bytes"] = counters.get("bytes_written")
        out["native_bytes"] = counters.get("encoded_bytes")
        out["pages"] = counters.get("writes")
        out["encode_ms_per_page"] = counters.get("encode_us") / 1e3 / max(1, out["pages"])
        out["tokens"] = sum(
            len(llm.tokenize((d + QUESTION.format(i=0, topic=TOPICS[0])).encode())) for d in docs
        )
        out["codec_summary"] = disk.codec_summary()
    elif spec["phase"] == "restore":
        plain = llama_cpp.Llama(model, **kw)
        warm, cold, events = [], [], []
        for i, doc in enumerate(docs):
            prompt = doc + QUESTION.format(i=1, topic=TOPICS[1 + i % 5])
            t = time.perf_counter()
            llm.create_completion(prompt, max_tokens=1)
            warm.append(time.perf_counter() - t)
            event = llm.last_cache_event
            assert event is not None
            events.append(event.to_dict())
            plain.reset()
            plain._ctx.kv_cache_clear()
            t = time.perf_counter()
            plain.create_completion(prompt, max_tokens=1)
            cold.append(time.perf_counter() - t)
        out.update(warm_s=warm, cold_s=cold, events=events)
        plain.close()
    else:  # overhead: nothing is reused
        plain = llama_cpp.Llama(model, **kw)
        texts = _documents(llm, spec["prompts"] * 2, OVERHEAD_TOKENS)[spec["prompts"] :]
        mine, theirs = [], []
        for i, doc in enumerate(texts):
            prompt = doc + QUESTION.format(i=i, topic=TOPICS[i % 6])
            t = time.perf_counter()
            llm.create_completion(prompt, max_tokens=32)
            mine.append(time.perf_counter() - t)
            plain.reset()
            plain._ctx.kv_cache_clear()
            t = time.perf_counter()
            plain.create_completion(prompt, max_tokens=32)
            theirs.append(time.perf_counter() - t)
        assert disk.flush(300)
        out.update(
            skippy_s=mine, plain_s=theirs, cachegen_pages=disk._parts.counters.get("cachegen_pages")
        )
        plain.close()
    llm.close()
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
        "import bench_cachegen_l3 as b; "
        "print('RESULT ' + json.dumps(b.worker(json.loads(sys.argv[1]))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])  # type: ignore[no-any-return]
    raise RuntimeError(f"worker failed:\n{proc.stdout}\n{proc.stderr}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--overhead", type=int, default=6)
    parser.add_argument("--params", default=None, help="force CacheGen bits K/V, e.g. 6,6,6/6,6,6")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cachegen-l3.json")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for codec in ("native", "cachegen"):
        with tempfile.TemporaryDirectory() as tmp:
            base = {"codec": codec, "dir": str(Path(tmp) / "l3"), "prompts": args.prompts}
            if codec == "cachegen":
                base["params"] = args.params
            wrote = run({**base, "phase": "write"})
            restored = run({**base, "phase": "restore"})
            over = run({**base, "phase": "overhead", "prompts": args.overhead})
        ratios = [w / c for w, c in zip(restored["warm_s"], restored["cold_s"], strict=True)]
        results[codec] = {
            "identity_codec": wrote["identity_codec"],
            "bytes_per_token": round(wrote["stored_bytes"] / wrote["tokens"], 1),
            "stored_over_native": round(wrote["stored_bytes"] / max(1, wrote["native_bytes"]), 4),
            "encode_ms_per_page": round(wrote["encode_ms_per_page"], 2),
            "warm_ttft_s": [round(x, 3) for x in restored["warm_s"]],
            "cold_ttft_s": [round(x, 3) for x in restored["cold_s"]],
            "warm_over_cold_median": round(statistics.median(ratios), 3),
            "restore_events": restored["events"],
            "overhead_request_ratio": round(sum(over["skippy_s"]) / sum(over["plain_s"]), 3),
            "overhead_detail": over,
            "write_detail": wrote,
        }
        print(
            codec,
            json.dumps(
                {
                    k: v
                    for k, v in results[codec].items()
                    if "detail" not in k and k != "restore_events"
                }
            ),
            flush=True,
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    doc = {
        "command": " ".join(["benchmarks/bench_cachegen_l3.py", *sys.argv[1:]]),
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "model": "SmolLM2-135M-Instruct Q4_1, F16 K/V, flash attention off, n_ctx 4096, 2 threads",
        "forced_params": args.params,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
