"""From raw cells to the report's rows: the measured ratios and the seed's gates (pure).

A gate is ``True`` (pass), ``False`` (fail) or ``None`` (does not apply to the cell: L1 keeps
nothing across a restart and writes nothing to disk).

| gate | applies to | passes when |
|---|---|---|
| ``exact`` | every cell | every greedy output equals the cold plain ``Llama``'s |
| ``l3_onoff`` | L2, L3 | every output equals the same requests' with L3 off (the L1 cell; cold without one) |
| ``restart`` | L2, L3 of ``restart`` | TTFT of the requests after the restart / cold TTFT ≤ 0.5 |
| ``write_amp`` | L2, L3 | bytes written to L3 / unique page bytes ≤ 1.2 |
| ``low_space`` | L2, L3 | with the free-space floor above the free space: 0 writes, outputs equal cold |
| ``prune_clear`` | L2 (clear), L3 (prune) | the store holds 0 pages and 0 prefixes afterwards |
| ``decode_p99`` | every cell | p99 of the per-token decode time ≤ 1.05 × cold's |
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from .runner import Answer, Cell
from .timed import percentile

RESTART_MAX = 0.5
WRITE_AMP_MAX = 1.2
DECODE_P99_MAX = 0.05
GATES = ("exact", "l3_onoff", "restart", "write_amp", "low_space", "prune_clear", "decode_p99")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def p99_slowdown(answers: Sequence[Answer], cold: Sequence[Answer], q: float = 99) -> float | None:
    """The ``q``-th percentile of every per-token gap of ``answers`` over that of ``cold``,
    minus 1 (p99 by default: the gate; the median separates a steady slowdown from a spike)."""
    mine = percentile([t for a in answers for t in a.token_ms], q)
    ref = percentile([t for a in cold for t in a.token_ms], q)
    if mine is None or ref is None or ref <= 0:
        return None
    return mine / ref - 1


def summarize(
    cell: Cell, l3_off_texts: Sequence[str] | None, low_space: dict[str, Any] | None
) -> dict[str, Any]:
    """The report row of one cell (see the module docstring for the gates)."""
    stored = cell.tier != "l1"
    texts = [a.text for a in cell.answers]
    same = [a.text == c.text for a, c in zip(cell.answers, cell.cold, strict=True)]
    ttft = sum(a.ttft_ms for a in cell.answers)
    cold_ttft = sum(c.ttft_ms for c in cell.cold)
    after = [i for i, p in enumerate(cell.phases) if p == 2]
    restart_ratio = (
        _ratio(
            sum(cell.answers[i].ttft_ms for i in after), sum(cell.cold[i].ttft_ms for i in after)
        )
        if after
        else None
    )
    wa = cell.store.write_amplification if stored else None
    slowdown = p99_slowdown(cell.answers, cell.cold)
    gates: dict[str, bool | None] = {
        "exact": all(same),
        "l3_onoff": (list(texts) == list(l3_off_texts)) if stored and l3_off_texts else None,
        "restart": (
            restart_ratio is not None and restart_ratio <= RESTART_MAX
            if stored and cell.workload == "restart"
            else None
        ),
        # a cell that stored nothing (every prompt shorter than one GPU reuse granule) has no
        # write amplification and nothing to prune: not applicable, rather than a failure
        "write_amp": None if wa is None else wa <= WRITE_AMP_MAX,
        "low_space": bool(low_space["pass"]) if stored and low_space else None,
        "prune_clear": (
            bool(cell.emptied["pass"])
            if stored and cell.emptied and cell.emptied.get("pages_before") != 0
            else None
        ),
        "decode_p99": None if slowdown is None else slowdown <= DECODE_P99_MAX,
    }
    return {
        "backend": cell.backend,
        "kv": cell.kv,
        "workload": cell.workload,
        "tier": cell.tier,
        "requests": len(cell.answers),
        "served": dict(Counter(a.tier for a in cell.answers)),
        "prompt_tokens": sum(a.prompt_tokens for a in cell.answers),
        "cached_tokens": sum(a.cached_tokens for a in cell.answers),
        "ttft_ms": round(ttft, 1),
        "cold_ttft_ms": round(cold_ttft, 1),
        "ttft_ratio": _ratio(ttft, cold_ttft),
        "restart_ttft_ratio": restart_ratio,
        "bytes_stored": cell.store.bytes_stored,
        "store": {
            "l1_resident_bytes": cell.store.l1_resident_bytes,
            "l2_bytes": cell.store.l2_bytes,
            "l3_page_bytes": cell.store.l3_page_bytes,
            "l3_bytes_written": cell.store.bytes_written,
            "l3_pages": cell.store.pages,
            "l3_manifests": cell.store.manifests,
            "l3_dropped_writes": cell.store.dropped_writes,
        },
        "identical_outputs": sum(same),
        "write_amplification": wa,
        "decode_p99_ms": percentile([t for a in cell.answers for t in a.token_ms], 99),
        "cold_decode_p99_ms": percentile([t for a in cell.cold for t in a.token_ms], 99),
        "decode_p99_slowdown": slowdown,
        "decode_p50_slowdown": p99_slowdown(cell.answers, cell.cold, 50),
        "decode_gaps": sum(len(a.token_ms) for a in cell.answers),
        "gates": gates,
    }


def summarize_noreuse(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Overhead where nothing can be reused: each mode against plain ``Llama``."""
    out = []
    for row in rows:
        answers = [Answer(**a) for a in row["answers"]]
        plain = [Answer(**a) for a in row["plain"]]
        out.append(
            {
                "backend": row["backend"],
                "kv": row["kv"],
                "mode": row["mode"],
                "requests": len(answers),
                "request_ratio": _ratio(
                    sum(a.request_ms for a in answers), sum(p.request_ms for p in plain)
                ),
                "ttft_ratio": _ratio(
                    sum(a.ttft_ms for a in answers), sum(p.ttft_ms for p in plain)
                ),
                "decode_p99_slowdown": p99_slowdown(answers, plain),
                "outputs_equal_plain": all(
                    a.text == p.text for a, p in zip(answers, plain, strict=True)
                ),
            }
        )
    return out


def overall(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per gate: how many cells passed, failed, or had it not apply."""
    totals: dict[str, dict[str, int]] = {}
    for gate in GATES:
        values = [r["gates"][gate] for r in rows]
        totals[gate] = {
            "pass": sum(v is True for v in values),
            "fail": sum(v is False for v in values),
            "n/a": sum(v is None for v in values),
        }
    return totals
