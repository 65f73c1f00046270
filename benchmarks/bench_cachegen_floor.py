"""The CacheGen gate's noise floor: how far any change of the restored K/V moves the logits.

The issue-43 gate (``skippy_llama/codecs/quality.py``) scores the next-token argmax and KL after
a prefix restored from lossy pages against the native restore. This benchmark scores, on the
qualifier's own texts and positions (``scripts/qualify_cachegen.py``: a 128-token prefix, the
next 64 positions teacher-forced), several *perturbations* of the same native pages beside the
codec, so a codec's figures can be read against what the measure itself allows:

- ``cold``: the whole text prefilled cold, no restore (is the native restore itself exact?);
- ``cachegen-<b>``: CacheGen with ``b`` bits in every layer third, K and V (group 128, zstd);
- ``q8_0``: every K/V value quantized as llama.cpp's Q8_0 does (blocks of 32 values of one
  token, scale ``max|x| / 127`` in F16), then back to the page's float type: a reference 8-bit
  quantizer that keeps the model's own K/V cache format in mind;
- ``jitter``: the qualifier's noise floor (``jitter_page``: each value's last mantissa bit set
  at random, at most one ulp);
- ``ulp-k0``: one value changed by one ulp (layer 0, K, token 5, channel 0);
- ``llama-q8_0`` (with ``--flash-attn``, which a quantized V cache needs): llama.cpp's own Q8_0
  K/V cache, the whole text prefilled cold in a second context (so the scored tokens' K/V are
  quantized too, unlike the restored-prefix variants).

For every variant: argmax agreement, mean and max KL, perplexity rise, and the native top-1 to
top-2 logit gaps at the positions where the argmax flipped (near-ties or not).

``--weights f32`` scores an F32 copy of the model instead (``llama_model_quantize`` with
``ALL_F32`` into a temporary directory, ``allow_requantize``): the same weights' values, but
ggml's CPU matmul no longer quantizes the activations (Q4_1 weights take Q8_1 activations), so
the comparison separates the codec's error from the backend's amplification of it.

Usage::

    PYTHONPATH=$PWD/tests/force_ngl LLCPP_FORCE_NGL=0 LLCPP_FORCE_THREADS=1 \\
        .venv/bin/python benchmarks/bench_cachegen_floor.py --prompts 16 [--weights f32] \\
        [--out benchmarks/results/cachegen-floor.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one

from cachegen_common import commit, load_average, qualifier  # noqa: E402

from skippy_llama.codecs import cachegen  # noqa: E402
from skippy_llama.codecs.cachegen import CacheGenParams  # noqa: E402
from skippy_llama.codecs.quality import Scores  # noqa: E402
from skippy_llama.state import page_from_bytes  # noqa: E402

F32, F16, Q8_0 = 0, 1, 8


def _words(arr: np.ndarray[Any, Any], ggml_type: int) -> np.ndarray[Any, Any]:
    return arr.view(np.uint16 if ggml_type == F16 else np.uint32)


def q8_0_page(page: bytes) -> bytes:
    """Every K/V value through Q8_0 (per token, blocks of 32 channels) and back."""
    parsed = page_from_bytes(bytearray(page))
    for layer, k, v in zip(parsed.layout.layers, parsed.k, parsed.v, strict=True):
        for arr, ggml_type, trans in ((k, layer.k_type, False), (v, layer.v_type,
                                      parsed.layout.v_trans)):  # fmt: skip
            dtype = np.float16 if ggml_type == F16 else np.float32
            x = arr.view(dtype)
            x = x.reshape(-1, parsed.n_tokens).T if trans else x  # token-major view
            blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
            d = (np.abs(blocks).max(axis=2, keepdims=True) / 127).astype(np.float16)
            d32 = d.astype(np.float32)
            q = np.rint(np.divide(blocks, d32, out=np.zeros_like(blocks), where=d32 > 0))
            x[...] = (q * d32).reshape(x.shape).astype(dtype)
    return parsed.to_bytes()


def one_ulp(page: bytes) -> bytes:
    """One value (layer 0, K, token 5, channel 0) moved by one ulp."""
    parsed = page_from_bytes(bytearray(page))
    layer = parsed.layout.layers[0]
    _words(parsed.k[0], layer.k_type)[5, 0] += 1
    return parsed.to_bytes()


def cachegen_page(bits: int) -> Callable[[bytes], bytes]:
    params = CacheGenParams((bits,) * 3, (bits,) * 3, 128)
    return lambda page: bytes(cachegen.decode(cachegen.encode(page, params)))


def f32_copy(model: Path, out_dir: Path) -> Path:
    """An F32 copy of ``model`` (llama.cpp's quantizer, requantizing to ALL_F32)."""
    import llama_cpp

    out = out_dir / (model.stem + ".F32.gguf")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    p.allow_requantize = True
    p.nthread = 1
    if llama_cpp.llama_model_quantize(str(model).encode(), str(out).encode(), p) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {model}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="calibration texts (default 16)")
    parser.add_argument("--weights", choices=("model", "f32"), default="model")
    parser.add_argument("--bits", type=int, nargs="*", default=[8, 6], help="CacheGen bits")
    parser.add_argument("--flash-attn", action="store_true")
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import llama_cpp

    from skippy_llama.models import default_model_path

    q = qualifier()
    model = args.model or default_model_path()
    variants: dict[str, Callable[[bytes], bytes]] = {
        **{f"cachegen-{b}": cachegen_page(b) for b in args.bits},
        "q8_0": q8_0_page,
        "jitter": lambda page: q.jitter_page(page, 0),
        "ulp-k0": one_ulp,
    }
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        path = f32_copy(model, Path(tmp)) if args.weights == "f32" else model
        llm = llama_cpp.Llama(
            str(path), n_ctx=1024, n_batch=512, type_k=F16, type_v=F16,
            flash_attn=args.flash_attn, logits_all=True, verbose=False,
        )  # fmt: skip
        q8ctx = (
            llama_cpp.Llama(
                str(path),
                n_ctx=1024,
                n_batch=512,
                type_k=Q8_0,
                type_v=Q8_0,
                flash_attn=True,
                logits_all=True,
                verbose=False,
            )
            if args.flash_attn
            else None
        )
        P, S = q.PREFIX_PAGES * q.PAGE, q.SCORED
        texts = q.texts(llm, args.prompts, P + S + 1, False)
        names = ("cold", *variants, *(("llama-q8_0",) if q8ctx else ()))
        scores = {name: Scores() for name in names}
        flip_gaps: dict[str, list[float]] = {name: [] for name in scores}
        all_gaps: list[float] = []
        for i, tokens in enumerate(texts):
            sections = q._capture(llm, tokens[:P])
            ref = q._teacher_forced(llm, sections, tokens)
            targets = tokens[P + 1 : P + S + 1]
            q._reset(llm)
            q._eval(llm, tokens[: P + S], logits_all=True)
            outs = {"cold": np.array(llm.scores[P : P + S], dtype=np.float32)}
            for name, f in variants.items():
                changed = [[f(page) for page in pages] for pages in sections]
                outs[name] = q._teacher_forced(llm, changed, tokens)
            if q8ctx is not None:
                q._reset(q8ctx)
                q._eval(q8ctx, tokens[: P + S], logits_all=True)
                outs["llama-q8_0"] = np.array(q8ctx.scores[P : P + S], dtype=np.float32)
            top2 = np.sort(ref, axis=1)[:, -2:]
            gap = top2[:, 1] - top2[:, 0]
            all_gaps += gap.tolist()
            for name, logits in outs.items():
                scores[name].add(ref, logits, targets)
                flip_gaps[name] += gap[ref.argmax(1) != logits.argmax(1)].tolist()
            print(f"text {i}: " + ", ".join(f"{n} {s.argmax_agree}/{s.positions}"
                                            for n, s in scores.items()), flush=True)  # fmt: skip
        llm.close()
        if q8ctx is not None:
            q8ctx.close()
    gaps = np.array(all_gaps)
    result = {
        name: {
            "argmax_agree": round(s.agree_share, 5),
            "mean_kl": round(s.mean_kl, 8),
            "max_kl": round(s.max_kl, 6),
            "ppl_rise": round(s.ppl_rise, 5),
            "flips": len(flip_gaps[name]),
            "flip_gap_max": round(max(flip_gaps[name], default=0.0), 4),
            "flip_gap_median": round(float(np.median(flip_gaps[name])), 4)
            if flip_gaps[name]
            else None,
        }
        for name, s in scores.items()
    }
    doc = {
        "benchmark": "bench_cachegen_floor",
        "command": " ".join(["benchmarks/bench_cachegen_floor.py", *sys.argv[1:]]),
        "commit": commit(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "load": load_average(), "threads": os.environ.get("LLCPP_FORCE_THREADS")},
        "model": model.name,
        "weights": args.weights,
        "flash_attn": args.flash_attn,
        "texts": args.prompts,
        "positions": scores["cold"].positions,
        "native_top2_gap_quantiles": {
            str(p): round(float(np.quantile(gaps, p)), 4) for p in (0.01, 0.02, 0.05, 0.1, 0.5)
        },
        "positions_with_gap_below": {
            str(t): int((gaps < t).sum()) for t in (0.01, 0.05, 0.1, 0.2, 0.5)
        },
        "variants": result,
        "seconds": round(time.time() - started, 1),
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n", "utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
