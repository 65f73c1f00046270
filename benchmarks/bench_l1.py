"""L1 benchmarks of issue 2: warm vs cold TTFT, and the capture overhead of the cold path.

Both compare ratios measured side by side in one run (the machines are shared and noisy); nothing
here is a timed assertion. Results go to a JSON file and a small table is printed.

1. **Warm vs cold TTFT.** A 2,048-token prompt whose first 1,920 tokens are resident in L1.
   A first prompt with the shared 1,920-token prefix is run once so it is parked; every
   repetition then runs a prompt with the same prefix and a different last 128 tokens:
   - cold: on a ``SkippyLlama`` with the cache off (``l1.enabled = False``), after ``reset()``
     so that nothing of the live sequence is reused either (a full 2,048-token prefill);
   - warm: on a ``SkippyLlama`` with the cache on, right after a short unrelated prompt has
     replaced the working sequence, so the prefix comes from a resident prefix (a device
     checkpoint restored) and only 128 tokens are prefilled.
   ``max_tokens=1``; TTFT is ``last_cache_event.ttft_ms`` and the wall time of
   ``create_completion``. The greedy first tokens and the last-token logits of warm and cold
   are compared.
2. **Capture overhead on the cold path.** Fresh 2,048-token prompts (never seen before, so no
   hit) with ``max_tokens=16`` through the cache-on instance (which parks the sequence when the
   next prompt leaves it: a device checkpoint, plus the batched re-decode of the generated
   tokens, "repair") and the cache-off instance, alternating the order. The park and repair
   steps are timed separately by wrapping the instance's ``park`` and its seam's ``execute``.

Usage::

    .venv/bin/python benchmarks/bench_l1.py --out benchmarks/results/l1.json --reps 3 --n-threads 1
    .venv/bin/python benchmarks/bench_l1.py --quick      # 1,024-token prompts, 1 repetition
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from skippy_llama.config import Settings
from skippy_llama.models import resolve_model_path
from skippy_llama.runtime.llama import SkippyLlama

_WORD_TEXT = (
    "the a of and to in is was for on with as by at from that this it be are were which an "
    "river mountain city harbor engine garden library winter summer signal lantern market "
    "merchant captain soldier teacher student farmer doctor painter sailor miller weaver "
    "bridge tower valley forest meadow island castle village station factory window door "
    "letter story song map coin ledger wheel anchor compass clock candle bottle basket rope "
    "walked carried built opened closed watched wrote found lost painted measured counted "
    "slowly quietly early late often never always again together alone beyond under across "
    "bright dark old new quiet heavy narrow wide cold warm green golden silver wooden stone "
    "because although while after before until since whenever however therefore meanwhile "
    "north south east west morning evening night noon spring autumn storm rain snow wind"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split(" "))

TARGET_TTFT_RATIO = 0.1
TARGET_OVERHEAD = 0.03


def synthetic_text(seed: int, n_words: int) -> str:
    """Deterministic pseudo-English: sentences of random words from a fixed list."""
    rng = random.Random(seed)
    sentences = []
    left = n_words
    while left > 0:
        n = min(left, rng.randint(6, 18))
        words = [rng.choice(WORDS) for _ in range(n)]
        sentences.append(" ".join(words).capitalize() + ".")
        left -= n
    return " ".join(sentences)


def text_tokens(llm: llama_cpp.Llama, seed: int, n_tokens: int, *, bos: bool) -> list[int]:
    """Exactly ``n_tokens`` tokens of synthetic text (with BOS first when ``bos``)."""
    n_words = n_tokens
    while True:
        text = synthetic_text(seed, n_words)
        tokens = llm.tokenize(text.encode("utf-8"), add_bos=bos, special=False)
        if len(tokens) >= n_tokens:
            return list(tokens[:n_tokens])
        n_words *= 2


def distinct_tails(
    llm: llama_cpp.Llama, count: int, n_tokens: int, base_seed: int
) -> list[list[int]]:
    """``count`` tails of ``n_tokens`` tokens whose first tokens all differ (no shared page)."""
    tails: list[list[int]] = []
    seen: set[int] = set()
    seed = base_seed
    while len(tails) < count:
        tail = text_tokens(llm, seed, n_tokens, bos=False)
        seed += 1
        if tail[0] not in seen:
            seen.add(tail[0])
            tails.append(tail)
    return tails


def last_logits(llm: llama_cpp.Llama) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Logits of the last decoded token (copied)."""
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


@dataclass
class StepTimer:
    """Accumulates the wall time of wrapped instance methods (``park``, the seam's ``execute``)."""

    seconds: dict[str, float] = field(default_factory=dict)

    def wrap(self, obj: object, name: str) -> None:
        inner: Callable[..., Any] = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        out = {k: v * 1e3 for k, v in self.seconds.items()}
        self.seconds.clear()
        return out


