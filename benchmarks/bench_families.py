"""The matrix's architecture-family rows as a benchmark result (issue 46): per family and tier
(L1, L2, L3 after a restart, remote with an empty L3, a bundle imported into an empty L3),
where the answer came from, whether it equals a cold plain ``Llama`` bit for bit, and its TTFT
÷ cold (one request per tier: a measurement of this run, noisy on a shared machine). The rows
are ``skippy_llama.matrix.families``'s (``skippy-llama matrix --families``), without the
SmolLM2 matrix around them.

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_families.py \\
        --redis-server /usr/bin/redis-server --out benchmarks/results/families.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import llama_cpp
from bench_restore_points import _start_redis
from patched_common import provenance

from skippy_llama.matrix.families import available_families, run_families

_quiet = llama_cpp.llama_log_callback(lambda *_: None)  # kept: llama.cpp holds the pointer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", help="comma-separated (default: all installed)")
    parser.add_argument("--redis-server", metavar="BIN", help="the remote column's server")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    llama_cpp.llama_log_set(_quiet, None)
    scratch = Path(tempfile.mkdtemp(prefix="bench-families-"))
    server = None
    try:
        remote = None
        if args.redis_server:
            server, url, secret = _start_redis(args.redis_server, scratch)
            remote = (url, secret)
        wanted = args.families.split(",") if args.families else None
        families = available_families(scratch / "models", wanted)
        report = run_families(families, scratch, remote=remote)
        result = {**provenance("bench_families.py"), **report}
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
