"""Parsing llama.cpp sequence-state blobs: fields, zero-copy views, corruption, layout identity."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from statefixtures import F16, F32, Q8_0, Built, Spec, build_state, make_content, shuffled

from skippy_llama.errors import LayoutMismatchError, StateFormatError
from skippy_llama.state import (
    KVLayout,
    LayerLayout,
    SequenceState,
    assemble,
    check_layout,
    cut_pages,
    page_from_bytes,
    parse_state,
    slice_state,
)

SPECS = [
    Spec(n_layer=1, k_type=F16, v_type=F16, v_trans=False),
    Spec(n_layer=3, k_type=F16, v_type=F16, v_trans=True),
    Spec(n_layer=2, k_type=F32, v_type=F32, n_embd_k=8, n_embd_v=16, v_trans=True),
    Spec(n_layer=2, k_type=Q8_0, v_type=Q8_0, n_embd_k=64, n_embd_v=32, v_trans=False),
    Spec(n_layer=2, k_type=Q8_0, v_type=F16, v_trans=True),
    Spec(n_layer=2, n_embd_k=(32, 16), n_embd_v=(16, 48), v_trans=True),
    Spec(n_layer=2, v_trans=False, n_stream=2, stream=1),
    Spec(n_layer=1, v_trans=True, n_stream=3, stream=1, ext_bytes=12),
    Spec(n_layer=2, v_trans=False, ext_bytes=12),
]
SPEC_IDS = [
    f"L{s.n_layer}-k{s.k_type}-v{s.v_type}-t{int(s.v_trans)}-s{s.stream}of{s.n_stream}-x{s.ext_bytes}"
    for s in SPECS
]

SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def expected_layout(spec: Spec) -> KVLayout:
    layers = []
    for il in range(spec.n_layer):
        if spec.v_trans:
            elem = 4 if spec.v_type == F32 else 2
            v_unit, v_embd = elem, spec.embd_v(il)
        else:
            v_unit, v_embd = spec.v_row(il), 0
        layers.append(LayerLayout(spec.k_type, spec.k_row(il), spec.v_type, v_unit, v_embd))
    return KVLayout(
        v_trans=spec.v_trans,
        layers=tuple(layers),
        n_stream=spec.n_stream,
        stream=spec.stream,
        ext_bytes=spec.ext_bytes,
    )


def parse(built: Built, spec: Spec) -> SequenceState:
    return parse_state(built.data, ext_bytes=spec.ext_bytes)


# ---------------------------------------------------------------------------------------------
# well-formed blobs


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("shuffle", [False, True], ids=["sorted", "shuffled"])
def test_parse_reads_every_field(spec: Spec, shuffle: bool) -> None:
    n = 11
    content = make_content(spec, n, seed=3)
    order = shuffled(n, seed=5) if shuffle else list(range(n))
    built = build_state(content, order=order, seq_id=42)
    state = parse(built, spec)

    assert state.seq_id == 42
    assert state.n_tokens == n
    assert state.layout == expected_layout(spec)
    assert state.layout.bytes_per_token == spec.bytes_per_token()
    assert state.positions.tolist() == order
    assert state.ext.shape == (n, spec.ext_bytes)
    np.testing.assert_array_equal(state.ext, content.ext[order])
    for il in range(spec.n_layer):
        np.testing.assert_array_equal(state.k[il], content.k[il][order])
        if spec.v_trans:
            layer = state.layout.layers[il]
            cube = state.v[il].reshape(layer.v_embd, n, layer.v_unit).transpose(1, 0, 2)
            np.testing.assert_array_equal(cube.reshape(n, -1), content.v[il][order])
        else:
            np.testing.assert_array_equal(state.v[il], content.v[il][order])
    assert (state.order() is None) == (not shuffle)


def test_blob_size_is_header_plus_bytes_per_token() -> None:
    spec = Spec(n_layer=3, v_trans=True)
    content = make_content(spec, 20)
    one = len(build_state(content, 1).data)
    for n in (1, 7, 20):
        state = parse_state(build_state(content, n).data)
        assert len(build_state(content, n).data) == one + (n - 1) * state.layout.bytes_per_token


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_parse_is_zero_copy_when_sorted(spec: Spec) -> None:
    content = make_content(spec, 9, seed=1)
    blob = build_state(content).data
    whole = np.frombuffer(blob, dtype=np.uint8)
    state = parse_state(blob, ext_bytes=spec.ext_bytes)
    for arr in (*state.k, *state.v):
        assert np.shares_memory(arr, whole)
    if spec.ext_bytes:
        assert np.shares_memory(state.ext, whole)
    # pages cut from a sorted state are views of the blob too
    for page in cut_pages(state, 4):
        for arr in (*page.k, *page.v):
            assert np.shares_memory(arr, whole)


def test_parse_accepts_bytearray_and_memoryview_zero_copy() -> None:
    spec = Spec(n_layer=2, v_trans=True)
    buf = bytearray(build_state(make_content(spec, 5)).data)
    for blob in (buf, memoryview(buf)):
        state = parse_state(blob)
        assert state.layout == expected_layout(spec)
        assert all(np.shares_memory(a, np.frombuffer(buf, np.uint8)) for a in state.k)


@pytest.mark.parametrize("n_stream,stream", [(1, 0), (3, 2)])
def test_empty_state(n_stream: int, stream: int) -> None:
    spec = Spec(n_stream=n_stream, stream=stream)
    state = parse_state(build_state(make_content(spec, 4), 0).data)
    assert state.n_tokens == 0
    assert state.layout.n_layer == 0
    assert state.layout.n_stream == n_stream
    assert state.order() is None
    assert cut_pages(state, 4) == []
    with pytest.raises(StateFormatError, match="no pages"):
        assemble([], state.layout)


# ---------------------------------------------------------------------------------------------
# positions


@pytest.mark.parametrize(
    "order",
    [
        [0, 1, 2, 2, 4],  # duplicate
        [0, 1, 2, 3, 5],  # gap
        [1, 2, 3, 4, 5],  # does not start at 0
        [4, 3, 1, 0, 0],  # shuffled duplicate
        [0, 1, -1, 2, 3],  # negative
        [0, 1, 2, 3, 2**31 - 1],
    ],
)
def test_non_contiguous_or_duplicated_positions(order: list[int]) -> None:
    spec = Spec(n_layer=2, v_trans=True)
    state = parse_state(build_state(make_content(spec, 5), order=order).data)
    assert state.positions.tolist() == order
    with pytest.raises(StateFormatError, match="contiguous") as e1:
        state.order()
    with pytest.raises(StateFormatError) as e2:
        cut_pages(state, 2)
    with pytest.raises(StateFormatError) as e3:
        slice_state(state, 0, 1)
    assert all(str(e.value) for e in (e1, e2, e3))


@given(
    n=st.integers(1, 24),
    data=st.data(),
)
@SLOW
def test_any_position_multiset_other_than_a_permutation_is_rejected(
    n: int, data: st.DataObject
) -> None:
    positions = data.draw(st.lists(st.integers(-3, n + 3), min_size=n, max_size=n))
    spec = Spec(n_layer=1, v_trans=bool(n % 2))
    state = parse_state(build_state(make_content(spec, n), order=positions).data)
    if sorted(positions) == list(range(n)):
        pages = cut_pages(state, 5)
        assert sum(p.n_tokens for p in pages) == n
    else:
        with pytest.raises(StateFormatError):
            cut_pages(state, 5)


# ---------------------------------------------------------------------------------------------
# corruption


def pipeline(blob: bytes, ext_bytes: int) -> bytes | None:
    """Everything a capture does with a blob; returns the re-assembled blob (None when empty)."""
    state = parse_state(blob, ext_bytes=ext_bytes)
    pages = [page_from_bytes(p.to_bytes()) for p in cut_pages(state, 3)]
    if not pages:
        return None
    return bytes(assemble(pages, state.layout, seq_id=state.seq_id))


@st.composite
def valid_blobs(draw: st.DrawFn) -> tuple[Spec, Built]:
    spec = draw(st.sampled_from(SPECS))
    n = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**16))
    order = shuffled(n, seed) if draw(st.booleans()) else None
    return spec, build_state(
        make_content(spec, n, seed), order=order, seq_id=draw(st.integers(0, 7))
    )


def assert_rejected(blob: bytes, ext_bytes: int) -> None:
    with pytest.raises(StateFormatError) as err:
        parse_state(blob, ext_bytes=ext_bytes)
    assert str(err.value)


@given(valid_blobs(), st.data())
@SLOW
def test_truncation_at_any_length_is_rejected(
    case: tuple[Spec, Built], data: st.DataObject
) -> None:
    spec, built = case
    cut = data.draw(st.integers(0, len(built.data) - 1))
    assert_rejected(built.data[:cut], spec.ext_bytes)


@given(valid_blobs(), st.binary(min_size=1, max_size=64))
@SLOW
def test_appended_bytes_are_rejected(case: tuple[Spec, Built], extra: bytes) -> None:
    spec, built = case
    assert_rejected(built.data + extra, spec.ext_bytes)


STRUCTURAL = (
    "magic",
    "n_stream",
    "cell_count",
    "n_seq_id",
    "v_trans",
    "n_layer",
    "k_row",
    "v_row",
    "v_elem",
    "v_embd",
)
FREE = ("seq_id", "cell_seq_id", "ext", "k_data", "v_data")


@given(valid_blobs(), st.data())
@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_flipped_byte_in_any_field(case: tuple[Spec, Built], data: st.DataObject) -> None:
    spec, built = case
    span = data.draw(st.sampled_from(built.spans))
    offset = data.draw(st.integers(span.start, span.stop - 1))
    xor = data.draw(st.integers(1, 255))
    bad = bytearray(built.data)
    bad[offset] ^= xor
    blob = bytes(bad)
    original = parse_state(built.data, ext_bytes=spec.ext_bytes)

    if span.kind in STRUCTURAL:
        assert_rejected(blob, spec.ext_bytes)
        return
    state = parse_state(blob, ext_bytes=spec.ext_bytes)
    if span.kind in FREE:
        assert state.layout == original.layout
        assert pipeline(blob, spec.ext_bytes) is not None
        if original.order() is None and span.kind in ("ext", "k_data", "v_data"):
            # sorted blob: cut + serialize + assemble reproduces the corrupted bytes exactly
            assert pipeline(blob, spec.ext_bytes) == blob
    elif span.kind == "pos":
        # one changed position can never leave a permutation of 0..n-1
        assert state.layout == original.layout
        with pytest.raises(StateFormatError, match="contiguous"):
            pipeline(blob, spec.ext_bytes)
    elif span.kind in ("k_type", "v_type"):
        # the format does not constrain the type id; the changed layout is caught downstream
        assert state.layout != original.layout
        with pytest.raises(LayoutMismatchError, match=f"layer {span.layer} "):
            check_layout(original.layout, state.layout)
        pages = cut_pages(state, 4)
        with pytest.raises(LayoutMismatchError):
            assemble(pages, original.layout)
    else:  # pragma: no cover - every field kind is listed above
        raise AssertionError(f"unclassified field {span.kind}")


@given(
    valid_blobs(),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=6),
    st.integers(0, 10**6),
    st.binary(max_size=8),
)
@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_arbitrary_damage_raises_only_state_format_error(
    case: tuple[Spec, Built],
    flips: list[tuple[int, int]],
    cut: int,
    extra: bytes,
) -> None:
    spec, built = case
    bad = bytearray(built.data)
    for off, xor in flips:
        bad[off % len(bad)] ^= xor
    blob = bytes(bad[: max(cut % (len(bad) + 1), 0)]) + extra if cut % 3 == 0 else bytes(bad)
    try:
        pipeline(blob, spec.ext_bytes)
    except StateFormatError as err:
        assert str(err)


def test_error_messages_name_the_problem() -> None:
    spec = Spec(n_layer=2, v_trans=False)
    built = build_state(make_content(spec, 3))
    b = bytearray(built.data)

    def at(kind: str, layer: int = -1, cell: int = -1) -> int:
        return next(
            s.start
            for s in built.spans
            if s.kind == kind and (layer < 0 or s.layer == layer) and (cell < 0 or s.cell == cell)
        )

    cases = {
        "magic": (at("magic"), "magic"),
        "n_seq_id": (at("n_seq_id", cell=1), "sequences"),
        "v_trans": (at("v_trans"), "v_trans"),
        "n_layer": (at("n_layer") + 3, "layer count"),
        "k_row": (at("k_row", layer=1) + 7, "K row size of layer 1"),
    }
    for kind, (off, words) in cases.items():
        b2 = bytearray(b)
        b2[off] ^= 0x80 if kind != "n_seq_id" else 0x02
        with pytest.raises(StateFormatError, match=words):
            parse_state(bytes(b2))
    with pytest.raises(StateFormatError, match="truncated"):
        parse_state(built.data[:-1])
    with pytest.raises(StateFormatError, match="trailing"):
        parse_state(built.data + b"\0")


def test_two_non_empty_streams_are_rejected() -> None:
    spec = Spec(n_layer=1, n_stream=2, stream=0)
    one = build_state(make_content(spec, 2)).data
    # header, stream 0 (count + cells + data), then stream 1 holding the same cells again
    # in place of its zero count
    assert one[-4:] == b"\0\0\0\0"
    both = one[:-4] + one[12:-4]
    with pytest.raises(StateFormatError, match="both hold cells"):
        parse_state(both)


# ---------------------------------------------------------------------------------------------
# layout


def test_bytes_per_token_matches_design_measurement() -> None:
    rows = KVLayout(v_trans=False, layers=(LayerLayout(1, 384, 1, 384, 0),) * 30)
    transposed = KVLayout(v_trans=True, layers=(LayerLayout(1, 384, 1, 2, 192),) * 30)
    assert rows.bytes_per_token == 23_052
    assert transposed.bytes_per_token == 23_052
    assert rows.meta_bytes_per_cell == 12
    assert KVLayout(v_trans=True, layers=(), ext_bytes=12).meta_bytes_per_cell == 24
    assert "30 layers" in transposed.describe() and "F16" in transposed.describe()


BASE = KVLayout(
    v_trans=True,
    layers=(
        LayerLayout(1, 64, 1, 2, 32),
        LayerLayout(8, 34, 1, 2, 48),
        LayerLayout(0, 32, 0, 4, 8),
    ),
    n_stream=2,
    stream=1,
    ext_bytes=0,
)


def test_digest_is_stable_and_equal_for_equal_layouts() -> None:
    copy = KVLayout(
        v_trans=True,
        layers=tuple(LayerLayout(*dataclasses.astuple(la)) for la in BASE.layers),
        n_stream=2,
        stream=1,
    )
    assert copy == BASE
    assert copy.digest() == BASE.digest()
    assert len(BASE.digest()) == 32
    int(BASE.digest(), 16)


@given(
    field=st.sampled_from(["v_trans", "ext_bytes", "layer", "drop", "add"]),
    layer=st.integers(0, 2),
    layer_field=st.sampled_from([f.name for f in dataclasses.fields(LayerLayout)]),
    delta=st.integers(1, 1000),
)
def test_digest_changes_when_any_field_changes(
    field: str, layer: int, layer_field: str, delta: int
) -> None:
    if field == "v_trans":
        other = dataclasses.replace(BASE, v_trans=not BASE.v_trans)
    elif field == "ext_bytes":
        other = dataclasses.replace(BASE, **{field: getattr(BASE, field) + delta})
    elif field == "drop":
        other = dataclasses.replace(BASE, layers=BASE.layers[:layer] + BASE.layers[layer + 1 :])
    elif field == "add":
        other = dataclasses.replace(BASE, layers=(*BASE.layers, BASE.layers[layer]))
    else:
        old = BASE.layers[layer]
        new = dataclasses.replace(old, **{layer_field: getattr(old, layer_field) + delta})
        layers = list(BASE.layers)
        layers[layer] = new
        other = dataclasses.replace(BASE, layers=tuple(layers))
    assert other != BASE
    assert other.digest() != BASE.digest()


def test_digest_ignores_stream_placement() -> None:
    # streams place cells, they do not change page bytes: a context with more resident
    # sequences must still find pages written by one with fewer
    moved = dataclasses.replace(BASE, n_stream=BASE.n_stream + 3, stream=0)
    assert moved.digest() == BASE.digest()


def test_digest_distinguishes_swapped_layers() -> None:
    swapped = dataclasses.replace(BASE, layers=(BASE.layers[1], BASE.layers[0], BASE.layers[2]))
    assert swapped.digest() != BASE.digest()
