"""CacheGen page codec on real SmolLM2 pages: stored size, encode and decode speed, per coder.

Captures the K/V state of a 2,048-token prompt (this repository's README) with plain llama_cpp,
cuts it into 128-token native pages, and for each parameter set and entropy coder measures:

- ``size_ratio``: stored bytes / native page bytes (F16 K/V: the ``none`` codec's size);
- ``encode_ms``: encoding one page (the L3 writer thread's cost);
- ``decode_gbps_1t``: native page bytes decoded per second, one thread, into a reused buffer;
- ``decode_gbps_2t``: the same with two threads decoding different pages (as the L3 reader does
  for a restore of several pages);
- ``max_abs_err`` / ``rel_rms_err``: the values' error against the native page.

The lossless codec (byte-shuffle + zstd, ``l3.compression = zstd``) is measured beside them.
The machine is shared: each row's timings are the median of ``--repeats`` passes over all pages.

Usage::

    .venv/bin/python benchmarks/bench_cachegen.py [--repeats 5] [--flash-attn]
        [--out benchmarks/results/cachegen-codec.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy_llama.codecs import cachegen, lossless  # noqa: E402
from skippy_llama.codecs.cachegen import CacheGenParams  # noqa: E402
from skippy_llama.state import cut_pages, parse_state  # noqa: E402

SETS = [
    CacheGenParams((8, 8, 8), (8, 8, 8), group_tokens=128),
    CacheGenParams((7, 7, 7), (7, 7, 7), group_tokens=128),
    CacheGenParams((6, 6, 6), (6, 6, 6), group_tokens=128),
    CacheGenParams((6, 6, 6), (5, 5, 5), group_tokens=128),
    CacheGenParams((5, 5, 5), (5, 5, 5), group_tokens=128),
    CacheGenParams((4, 4, 4), (4, 4, 4), group_tokens=128),
    CacheGenParams((4, 3, 3), (4, 3, 3), group_tokens=128),
    CacheGenParams((3, 3, 3), (3, 3, 3), group_tokens=128),
    # anchors every 16 / 32 tokens (the paper's deltas) against one per page
    CacheGenParams((6, 6, 6), (6, 6, 6), group_tokens=16),
    CacheGenParams((6, 6, 6), (6, 6, 6), group_tokens=32),
    # one step per matrix instead of per channel
    CacheGenParams((6, 6, 6), (6, 6, 6), group_tokens=128, step="layer"),
    CacheGenParams((4, 4, 4), (4, 4, 4), group_tokens=128, step="layer"),
    # constriction's ANS (one categorical model per matrix) against zstd's literal coding
    CacheGenParams((6, 6, 6), (6, 6, 6), group_tokens=128, coder="ans"),
    CacheGenParams((4, 4, 4), (4, 4, 4), group_tokens=128, coder="ans"),
]


def capture(flash_attn: bool, n_tokens: int) -> bytes:
    import llama_cpp

    from skippy_llama.models import default_model_path

    llm = llama_cpp.Llama(
        str(default_model_path()), n_ctx=4096, n_batch=512, flash_attn=flash_attn, verbose=False
    )
    try:
        tokens = llm.tokenize((ROOT / "README.md").read_text("utf-8").encode())[:n_tokens]
        llm.eval(tokens)
        size = int(llama_cpp.llama_state_seq_get_size(llm.ctx, 0))
        buf = (ctypes.c_uint8 * size)()
        n = int(llama_cpp.llama_state_seq_get_data(llm.ctx, buf, size, 0))
        return bytes(buf)[:n]
    finally:
        llm.close()


def _values(page: bytes | bytearray, head: int) -> np.ndarray[Any, Any]:
    return np.frombuffer(page, np.uint8)[head:].view(np.float16).astype(np.float32)


def measure(pages: list[bytes], params: CacheGenParams | None, repeats: int) -> dict[str, Any]:
    native = sum(map(len, pages))
    enc_times: list[float] = []
    stored: list[bytes] = []
    for _ in range(repeats):
        t = time.perf_counter()
        stored = [
            cachegen.encode(p, params) if params else lossless.encode(p, "zstd") for p in pages
        ]
        enc_times.append((time.perf_counter() - t) / len(pages))
    outs = [bytearray(len(p)) for p in pages]

    def dec(i: int) -> None:
        if params is None:
            outs[i][:] = lossless.decode(stored[i], None)
        else:
            cachegen.decode_into(stored[i], memoryview(outs[i]))

    one, two = [], []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(repeats):
            t = time.perf_counter()
            for i in range(len(pages)):
                dec(i)
            one.append(time.perf_counter() - t)
            t = time.perf_counter()
            list(pool.map(dec, range(len(pages))))
            two.append(time.perf_counter() - t)
    head = 28 + 24 * 30  # SmolLM2: 30 layers, no cell ext
    errs = [_values(o, head) - _values(p, head) for o, p in zip(outs, pages, strict=True)]
    ref = np.concatenate([_values(p, head) for p in pages])
    err = np.concatenate(errs)
    return {
        "codec": params.describe() if params else "lossless zstd (l3.compression = zstd)",
        "params": params.identity() if params else None,
        "size_ratio": round(sum(map(len, stored)) / native, 4),
        "encode_ms": round(statistics.median(enc_times) * 1e3, 2),
        "decode_gbps_1t": round(native / statistics.median(one) / 1e9, 3),
        "decode_gbps_2t": round(native / statistics.median(two) / 1e9, 3),
        "max_abs_err": float(np.abs(err).max()),
        "rel_rms_err": float(np.sqrt(np.mean(err**2)) / np.sqrt(np.mean(ref**2))),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--flash-attn", action="store_true", help="V not transposed")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cachegen-codec.json")
    args = parser.parse_args()
    state = parse_state(capture(args.flash_attn, args.tokens))
    pages = [p.to_bytes() for p in cut_pages(state, 128, keep_tail=False)]
    rows = [measure(pages, None, args.repeats)]
    for params in SETS:
        rows.append(measure(pages, params, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    doc = {
        "command": " ".join(["benchmarks/bench_cachegen.py", *sys.argv[1:]]),
        "commit": commit,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "note": "shared 2-core machine: compare rows of one run, not across runs",
        "model": "SmolLM2-135M-Instruct Q4_1, F16 K/V, flash attention "
        + ("on (V rows)" if args.flash_attn else "off (V transposed)"),
        "pages": len(pages),
        "native_page_bytes": len(pages[0]),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