@dataclass
class Run:
    """One completion: what was run, how long it took, what the cache did."""

    bench: str
    variant: str
    rep: int
    prompt_tokens: int
    wall_ms: float
    ttft_ms: float
    lookup_ms: float
    restore_ms: float
    prefill_ms: float
    tier: str
    cached_tokens: int
    suffix_tokens: int
    repaired_tokens: int
    park_ms: float
    repair_ms: float
    text: str


def complete(
    llm: SkippyLlama,
    timer: StepTimer | None,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    bench: str,
    variant: str,
    rep: int,
) -> Run:
    if timer is not None:
        timer.take()
    started = time.perf_counter()
    result = llm.create_completion(list(prompt), max_tokens=max_tokens, temperature=0.0)
    wall_ms = (time.perf_counter() - started) * 1e3
    steps = timer.take() if timer is not None else {}
    event = llm.last_cache_event
    assert event is not None
    return Run(
        bench=bench,
        variant=variant,
        rep=rep,
        prompt_tokens=event.prompt_tokens,
        wall_ms=wall_ms,
        ttft_ms=event.ttft_ms,
        lookup_ms=event.lookup_ms,
        restore_ms=event.restore_ms,
        prefill_ms=event.prefill_ms,
        tier=event.tier,
        cached_tokens=event.cached_tokens,
        suffix_tokens=event.suffix_tokens,
        repaired_tokens=event.repaired_tokens,
        park_ms=steps.get("park", 0.0),
        repair_ms=steps.get("_repair", 0.0),
        text=result["choices"][0]["text"],
    )


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def bench_ttft(
    llm_on: SkippyLlama,
    llm_off: SkippyLlama,
    timer: StepTimer,
    *,
    reps: int,
    prompt_tokens: int,
    resident_tokens: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Benchmark 1: warm (resident prefix) vs cold TTFT, alternating the order every repetition."""
    tail_tokens = prompt_tokens - resident_tokens
    shared = text_tokens(llm_on, 1, resident_tokens, bos=True)
    tails = distinct_tails(llm_on, reps + 1, tail_tokens, base_seed=100)
    distractor = text_tokens(llm_on, 999, 64, bos=True)

    prime = complete(llm_on, timer, shared + tails[0], 1, bench="ttft", variant="prime", rep=-1)
    log(f"  primed L1 with a {prompt_tokens}-token prompt ({prime.wall_ms / 1e3:.1f} s)")
    runs: list[Run] = [prime]
    logit_diffs: list[float] = []
    for rep in range(reps):
        prompt = shared + tails[rep + 1]
        pair: dict[str, Run] = {}
        logits: dict[str, np.ndarray[Any, np.dtype[np.float32]]] = {}
        for variant in ("cold", "warm") if rep % 2 == 0 else ("warm", "cold"):
            if variant == "cold":
                llm_off.reset()  # type: ignore[no-untyped-call]  # nothing live is reused
                run = complete(llm_off, None, prompt, 1, bench="ttft", variant="cold", rep=rep)
                logits["cold"] = last_logits(llm_off)
            else:
                # replace the working sequence, so the prefix must come from a resident one
                runs.append(
                    complete(
                        llm_on, timer, distractor, 1, bench="ttft", variant="distractor", rep=rep
                    )
                )
                run = complete(llm_on, timer, prompt, 1, bench="ttft", variant="warm", rep=rep)
                logits["warm"] = last_logits(llm_on)
            pair[variant] = run
            runs.append(run)
        logit_diffs.append(float(np.max(np.abs(logits["warm"] - logits["cold"]))))
        log(
            f"  rep {rep}: cold TTFT {pair['cold'].ttft_ms:8.1f} ms, warm TTFT "
            f"{pair['warm'].ttft_ms:7.1f} ms (tier {pair['warm'].tier}, cached "
            f"{pair['warm'].cached_tokens})"
        )

    cold = [r for r in runs if r.variant == "cold"]
    warm = [r for r in runs if r.variant == "warm"]
    cold_ttft = median([r.ttft_ms for r in cold])
    warm_ttft = median([r.ttft_ms for r in warm])
    cold_wall = median([r.wall_ms for r in cold])
    warm_wall = median([r.wall_ms for r in warm])
    ratio = warm_ttft / cold_ttft
    return {
        "description": (
            f"warm vs cold TTFT, {prompt_tokens}-token prompt with the first {resident_tokens} "
            "tokens resident in L1; max_tokens=1"
        ),
        "prompt_tokens": prompt_tokens,
        "resident_tokens": resident_tokens,
        "reps": reps,
        "median_ms": {
            "cold_ttft": cold_ttft,
            "warm_ttft": warm_ttft,
            "cold_wall": cold_wall,
            "warm_wall": warm_wall,
            "warm_lookup": median([r.lookup_ms for r in warm]),
            "warm_restore": median([r.restore_ms for r in warm]),
            "warm_prefill": median([r.prefill_ms for r in warm]),
            "warm_park": median([r.park_ms for r in warm]),
        },
        "ratio_ttft": ratio,
        "ratio_wall": warm_wall / cold_wall,
        "ratio_ttft_paired_median": median(
            [w.ttft_ms / c.ttft_ms for w, c in zip(warm, cold, strict=True)]
        ),
        "cold_prefill_tokens_per_s": prompt_tokens / (cold_ttft / 1e3),
        "target_ratio": TARGET_TTFT_RATIO,
        "target_met": ratio <= TARGET_TTFT_RATIO,
        "warm_tiers": sorted({r.tier for r in warm}),
        "warm_cached_tokens": sorted({r.cached_tokens for r in warm}),
        "first_tokens_equal": all(w.text == c.text for w, c in zip(warm, cold, strict=True)),
        "max_abs_logit_diff": max(logit_diffs),
        "runs": [asdict(r) for r in runs],
    }


def bench_capture(
    llm_on: SkippyLlama,
    llm_off: SkippyLlama,
    timer: StepTimer,
    *,
    reps: int,
    prompt_tokens: int,
    max_tokens: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Benchmark 2: cold-path completion time with the cache on (park + repair) vs off."""
    runs: list[Run] = []
    for rep in range(reps):
        prompt = text_tokens(llm_on, 1000 + rep, prompt_tokens, bos=True)
        pair: dict[str, Run] = {}
        for variant in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            llm = llm_on if variant == "on" else llm_off
            run = complete(
                llm,
                timer if variant == "on" else None,
                prompt,
                max_tokens,
                bench="capture",
                variant=variant,
                rep=rep,
            )
            pair[variant] = run
            runs.append(run)
        log(
            f"  rep {rep}: on {pair['on'].wall_ms:8.1f} ms (park {pair['on'].park_ms:.1f}, "
            f"repair {pair['on'].repair_ms:.1f}), off {pair['off'].wall_ms:8.1f} ms"
        )

    on = [r for r in runs if r.variant == "on"]
    off = [r for r in runs if r.variant == "off"]
    on_wall = median([r.wall_ms for r in on])
    off_wall = median([r.wall_ms for r in off])
    overhead = on_wall / off_wall - 1.0
    spread = max(r.wall_ms for r in off) / min(r.wall_ms for r in off) - 1.0
    # the end-to-end comparison can only resolve the target when repeated cold runs agree
    resolvable = len(off) >= 3 and spread <= TARGET_OVERHEAD
    pairs = list(zip(on, off, strict=True))
    # what the cache adds to a cold request, step by step, as a share of the cache-off wall time
    steps = median([(r.lookup_ms + r.park_ms + r.repair_ms) / o.wall_ms for r, o in pairs])
    return {
        "description": (
            f"cold path, {prompt_tokens}-token never-seen prompts, max_tokens={max_tokens}: "
            "cache on (parks the sequence, repairs generated tokens) vs cache off"
        ),
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "reps": reps,
        "median_ms": {
            "on_wall": on_wall,
            "off_wall": off_wall,
            "on_ttft": median([r.ttft_ms for r in on]),
            "off_ttft": median([r.ttft_ms for r in off]),
            "park": median([r.park_ms for r in on]),
            "repair": median([r.repair_ms for r in on]),
            "lookup": median([r.lookup_ms for r in on]),
        },
        "off_wall_spread": spread,
        "overhead": overhead,
        "overhead_paired_median": median([r.wall_ms / o.wall_ms - 1.0 for r, o in pairs]),
        "wall_resolves_target": resolvable,
        "step_overhead": steps,
        "repaired_tokens": sorted({r.repaired_tokens for r in on}),
        "on_tiers": sorted({r.tier for r in on}),
        "outputs_equal": all(r.text == o.text for r, o in zip(on, off, strict=True)),
        "target_overhead": TARGET_OVERHEAD,
        "target_met_wall": overhead <= TARGET_OVERHEAD if resolvable else None,
        "target_met_steps": steps <= TARGET_OVERHEAD,
        "runs": [asdict(r) for r in runs],
    }


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def print_table(ttft: dict[str, Any], capture: dict[str, Any]) -> None:
    t, c = ttft["median_ms"], capture["median_ms"]
    wall = capture["target_met_wall"]
    wall_met = "noise" if wall is None else ("yes" if wall else "NO")
    rows = [
        ("benchmark", "measure", "value", "target", "met"),
        (
            "warm/cold TTFT",
            f"{t['warm_ttft']:.0f} / {t['cold_ttft']:.0f} ms",
            f"{ttft['ratio_ttft']:.3f}",
            f"<= {TARGET_TTFT_RATIO}",
            "yes" if ttft["target_met"] else "NO",
        ),
        (
            "warm/cold wall",
            f"{t['warm_wall']:.0f} / {t['cold_wall']:.0f} ms",
            f"{ttft['ratio_wall']:.3f}",
            "",
            "",
        ),
        (
            "capture overhead (wall)",
            f"{c['on_wall']:.0f} / {c['off_wall']:.0f} ms",
            f"{capture['overhead'] * 100:+.2f} %",
            f"<= {TARGET_OVERHEAD * 100:.0f} %",
            wall_met,
        ),
        (
            "  cache-off wall spread",
            "max/min - 1",
            f"{capture['off_wall_spread'] * 100:.1f} %",
            "",
            "",
        ),
        (
            "capture overhead (steps)",
            f"{c['lookup'] + c['park'] + c['repair']:.1f} ms",
            f"{capture['step_overhead'] * 100:.2f} %",
            f"<= {TARGET_OVERHEAD * 100:.0f} %",
            "yes" if capture["target_met_steps"] else "NO",
        ),
        (
            "  park/repair",
            f"{c['park']:.1f} / {c['repair']:.1f} ms",
            "",
            "",
            "",
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(
        f"first tokens warm == cold: {ttft['first_tokens_equal']}; "
        f"max |logit diff| {ttft['max_abs_logit_diff']}; "
        f"capture outputs on == off: {capture['outputs_equal']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/l1.json"))
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3, quick 1)")
    parser.add_argument(
        "--quick", action="store_true", help="1,024-token prompts, 1 repetition (a smoke run)"
    )
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M Q4_1)")
    parser.add_argument("--n-threads", type=int, default=None, help="llama.cpp threads")
    parser.add_argument("--max-tokens", type=int, default=16, help="capture benchmark")
    args = parser.parse_args(argv)

    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    prompt_tokens = 1024 if args.quick else 2048
    resident_tokens = prompt_tokens - 128
    n_ctx = 4096
    model = resolve_model_path(args.model)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    common: dict[str, Any] = {"n_ctx": n_ctx, "verbose": False, "seed": 0}
    if args.n_threads is not None:
        common["n_threads"] = args.n_threads
        common["n_threads_batch"] = args.n_threads
    on_settings = Settings(l1={"enabled": True}, l3={"mode": "off"})
    off_settings = Settings(l1={"enabled": False}, l3={"mode": "off"})
    log(f"loading {model.name} twice (cache on, cache off)")
    llm_on = SkippyLlama(str(model), cache_settings=on_settings, **common)
    llm_off = SkippyLlama(str(model), cache_settings=off_settings, **common)
    timer = StepTimer()
    timer.wrap(llm_on, "park")
    timer.wrap(llm_on.seam, "execute")

    # warm up both instances (allocations, page faults) on a prompt neither benchmark uses
    warmup = text_tokens(llm_on, 5000, 256, bos=True)
    for llm in (llm_on, llm_off):
        llm.create_completion(warmup, max_tokens=4, temperature=0.0)
    llm_on.clear_cache()

    log(f"benchmark 1: warm vs cold TTFT, {prompt_tokens} tokens, {reps} reps")
    ttft = bench_ttft(
        llm_on,
        llm_off,
        timer,
        reps=reps,
        prompt_tokens=prompt_tokens,
        resident_tokens=resident_tokens,
        log=log,
    )
    llm_on.clear_cache()
    log(f"benchmark 2: capture overhead, {prompt_tokens} tokens, {reps} reps")
    capture = bench_capture(
        llm_on,
        llm_off,
        timer,
        reps=reps,
        prompt_tokens=prompt_tokens,
        max_tokens=args.max_tokens,
        log=log,
    )
    elapsed = time.perf_counter() - started

    result = {
        "command": " ".join([".venv/bin/python", "benchmarks/bench_l1.py", *sys.argv[1:]]),
        "quick": args.quick,
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "elapsed_s": elapsed,
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_average_at_end": list(os.getloadavg()),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "llama_cpp_python": llama_cpp.__version__,
            "backend": "GPU offload" if llama_cpp.llama_supports_gpu_offload() else "CPU",
        },
        "model": model.name,
        "llama": {
            "n_ctx": n_ctx,
            "n_threads": llm_on.context_params.n_threads,
            "n_threads_batch": llm_on.context_params.n_threads_batch,
            "n_batch": llm_on.n_batch,
            "type_k": int(llm_on.context_params.type_k),
            "type_v": int(llm_on.context_params.type_v),
        },
        "settings_on": on_settings.model_dump(mode="json"),
        "ttft": ttft,
        "capture": capture,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(ttft, capture)
    print(f"wrote {args.out} ({elapsed:.0f} s)")
    llm_on.close()
    llm_off.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
