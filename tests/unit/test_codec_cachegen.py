"""CacheGen page codec (``codecs/cachegen.py``): round trips within the error bound, native page
bytes into a caller's buffer, and damaged or foreign payloads refused with an error, never a
crash or a wrong page."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cachegen_pages import F16, F32, Q8_0, make_page, values_of

from skippy_llama.codecs import cachegen, stored_codec
from skippy_llama.codecs.cachegen import CacheGenParams, CodecUnsupportedError
from skippy_llama.errors import StateFormatError, UnknownCodecError
from skippy_llama.state import page_from_bytes
from skippy_llama.state.layout import KVLayout, LayerLayout
from skippy_llama.state.pages import Page

CODERS = ["zstd"]
try:
    import constriction  # noqa: F401

    CODERS.append("ans")
except ImportError:  # pragma: no cover - the cachegen extra installs it
    pass


def _check_round_trip(page: Page, k: np.ndarray, v: np.ndarray, params: CacheGenParams) -> bytes:
    raw = page.to_bytes()
    stored = cachegen.encode(raw, params)
    assert stored_codec(stored) == "cachegen/1"
    assert cachegen.decoded_size(stored) == len(raw)
    out = bytearray(len(raw) + 100)  # a larger reused buffer: only the start is written
    out[-100:] = b"\xee" * 100
    assert cachegen.decode_into(stored, memoryview(out), page.n_tokens) == len(raw)
    assert out[-100:] == b"\xee" * 100
    back = page_from_bytes(memoryview(out)[: len(raw)])
    # header, layer table and cell ext are exact; values within half a step (+ F16 rounding)
    head = 28 + 24 * page.layout.n_layer + page.n_tokens * page.layout.ext_bytes
    assert bytes(out[:head]) == raw[:head]
    assert (back.start, back.n_tokens, back.layout) == (page.start, page.n_tokens, page.layout)
    bk, bv = values_of(back)
    bound = cachegen.error_bound(stored)
    rel = 2.0**-10 if page.layout.layers[0].k_type == F16 else 2.0**-22
    for got, want in ((bk, k), (bv, v)):
        assert np.all(np.abs(got - want) <= bound * 1.001 + np.abs(want) * rel + 1e-6)
    assert bytes(cachegen.decode(stored, page.n_tokens)) == bytes(out[: len(raw)])
    return stored


@pytest.mark.parametrize("step", ["channel", "layer"])
@pytest.mark.parametrize("coder", CODERS)
@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("ggml_type", [F16, F32])
def test_round_trip_within_bound(coder: str, v_trans: bool, ggml_type: int, step: str) -> None:
    page, k, v = make_page(v_trans=v_trans, ggml_type=ggml_type, ext_bytes=4, start=256)
    params = CacheGenParams((6, 5, 4), (6, 4, 4), 16, coder, step)  # type: ignore[arg-type]
    stored = _check_round_trip(page, k, v, params)
    assert len(stored) < 0.6 * len(page.to_bytes())


@pytest.mark.parametrize("n_tokens,group", [(100, 16), (7, 16), (128, 128), (1, 1), (129, 64)])
def test_tail_pages_and_groups(n_tokens: int, group: int) -> None:
    page, k, v = make_page(n_tokens=n_tokens, v_trans=True)
    _check_round_trip(page, k, v, CacheGenParams((4,), (4,), group_tokens=group))


def test_more_bits_less_error_more_bytes() -> None:
    page, _, _ = make_page()
    raw = page.to_bytes()
    low = cachegen.encode(raw, CacheGenParams((3,), (3,)))
    high = cachegen.encode(raw, CacheGenParams((8,), (8,)))
    assert cachegen.error_bound(high) < cachegen.error_bound(low) / 10
    assert len(high) > len(low)


def test_layer_groups_give_shallow_layers_their_bits() -> None:
    page, _, _ = make_page(n_layer=6)
    stored = cachegen.encode(page.to_bytes(), CacheGenParams((8, 3), (8, 3)))
    back = page_from_bytes(cachegen.decode(stored))
    k, _ = values_of(back)
    _, want_k, _ = make_page(n_layer=6)
    err = np.abs(k - want_k).max(axis=(1, 2)) / np.abs(want_k).max(axis=(1, 2))
    assert err[:3].max() < err[3:].min() / 4  # layers 0-2: 8 bits; 3-5: 3 bits


def test_identity_form_round_trips_and_is_checked() -> None:
    params = CacheGenParams((5, 4, 4), (5, 4, 3), group_tokens=64)
    assert CacheGenParams.from_identity(params.identity()) == params
    bad: object
    for bad in (
        {**params.identity(), "version": 2},
        {**params.identity(), "name": "other"},
        {**params.identity(), "k_bits": [9, 4, 4]},
        {**params.identity(), "k_bits": [4, 4]},
        {**params.identity(), "group_tokens": "64"},
        {**params.identity(), "coder": "lzma"},
        {**params.identity(), "step": "token"},
        [],
    ):
        with pytest.raises(ValueError):
            CacheGenParams.from_identity(bad)


def test_quantized_layouts_are_unsupported() -> None:
    layers = tuple(LayerLayout(Q8_0, 68, Q8_0, 68, 0) for _ in range(2))
    layout = KVLayout(v_trans=False, layers=layers)
    rows = tuple(np.zeros((4, 68), np.uint8) for _ in range(2))
    page = Page(0, 4, layout, np.zeros((4, 0), np.uint8), rows, rows)
    with pytest.raises(CodecUnsupportedError, match="F16 or F32"):
        cachegen.encode(page.to_bytes(), CacheGenParams())


def test_non_finite_values_are_unsupported() -> None:
    page, _, _ = make_page(n_layer=2, ggml_type=F32, v_trans=False)
    raw = bytearray(page.to_bytes())
    struct.pack_into("<f", raw, 28 + 24 * 2 + 40, float("inf"))
    with pytest.raises(CodecUnsupportedError, match="finite"):
        cachegen.encode(bytes(raw), CacheGenParams())


def _stored() -> tuple[bytes, bytes]:
    page, _, _ = make_page(n_layer=2, n_tokens=32, channels=16)
    raw = page.to_bytes()
    return raw, cachegen.encode(raw, CacheGenParams((4,), (4,)))


def test_unknown_version_and_codec_are_refused() -> None:
    _, stored = _stored()
    newer = bytearray(stored)
    struct.pack_into("<H", newer, 4, 2)
    with pytest.raises(UnknownCodecError, match="version 2"):
        cachegen.decode(bytes(newer))
    assert stored_codec(bytes(newer)) == "cachegen/2"
    other_coder = bytearray(stored)
    other_coder[6] = 9
    with pytest.raises(UnknownCodecError, match="coder"):
        cachegen.decode(bytes(other_coder))
    with pytest.raises(UnknownCodecError):
        cachegen.decode(b"SKZ1" + stored[4:])


def test_header_fields_are_validated() -> None:
    raw, stored = _stored()
    # group 0, no layer groups, anchor bits, unknown flags, native size
    for offset, value in ((7, 0), (8, 0), (9, 7), (10, 4), (14, 1)):
        bad = bytearray(stored)
        bad[offset] = value
        with pytest.raises(StateFormatError):
            cachegen.decode(bytes(bad))
    with pytest.raises(StateFormatError, match="tokens"):
        cachegen.decode(stored, n_tokens=33)  # the page metadata disagrees
    bad = bytearray(stored)
    struct.pack_into("<I", bad, 12, len(raw) + 1)  # native size claimed
    with pytest.raises(StateFormatError):
        cachegen.decode(bytes(bad))
    with pytest.raises(ValueError, match="buffer"):
        cachegen.decode_into(stored, memoryview(bytearray(len(raw) - 1)))
    with pytest.raises(ValueError, match="buffer"):
        cachegen.decode_into(stored, memoryview(bytes(len(raw))))


def test_truncated_or_damaged_payloads_raise_never_crash() -> None:
    _, stored = _stored()
    for n in sorted({0, 3, 5, 10, 17, 30, 100, len(stored) // 2, len(stored) - 1}):
        with pytest.raises(StateFormatError):
            cachegen.decode(stored[:n])
    with pytest.raises(StateFormatError):
        cachegen.decode(stored + b"\x00")
    rng = np.random.default_rng(1)
    coded_at = len(stored) - 200
    for _ in range(30):  # damaged symbols: an error, or a page of the right size (digests
        bad = bytearray(stored)  # catch such damage before the codec ever sees it)
        at = int(rng.integers(coded_at, len(stored)))
        bad[at] ^= 1 + int(rng.integers(0, 255))
        try:
            out = cachegen.decode(bytes(bad))
        except StateFormatError:
            continue
        assert len(out) == cachegen.decoded_size(stored)


def test_params_validation() -> None:
    for kw in (
        {"k_bits": (1,), "v_bits": (1,)},
        {"k_bits": (4, 4), "v_bits": (4,)},
        {"group_tokens": 0},
        {"group_tokens": 256},
        {"coder": "lzma"},
        {"step": "token"},
    ):
        with pytest.raises(ValueError):
            CacheGenParams(**kw)  # type: ignore[arg-type]


def test_fast_half_conversion_matches_the_table() -> None:
    """The decoder's integer F32-to-F16 passes (values pre-scaled by 2**-112) give the table
    conversion's bits for every normal F16 value, ties included, and at most one ulp off it for
    subnormals; a bound past F16's range takes the table path."""
    rng = np.random.default_rng(7)
    normal = np.concatenate(
        [
            rng.uniform(-65000, 65000, 20000),
            rng.normal(0, 1, 20000),
            np.float32(2.0) ** rng.uniform(-14, 15.9, 20000) * rng.choice([-1, 1], 20000),
            # exact ties between two F16 values, and values that round up into the next binade
            (np.arange(1, 1024) + 0.5) * 2.0**-10,
            np.array([65504.0, -65504.0, 2.0**-14, 1.0 - 2.0**-12]),
        ]
    ).astype(np.float32)
    sub = (rng.uniform(-1, 1, 5000) * 2.0**-14).astype(np.float32)
    for values, tol in ((normal, 0), (sub, 1)):
        want = cachegen._half_bits(values.copy())
        got = np.empty(len(values), np.uint16)
        scaled = (values.astype(np.float32) * cachegen._F16_SCALE).astype(np.float32)
        cachegen._scaled_half_bits(scaled, got, float(np.abs(scaled).max()))
        diff = np.abs(got.view(np.int16).astype(np.int32) - want.view(np.int16).astype(np.int32))
        assert int(diff.max()) <= tol
        assert np.all(np.sign(got.view(np.float16)) == np.sign(want.view(np.float16)))
    big = np.array([70000.0, -1.0], np.float32)
    got = np.empty(2, np.uint16)
    scaled = big * cachegen._F16_SCALE
    cachegen._scaled_half_bits(scaled, got, float(np.abs(scaled).max()))
    assert got.view(np.float16)[0] == np.inf and got.view(np.float16)[1] == -1.0
