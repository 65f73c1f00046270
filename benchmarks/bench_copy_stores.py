"""Host copies in the pattern of an L2 restore's per-layer cell copies (issue 45, patch 0007).

Compiles ``copy_stores.c`` (gcc or cc on PATH; x86-64 with AVX2) and runs it: the K/V of
``--cells`` cells of a SmolLM2-135M-shaped cache (30 layers, K rows of 384 bytes, V transposed
as with flash attention off: 192 rows of 2-byte elements) copied from a host arena of
``--arena-cells`` cells into KV tensors of ``--kv-cells`` cells, as patch 0006 does, by

- ``pattern_memcpy``: memcpy per row, what ``ggml_backend_tensor_set_2d`` does on the CPU;
- ``pattern_stream``: streaming (non-temporal) AVX2 stores, what patch 0007 does;
- ``*_2threads``: the same with the layers split over two threads (the split issue 45 asked
  about: it needs both cores free);
- ``memcpy_flat`` / ``stream_flat``: one flat copy of the same bytes;

the arms alternating, ``--repeats`` times each; then per size (256 KiB up to the whole) a flat
copy followed by one read of the copy (what the next decode does), memcpy vs streaming stores:
the rule for patch 0007's threshold. ``--boost N`` runs the program at niceness ``-N`` (root
only), as ``bench_arena.py`` does its timed requests. Writes JSON with the load average.

    python benchmarks/bench_copy_stores.py --out benchmarks/results/copy-stores-s49.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def build(out_dir: Path) -> Path:
    """``copy_stores.c`` compiled into ``out_dir`` (-O2, no -march: AVX2 by target attribute)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit("bench_copy_stores: no C compiler (gcc or cc) on PATH")
    exe = out_dir / "copy_stores"
    subprocess.run(
        [cc, "-O2", "-o", str(exe), str(HERE / "copy_stores.c"), "-lpthread"], check=True
    )
    return exe


def run(exe: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run of the program: its JSON, with the load average before and after."""
    cmd = [
        str(exe),
        *(str(v) for v in (args.cells, args.kv_cells, args.arena_cells, args.layers)),
        *(str(v) for v in (args.k_row, args.v_embd, args.v_elem, args.repeats)),
    ]
    if args.boost:
        cmd = ["nice", "-n", str(-args.boost), *cmd]
    before = os.getloadavg()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    result["load_avg"] = [round(v, 2) for v in (*before, *os.getloadavg())]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=3900)
    parser.add_argument("--kv-cells", type=int, default=5120)
    parser.add_argument("--arena-cells", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--k-row", type=int, default=384)
    parser.add_argument("--v-embd", type=int, default=192)
    parser.add_argument("--v-elem", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--runs", type=int, default=3, help="program runs (fresh processes)")
    parser.add_argument("--boost", type=int, default=0, help="niceness -N for the program")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="copy-stores-") as tmp:
        exe = build(Path(tmp))
        runs = [run(exe, args) for _ in range(args.runs)]
    out: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "args": vars(args) | {"out": str(args.out)},
    }
    out["runs"] = runs
    for r in runs:
        print(
            f"load {r['load_avg']}: {r['bytes'] / 1e6:.1f} MB, pattern memcpy "
            f"{r['pattern_memcpy']['median_ms']:.2f} ms vs streamed "
            f"{r['pattern_stream']['median_ms']:.2f} ms (2 threads "
            f"{r['pattern_memcpy_2threads']['median_ms']:.2f} / "
            f"{r['pattern_stream_2threads']['median_ms']:.2f}), flat memcpy "
            f"{r['memcpy_flat']['median_ms']:.2f} / streamed {r['stream_flat']['median_ms']:.2f}"
        )
        for s in r["sizes"]:
            print(
                f"  {s['bytes'] >> 10:>6} KiB: memcpy {s['memcpy']['median_ms']:.3f} "
                f"(+read {s['memcpy_then_read']['median_ms']:.3f}) vs stream "
                f"{s['stream']['median_ms']:.3f} (+read {s['stream_then_read']['median_ms']:.3f}) ms"
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
