"""Synthetic native pages for the CacheGen tests: KV-like values (per-channel offsets and scales,
a slow drift along the tokens, an outlier channel), any float layout."""

from __future__ import annotations

import numpy as np

from skippy_llama.state.layout import KVLayout, LayerLayout
from skippy_llama.state.pages import Page

F32, F16, Q8_0 = 0, 1, 8


def kv_values(n_layer: int, n_tokens: int, channels: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.normal(0, 1, (n_layer, 1, channels)) * rng.uniform(0.1, 4, (n_layer, 1, channels))
    drift = np.cumsum(rng.normal(0, 0.2, (n_layer, n_tokens, channels)), axis=1)
    x = base + drift + rng.normal(0, 0.5, (n_layer, n_tokens, channels))
    x[:, :, 3] *= 20  # an outlier channel, as RoPE'd K has
    return x


def make_page(
    *,
    n_tokens: int = 128,
    n_layer: int = 6,
    channels: int = 64,
    v_trans: bool = True,
    ggml_type: int = F16,
    ext_bytes: int = 0,
    start: int = 0,
    seed: int = 0,
) -> tuple[Page, np.ndarray, np.ndarray]:
    """A page and its K and V values (n_layer, n_tokens, channels), as float32."""
    dtype = np.float16 if ggml_type == F16 else np.float32
    e = np.dtype(dtype).itemsize
    layers = tuple(
        LayerLayout(ggml_type, channels * e, ggml_type, e if v_trans else channels * e,
                    channels if v_trans else 0)
        for _ in range(n_layer)
    )  # fmt: skip
    layout = KVLayout(v_trans=v_trans, layers=layers, ext_bytes=ext_bytes)
    k = kv_values(n_layer, n_tokens, channels, seed).astype(dtype)
    v = kv_values(n_layer, n_tokens, channels, seed + 1).astype(dtype)
    ks = tuple(k[i].view(np.uint8).reshape(n_tokens, channels * e) for i in range(n_layer))
    if v_trans:
        vs = tuple(
            np.ascontiguousarray(v[i].T).view(np.uint8).reshape(channels, n_tokens * e)
            for i in range(n_layer)
        )
    else:
        vs = tuple(v[i].view(np.uint8).reshape(n_tokens, channels * e) for i in range(n_layer))
    ext = np.random.default_rng(seed).integers(0, 255, (n_tokens, ext_bytes), dtype=np.uint8)
    page = Page(start, n_tokens, layout, ext, ks, vs)
    return page, k.astype(np.float32), v.astype(np.float32)


def values_of(page: Page) -> tuple[np.ndarray, np.ndarray]:
    """K and V values of a (decoded) page as float32 (n_layer, n_tokens, channels)."""
    layer = page.layout.layers[0]
    dtype = np.float16 if layer.k_type == F16 else np.float32
    k = np.stack([np.ascontiguousarray(a).view(dtype) for a in page.k]).astype(np.float32)
    vs = [np.ascontiguousarray(a).view(dtype) for a in page.v]
    v = np.stack([a.T if page.layout.v_trans else a for a in vs]).astype(np.float32)
    return k, v
