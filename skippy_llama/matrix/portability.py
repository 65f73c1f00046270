"""Cross-backend portability, measured: pages captured on one backend with ``cross_backend`` on,
restored on another, compared with the target backend's own cold prefill.

Nothing here is expected to be bit-exact: kernels differ between backends (and between offload
settings of one build), so a restored prefix holds K/V the target would not have computed. The
figures say how far the outputs still agree: the fraction of requests whose greedy output equals
the target's cold output, and the largest absolute difference of the prompt's last logits.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from . import workloads
from .config import Backend, KVName, MatrixConfig
from .runner import Say, TimedCold, TimedSkippy, ask, llama_kwargs, tier_settings


def _answers(llm: Any, cfg: MatrixConfig) -> tuple[list[Any], list[Any]]:
    llm.matrix_keep_logits = True
    answers, logits = [], []
    for req in workloads.documents(cfg):
        answers.append(ask(llm, req, [], cfg.max_tokens))
        logits.append(llm.matrix_timing.logits)
    return answers, logits


def pair(
    cfg: MatrixConfig, model: str, source: Backend, target: Backend, kv: KVName, work: Path
) -> dict[str, Any]:
    """Capture the documents workload on ``source``, restore it on ``target``."""
    directory = work / "portability" / kv / f"{source.name}-to-{target.name}"
    directory.mkdir(parents=True, mode=0o700)
    on = tier_settings(cfg, "l3", directory, cross_backend=True)
    kw_src, kw_dst = llama_kwargs(cfg, source, kv), llama_kwargs(cfg, target, kv)
    cold = TimedCold(model, **kw_dst)
    try:
        refs, ref_logits = _answers(cold, cfg)
    finally:
        cold.close()
    capture = TimedSkippy(model, cache_settings=on, **kw_src)
    try:
        _answers(capture, cfg)
    finally:
        capture.close()  # flushes the pages to L3
    # the default: the target must not see the source's pages at all
    control = TimedSkippy(model, cache_settings=tier_settings(cfg, "l3", directory), **kw_dst)
    try:
        first = ask(control, workloads.documents(cfg)[0], [], cfg.max_tokens)
    finally:
        control.close()
    restore = TimedSkippy(model, cache_settings=on, **kw_dst)
    try:
        got, logits = _answers(restore, cfg)
    finally:
        restore.close()
    deltas = [
        float(np.max(np.abs(a - b)))
        for a, b in zip(logits, ref_logits, strict=True)
        if a is not None and b is not None
    ]
    same = [a.text == r.text for a, r in zip(got, refs, strict=True)]
    return {
        "source": source.name,
        "target": target.name,
        "kv": kv,
        "requests": len(got),
        "served": dict(Counter(a.tier for a in got)),
        "cached_tokens": sum(a.cached_tokens for a in got),
        "agreement": sum(same) / len(same) if same else 0.0,
        "max_abs_dlogit": max(deltas) if deltas else None,
        "per_request_max_abs_dlogit": deltas,
        "off_l3_cached_tokens": first.cached_tokens if first.tier in ("l2", "l3") else 0,
    }


def run(
    cfg: MatrixConfig, model: str, backends: list[Backend], work: Path, say: Say
) -> dict[str, Any]:
    """Every ordered pair of backends, for every K/V type; skipped with one backend."""
    if len(backends) < 2:
        names = ", ".join(b.name for b in backends)
        return {
            "skipped": f"only one backend ({names}) in this run: portability needs a GPU build "
            "(CPU via n_gpu_layers=0 and the GPU via full offload)"
        }
    rows = []
    for kv in cfg.kv_types:
        for source in backends:
            for target in backends:
                if source is target:
                    continue
                say(f"portability {kv}: {source.name} -> {target.name}")
                row = pair(cfg, model, source, target, kv, work)
                say(
                    f"  agreement {row['agreement']:.2f}, max |dlogit| "
                    f"{row['max_abs_dlogit']}, served {row['served']}, "
                    f"off-control L3 tokens {row['off_l3_cached_tokens']}"
                )
                rows.append(row)
    return {"rows": rows}
