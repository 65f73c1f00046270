"""The matrix report: ``matrix.json`` (everything), ``matrix.md`` (the tables) and PNG plots.

Markdown and plots are rendered from the JSON's rows only, so ``--replot`` can redraw them on
another machine (the GPU machine may lack matplotlib).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import TIER_DESCRIPTIONS
from .gates import DECODE_P99_MAX, GATES, RESTART_MAX, WRITE_AMP_MAX

GATE_TITLES = {
    "exact": "exact",
    "l3_onoff": "L3 on = off",
    "restart": f"restart ≤ {RESTART_MAX}",
    "write_amp": f"WA ≤ {WRITE_AMP_MAX}",
    "low_space": "low space → 0 writes",
    "prune_clear": "prune/clear → 0",
    "decode_p99": f"p99 decode ≤ +{DECODE_P99_MAX:.0%}",
}


def _num(value: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if value is None else fmt.format(value)


def _gate(value: bool | None) -> str:
    return "–" if value is None else ("pass" if value else "**FAIL**")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _served(counts: dict[str, int]) -> str:
    """Requests per tier, as ``l1:3 l3:1``."""
    return " ".join(f"{tier}:{n}" for tier, n in sorted(counts.items()))


def markdown(report: dict[str, Any]) -> str:
    """The Markdown tables of a report (cells, no-reuse overhead, portability, gate totals)."""
    lines = [
        f"# skippy-llama traffic matrix ({report['config']['preset']})",
        "",
        f"Model `{Path(report['model']).name}`, llama.cpp build `{report['build_backend']}`, "
        f"backends {', '.join(b['name'] for b in report['backends'])}; commit "
        f"`{report.get('commit') or 'unknown'}`; started {report.get('started', '?')}, "
        f"{report['seconds']:.0f} s. Ratios compare runs made side by side in this run (cold "
        "plain `Llama` first, then each tier). Decode Δ: the per-token gap against cold's, at "
        "the 99th percentile (the gate) and the median; with a few dozen gaps per cell the p99 "
        "is their maximum, so one stall of a shared machine fails it.",
        "",
        "Tiers: " + "; ".join(f"`{t}` = {d}" for t, d in TIER_DESCRIPTIONS.items()) + ".",
        "",
        "| backend | K/V | workload | tier | served by | cached/prompt | TTFT ÷ cold | "
        "restart ÷ cold | bytes stored | WA | p99 decode Δ | p50 decode Δ | "
        + " | ".join(GATE_TITLES[g] for g in GATES)
        + " |",
        "|" + "---|" * (13 + len(GATES)),
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['backend']} | {r['kv']} | {r['workload']} | {r['tier']} | {_served(r['served'])} | "
            f"{r['cached_tokens']}/{r['prompt_tokens']} | {_num(r['ttft_ratio'])} | "
            f"{_num(r['restart_ttft_ratio'])} | {_size(r['bytes_stored'])} | "
            f"{_num(r['write_amplification'], '{:.2f}')} | "
            f"{_num(r['decode_p99_slowdown'], '{:+.1%}')} | "
            f"{_num(r.get('decode_p50_slowdown'), '{:+.1%}')} | "
            + " | ".join(_gate(r["gates"][g]) for g in GATES)
            + " |"
        )
    if report.get("errors"):
        lines += ["", "**Failed steps** (their cells are missing from the table):", ""]
        lines += [
            f"- {e['backend']} {e['kv']} {e['step']}: `{e['error']}`" for e in report["errors"]
        ]
    lines += ["", "Gate totals (pass / fail / not applicable):", ""]
    for gate, t in report["gate_totals"].items():
        lines.append(f"- {GATE_TITLES[gate]}: {t['pass']} / {t['fail']} / {t['n/a']}")
    if report.get("noreuse"):
        lines += [
            "",
            "## Nothing to reuse: overhead against plain `Llama`",
            "",
            "Distinct one-shot prompts; `skippy` = SkippyLlama defaults (L1 on), `skippy_l3` = "
            "with L3 on as well.",
            "",
            "| backend | K/V | mode | requests | request time ÷ plain | TTFT ÷ plain | "
            "p99 decode Δ | outputs = plain |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in report["noreuse"]:
            lines.append(
                f"| {r['backend']} | {r['kv']} | {r['mode']} | {r['requests']} | "
                f"{_num(r['request_ratio'])} | {_num(r['ttft_ratio'])} | "
                f"{_num(r['decode_p99_slowdown'], '{:+.1%}')} | "
                f"{'yes' if r['outputs_equal_plain'] else '**no**'} |"
            )
    lines += ["", "## Cross-backend portability (`cross_backend`)", ""]
    port = report.get("portability")
    if not port:
        lines.append("Not run (pass `--portability`).")
    elif port.get("skipped"):
        lines.append(f"Skipped: {port['skipped']}")
    elif port.get("error"):
        lines.append(f"Failed: `{port['error']}`")
    else:
        lines += [
            "Pages captured on the source backend with `cross_backend` on, restored on the "
            "target backend; compared with the target's own cold prefill. `off` = L3 tokens "
            "the target reused with `cross_backend` off (must be 0).",
            "",
            "| from | to | K/V | requests | served by | greedy agreement | max abs Δ logit | off |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in port["rows"]:
            lines.append(
                f"| {r['source']} | {r['target']} | {r['kv']} | {r['requests']} | {_served(r['served'])} | "
                f"{r['agreement']:.2f} | {_num(r['max_abs_dlogit'], '{:.4g}')} | "
                f"{r['off_l3_cached_tokens']} |"
            )
    lines += families_markdown(report.get("families"))
    return "\n".join(lines) + "\n"


def families_markdown(fam: dict[str, Any] | None) -> list[str]:
    """The family rows (``families.py``): per architecture family and tier, where the answer
    came from and whether it equals a cold prefill."""
    lines = ["", "## Architecture families (restore points)", ""]
    if not fam:
        lines.append("Not run (pass `--families`).")
        return lines
    lines += [
        f"A {fam['doc_tokens']}-token document + {fam['question_tokens']}-token questions, "
        f"{fam['answer_tokens']} greedy tokens, beside a cold plain `Llama` (tokens and "
        "first-token logits compared bit for bit); TTFT ÷ cold is one request each, a "
        "measurement of this run.",
        "",
        "| family | memory | tier | served by | cached / prompt | exact | TTFT ÷ cold | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in fam["rows"]:
        exact = "-" if r["exact"] is None else ("yes" if r["exact"] else "**no**")
        lines.append(
            f"| {r['family']} | {r['memory']} | {r['tier']} | {r['served']} | "
            f"{r['cached_tokens']} / {r['prompt_tokens']} | {exact} | {_num(r['ttft_ratio'])} | "
            f"{r['note']} |"
        )
    for e in fam.get("errors", []):
        lines.append(f"\nFailed: {e['family']}: `{e['error']}`")
    return lines


def _bars(
    rows: Sequence[dict[str, Any]], key: str, ylabel: str, title: str, path: Path, **kw: Any
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(dict.fromkeys(f"{r['workload']}\n{r['tier']}" for r in rows))
    series = list(dict.fromkeys(f"{r['backend']} {r['kv']}" for r in rows))
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(cats) + 2), 4.2))
    for s_i, name in enumerate(series):
        values = {
            f"{r['workload']}\n{r['tier']}": r[key]
            for r in rows
            if f"{r['backend']} {r['kv']}" == name
        }
        xs = [c_i + (s_i - (len(series) - 1) / 2) * width for c_i in range(len(cats))]
        ys = [float(values.get(c) or 0.0) for c in cats]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(cats)), cats, fontsize=8)
    if "hline" in kw:
        ax.axhline(kw["hline"], color="k", linestyle="--", linewidth=0.8)
    if kw.get("log"):
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(report: dict[str, Any], out: Path) -> list[Path]:
    """PNG plots of the cells: TTFT ratio, bytes stored, p99 decode slowdown.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'skippy-llama[plot]'``).
    """
    rows = report["rows"]
    mib = [{**r, "bytes_mib": r["bytes_stored"] / 2**20} for r in rows]
    pct = [{**r, "p99_pct": 100 * (r["decode_p99_slowdown"] or 0.0)} for r in rows]
    return [
        _bars(rows, "ttft_ratio", "TTFT / cold", "Time to first token vs cold plain Llama",
              out / "ttft_ratio.png", hline=1.0),
        _bars(mib, "bytes_mib", "MiB", "Bytes stored (L1 checkpoints + L2 + L3 pages)",
              out / "bytes_stored.png"),
        _bars(pct, "p99_pct", "% vs cold", "p99 per-token decode time vs cold",
              out / "decode_p99.png", hline=100 * DECODE_P99_MAX),
    ]  # fmt: skip


def write(report: dict[str, Any], out: Path) -> list[Path]:
    """Write ``matrix.json``, ``matrix.md`` and the plots (skipped, with a note, without
    matplotlib); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    try:
        written += plots(report, out)
        report["plots"] = [p.name for p in written]
    except ImportError:
        report["plots"] = []
        report["plots_skipped"] = (
            "matplotlib is not installed: redraw with `skippy-llama matrix --replot matrix.json`"
        )
    (out / "matrix.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "matrix.md").write_text(markdown(report))
    return [out / "matrix.json", out / "matrix.md", *written]
