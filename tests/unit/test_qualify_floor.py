"""The qualifier's noise floor (``scripts/qualify_cachegen.py``'s ``jitter_page``): a null codec
that moves each K/V value by at most one ulp. Synthetic pages, no model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from cachegen_pages import F16, F32, Q8_0, make_page

from skippy_llama.codecs.cachegen import CodecUnsupportedError
from skippy_llama.state.pages import page_from_bytes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qualify() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "qualify_cachegen", ROOT / "scripts" / "qualify_cachegen.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _words(page: bytes, ggml_type: int) -> np.ndarray:
    parsed = page_from_bytes(page)
    word = np.uint16 if ggml_type == F16 else np.uint32
    return np.concatenate(
        [np.ascontiguousarray(a).view(word).ravel() for a in (*parsed.k, *parsed.v)]
    )


@pytest.mark.parametrize("ggml_type", [F16, F32])
@pytest.mark.parametrize("v_trans", [True, False])
def test_jitter_moves_each_value_by_at_most_its_last_bit(
    qualify: ModuleType, ggml_type: int, v_trans: bool
) -> None:
    page = make_page(ggml_type=ggml_type, v_trans=v_trans, ext_bytes=4)[0].to_bytes()
    out = qualify.jitter_page(page, seed=3)
    assert len(out) == len(page)
    before, after = _words(page, ggml_type), _words(out, ggml_type)
    flipped = before ^ after
    assert set(np.unique(flipped).tolist()) == {0, 1}  # only the lowest mantissa bit
    assert 0.4 < flipped.mean() < 0.6  # about half the values move
    a, b = page_from_bytes(page), page_from_bytes(out)
    assert a.layout == b.layout and a.start == b.start and a.n_tokens == b.n_tokens
    assert np.array_equal(a.ext, b.ext)
    assert out == qualify.jitter_page(page, seed=3)  # reproducible
    assert out != qualify.jitter_page(page, seed=4)


def test_jitter_refuses_a_quantized_layout(qualify: ModuleType) -> None:
    page = make_page(ggml_type=F16)[0]
    layers = tuple(
        type(layer)(Q8_0, layer.k_row, layer.v_type, layer.v_unit, layer.v_embd)
        for layer in page.layout.layers
    )
    quantized = type(page)(
        page.start, page.n_tokens, type(page.layout)(page.layout.v_trans, layers, 0),
        page.ext, page.k, page.v,
    )  # fmt: skip
    with pytest.raises(CodecUnsupportedError):
        qualify.jitter_page(quantized.to_bytes(), seed=0)
