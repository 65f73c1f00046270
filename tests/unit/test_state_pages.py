"""Pages: cut a parsed state, serialize, parse back, assemble every prefix; corruption; layouts."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from statefixtures import F16, F32, Q8_0, Spec, build_state, make_content, shuffled

from skippy_llama.errors import LayoutMismatchError, StateFormatError
from skippy_llama.state import (
    PAGE_FORMAT_VERSION,
    KVLayout,
    LayerLayout,
    Page,
    assemble,
    check_layout,
    cut_pages,
    page_from_bytes,
    parse_state,
    slice_state,
)

SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

SPECS = [
    Spec(n_layer=3, k_type=F16, v_type=F16, v_trans=False),
    Spec(n_layer=3, k_type=F16, v_type=F16, v_trans=True),
    Spec(n_layer=2, k_type=F32, v_type=F32, n_embd_k=8, n_embd_v=16, v_trans=False),
    Spec(n_layer=2, k_type=F32, v_type=F32, n_embd_k=8, n_embd_v=16, v_trans=True),
    Spec(n_layer=2, k_type=Q8_0, v_type=Q8_0, n_embd_k=64, n_embd_v=32, v_trans=False),
    Spec(n_layer=2, k_type=Q8_0, v_type=F16, v_trans=True),
    Spec(n_layer=2, n_embd_k=(32, 16), n_embd_v=(16, 48), v_trans=True),
    Spec(n_layer=2, v_trans=True, n_stream=2, stream=1),
    Spec(n_layer=2, v_trans=False, n_stream=2, stream=1),
    Spec(n_layer=1, v_trans=True, n_stream=3, stream=1, ext_bytes=12),
]
SPEC_IDS = [
    f"L{s.n_layer}-k{s.k_type}-v{s.v_type}-t{int(s.v_trans)}-s{s.stream}of{s.n_stream}-x{s.ext_bytes}"
    for s in SPECS
]

# page header '<4sHHIIIII' and per-layer '<iQiII'
HEADER_FIELDS = [
    ("magic", 0, 4),
    ("version", 4, 6),
    ("flags", 6, 8),
    ("n_layer", 8, 12),
    ("start", 12, 16),
    ("n_tokens", 16, 20),
    ("ext_bytes", 20, 24),
    ("reserved", 24, 28),
]
HEADER_SIZE = 28
LAYER_FIELDS = [("k_type", 0, 4), ("k_row", 4, 12), ("v_type", 12, 16), ("v_unit", 16, 20),
                ("v_embd", 20, 24)]  # fmt: skip
LAYER_SIZE = 24


def round_trip_check(
    spec: Spec, n: int, page_tokens: int, keep_tail: bool, shuffle: bool, seed: int = 0
) -> None:
    content = make_content(spec, n, seed)
    order = shuffled(n, seed + 1) if shuffle else None
    state = parse_state(build_state(content, order=order).data, ext_bytes=spec.ext_bytes)
    pages = cut_pages(state, page_tokens, keep_tail=keep_tail)
    full, tail = divmod(n, page_tokens)
    assert len(pages) == full + (1 if keep_tail and tail else 0)
    stored = [page_from_bytes(p.to_bytes()) for p in pages]
    covered = 0
    for k, page in enumerate(stored, start=1):
        assert page.start == covered
        assert page.n_tokens == (page_tokens if k <= full else tail)
        covered = page.end
        got = assemble(stored[:k], state.layout)
        want = build_state(content, covered).data
        assert bytes(got) == want, f"prefix of {k} pages ({covered} tokens) differs"
        # and the pages straight from cut_pages (views, not serialized) assemble the same
        assert assemble(pages[:k], state.layout) == got
    assert covered == (n if keep_tail else full * page_tokens)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("shuffle", [False, True], ids=["sorted", "shuffled"])
@pytest.mark.parametrize(
    "n,page_tokens,keep_tail",
    [(37, 4, True), (37, 4, False), (37, 16, True), (37, 16, False), (32, 16, True),
     (32, 4, False), (3, 16, True), (1, 1, True)],
)  # fmt: skip
def test_every_prefix_round_trips(
    spec: Spec, shuffle: bool, n: int, page_tokens: int, keep_tail: bool
) -> None:
    round_trip_check(spec, n, page_tokens, keep_tail, shuffle)


@given(
    spec=st.sampled_from(SPECS),
    n=st.integers(1, 40),
    page_tokens=st.integers(1, 17),
    keep_tail=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip_property(
    spec: Spec, n: int, page_tokens: int, keep_tail: bool, shuffle: bool, seed: int
) -> None:
    round_trip_check(spec, n, page_tokens, keep_tail, shuffle, seed)


@pytest.mark.parametrize("spec", SPECS[:2] + SPECS[-3:], ids=SPEC_IDS[:2] + SPEC_IDS[-3:])
def test_assemble_with_another_seq_id_changes_only_the_ids(spec: Spec) -> None:
    n = 13
    content = make_content(spec, n, seed=9)
    state = parse_state(
        build_state(content, order=shuffled(n, 2), seq_id=0).data, ext_bytes=spec.ext_bytes
    )
    pages = [page_from_bytes(p.to_bytes()) for p in cut_pages(state, 4)]
    as0 = bytes(assemble(pages, state.layout))
    as7 = bytes(assemble(pages, state.layout, seq_id=7))
    want7 = build_state(content, seq_id=7)
    assert as7 == want7.data
    assert as0 == build_state(content, seq_id=0).data
    ids = want7.spans_of("seq_id", "cell_seq_id")
    assert len(ids) == n + 1
    differ = {i for i in range(len(as0)) if as0[i] != as7[i]}
    assert differ and all(any(s.start <= i < s.stop for s in ids) for i in differ)
    assert parse_state(as7, ext_bytes=spec.ext_bytes).seq_id == 7
    neg = bytes(assemble(pages, state.layout, seq_id=-1))
    assert neg == build_state(content, seq_id=-1).data


def test_page_fields_and_sizes() -> None:
    spec = Spec(n_layer=2, v_trans=True, ext_bytes=12)
    content = make_content(spec, 10)
    state = parse_state(build_state(content).data, ext_bytes=12)
    pages = cut_pages(state, 4)
    assert [(p.start, p.n_tokens, p.end) for p in pages] == [(0, 4, 4), (4, 4, 8), (8, 2, 10)]
    for p in pages:
        raw = p.to_bytes()
        assert len(raw) == p.nbytes
        assert raw[:4] == b"SKPG"
        assert struct.unpack_from("<H", raw, 4)[0] == PAGE_FORMAT_VERSION
        back = page_from_bytes(raw)
        assert (back.start, back.n_tokens) == (p.start, p.n_tokens)
        assert back.layout.layers == state.layout.layers
        assert back.layout.v_trans and back.layout.ext_bytes == 12
        check_layout(state.layout, back.layout)  # stream placement is not part of a page
        for a, b in zip((back.ext, *back.k, *back.v), (p.ext, *p.k, *p.v), strict=True):
            np.testing.assert_array_equal(a, b)
        assert back.to_bytes() == raw
        # page_from_bytes gives views over the stored bytes
        whole = np.frombuffer(raw, np.uint8)
        assert all(np.shares_memory(a, whole) for a in (*back.k, *back.v))
    n_layer = spec.n_layer
    assert pages[0].nbytes == HEADER_SIZE + LAYER_SIZE * n_layer + 4 * (
        state.layout.bytes_per_token - 12
    )


def test_slice_state_matches_content() -> None:
    spec = Spec(n_layer=2, v_trans=True)
    n = 12
    content = make_content(spec, n, seed=4)
    state = parse_state(build_state(content, order=shuffled(n, 8)).data)
    page = slice_state(state, 3, 9)
    assert (page.start, page.n_tokens) == (3, 6)
    for il in range(spec.n_layer):
        np.testing.assert_array_equal(page.k[il], content.k[il][3:9])
        layer = state.layout.layers[il]
        cube = page.v[il].reshape(layer.v_embd, 6, layer.v_unit).transpose(1, 0, 2)
        np.testing.assert_array_equal(cube.reshape(6, -1), content.v[il][3:9])
    for start, end in [(-1, 2), (0, 0), (5, 4), (0, n + 1)]:
        with pytest.raises(StateFormatError, match="outside"):
            slice_state(state, start, end)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_head_of_a_stored_page_assembles_like_the_shorter_state(spec: Spec) -> None:
    content = make_content(spec, 20, seed=6)
    state = parse_state(build_state(content).data, ext_bytes=spec.ext_bytes)
    first, second = cut_pages(state, 8)[:2]
    stored = page_from_bytes(second.to_bytes())
    for n in (1, 5, 8):
        blob = assemble([first, stored.head(n)], state.layout)
        assert bytes(blob) == build_state(content, 8 + n).data
    assert stored.head(8) is stored
    for n in (0, 9):
        with pytest.raises(StateFormatError, match="cannot take"):
            stored.head(n)


def test_cut_pages_limit_and_bad_page_size() -> None:
    spec = Spec(n_layer=1)
    content = make_content(spec, 20)
    state = parse_state(build_state(content).data)
    assert [p.end for p in cut_pages(state, 8, limit=19)] == [8, 16, 19]
    assert [p.end for p in cut_pages(state, 8, limit=19, keep_tail=False)] == [8, 16]
    assert [p.end for p in cut_pages(state, 8, limit=100)] == [8, 16, 20]
    assert cut_pages(state, 8, limit=0) == []
    pages = cut_pages(state, 8, limit=16)
    assert bytes(assemble(pages, state.layout)) == build_state(content, 16).data
    for bad in (0, -4):
        with pytest.raises(ValueError):
            cut_pages(state, bad)


# ---------------------------------------------------------------------------------------------
# assemble: pages that do not fit


def pages_for(spec: Spec, n: int = 12, page_tokens: int = 4) -> tuple[KVLayout, list[Page]]:
    state = parse_state(build_state(make_content(spec, n)).data, ext_bytes=spec.ext_bytes)
    return state.layout, [page_from_bytes(p.to_bytes()) for p in cut_pages(state, page_tokens)]


def test_non_consecutive_pages_are_rejected() -> None:
    layout, pages = pages_for(Spec(n_layer=2, v_trans=True))
    for bad in ([pages[0], pages[2]], [pages[1]], [pages[1], pages[2]], [pages[0], pages[0]],
                [pages[1], pages[0]], []):  # fmt: skip
        with pytest.raises(StateFormatError) as err:
            assemble(bad, layout)
        assert str(err.value)
        assert not isinstance(err.value, LayoutMismatchError)


def test_layout_mismatch_names_the_layer_and_types() -> None:
    _, f16 = pages_for(Spec(n_layer=3, k_type=F16, n_embd_k=32, v_trans=False))
    live = Spec(n_layer=3, k_type=F16, n_embd_k=32, v_trans=False)
    live_layout = parse_state(build_state(make_content(live, 2)).data).layout
    layers = list(live_layout.layers)
    layers[1] = dataclasses.replace(layers[1], k_type=Q8_0, k_row=68)
    q8 = dataclasses.replace(live_layout, layers=tuple(layers))
    with pytest.raises(LayoutMismatchError) as err:
        assemble(f16, q8)
    msg = str(err.value)
    assert "layer 1" in msg and "Q8_0" in msg and "F16" in msg
    assert "68" in msg and "64" in msg


@pytest.mark.parametrize(
    "page_spec,live_spec,words",
    [
        (Spec(v_trans=True), Spec(v_trans=False), "v_trans"),
        (Spec(n_layer=2), Spec(n_layer=3), "layers"),
        (Spec(ext_bytes=12), Spec(ext_bytes=0), "cell-ext"),
        (Spec(v_type=F32, v_trans=True), Spec(v_type=F16, v_trans=True), "layer 0"),
        (Spec(n_embd_v=16), Spec(n_embd_v=32), "layer 0"),
        (Spec(k_type=Q8_0, n_embd_k=32), Spec(k_type=F16, n_embd_k=17), "layer 0"),
    ],
)
def test_pages_of_another_layout_are_rejected(page_spec: Spec, live_spec: Spec, words: str) -> None:
    _, pages = pages_for(page_spec)
    live = parse_state(
        build_state(make_content(live_spec, 2)).data, ext_bytes=live_spec.ext_bytes
    ).layout
    with pytest.raises(LayoutMismatchError, match=words) as err:
        assemble(pages, live)
    with pytest.raises(LayoutMismatchError):
        check_layout(live, pages[0].layout)
    assert "live context" in str(err.value)


def test_one_foreign_page_among_good_ones_is_rejected() -> None:
    layout, good = pages_for(Spec(n_layer=2, v_trans=True))
    _, other = pages_for(Spec(n_layer=2, v_trans=True, v_type=F32))
    with pytest.raises(LayoutMismatchError, match="layer 0"):
        assemble([good[0], other[1], good[2]], layout)


def test_layout_mismatch_message_names_a_v_embd_difference() -> None:
    _, pages = pages_for(Spec(n_layer=1, n_embd_v=48, v_trans=True))
    live = parse_state(
        build_state(make_content(Spec(n_layer=1, n_embd_v=80, v_trans=True), 2)).data
    )
    with pytest.raises(LayoutMismatchError) as err:
        assemble(pages, live.layout)
    msg = str(err.value)
    assert "48" in msg and "80" in msg, msg


# ---------------------------------------------------------------------------------------------
# stored pages: corruption


PAGE_SPECS = [SPECS[0], SPECS[1], SPECS[4], SPECS[-1]]


@st.composite
def stored_pages(draw: st.DrawFn) -> tuple[KVLayout, list[bytes], int]:
    spec = draw(st.sampled_from(PAGE_SPECS))
    n = draw(st.integers(1, 12))
    state = parse_state(
        build_state(make_content(spec, n, draw(st.integers(0, 999)))).data,
        ext_bytes=spec.ext_bytes,
    )
    raws = [p.to_bytes() for p in cut_pages(state, draw(st.integers(1, 5)))]
    return state.layout, raws, draw(st.integers(0, len(raws) - 1))


def field_at(offset: int, n_layer: int) -> str:
    for name, lo, hi in HEADER_FIELDS:
        if lo <= offset < hi:
            return name
    rel = offset - HEADER_SIZE
    if rel < LAYER_SIZE * n_layer:
        for name, lo, hi in LAYER_FIELDS:
            if lo <= rel % LAYER_SIZE < hi:
                return name
    return "payload"


@given(stored_pages(), st.data())
@SLOW
def test_truncated_or_extended_page_is_rejected(
    case: tuple[KVLayout, list[bytes], int], data: st.DataObject
) -> None:
    _, raws, i = case
    raw = raws[i]
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(StateFormatError) as err:
        page_from_bytes(raw[:cut])
    assert str(err.value)
    with pytest.raises(StateFormatError):
        page_from_bytes(raw + data.draw(st.binary(min_size=1, max_size=40)))


MUST_RAISE = {"magic", "version", "n_layer", "n_tokens", "ext_bytes", "k_row", "v_unit"}


@given(stored_pages(), st.data())
@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_flipped_page_byte(case: tuple[KVLayout, list[bytes], int], data: st.DataObject) -> None:
    layout, raws, i = case
    raw = raws[i]
    header_end = HEADER_SIZE + LAYER_SIZE * layout.n_layer
    # bias towards the header and layer table, where every field matters
    offset = data.draw(
        st.one_of(st.integers(0, header_end - 1), st.integers(header_end, len(raw) - 1))
        if len(raw) > header_end
        else st.integers(0, header_end - 1)
    )
    xor = data.draw(st.integers(1, 255))
    field = field_at(offset, layout.n_layer)
    low_byte = offset == 6 or (field == "v_embd" and (offset - HEADER_SIZE) % LAYER_SIZE == 20)
    # bit 0 of flags, or v_embd 0 -> 1 on a row layout: see the tests below
    assume(not (low_byte and xor == 1 and (field == "flags" or not layout.v_trans)))
    bad = bytearray(raw)
    bad[offset] ^= xor
    pages = [page_from_bytes(r) for r in raws]

    if field in MUST_RAISE or field in ("flags", "v_embd"):
        with pytest.raises(StateFormatError) as err:
            page_from_bytes(bytes(bad))
        assert str(err.value)
        return
    page = page_from_bytes(bytes(bad))
    pages[i] = page
    if field in ("reserved", "payload"):
        assert page.layout == page_from_bytes(raw).layout
        # the reserved word is ignored and written back as 0
        assert page.to_bytes() == (raw if field == "reserved" else bytes(bad))
        out = assemble(pages, layout)
        assert len(out) == len(assemble([page_from_bytes(r) for r in raws], layout))
    elif field == "start":
        with pytest.raises(StateFormatError, match="consecutive"):
            assemble(pages, layout)
    elif field in ("k_type", "v_type"):
        with pytest.raises(LayoutMismatchError, match="layer"):
            assemble(pages, layout)
    else:  # pragma: no cover
        raise AssertionError(field)


@pytest.mark.parametrize("v_trans", [False, True], ids=["rows", "transposed"])
def test_page_with_flipped_v_trans_flag_is_rejected(v_trans: bool) -> None:
    _, pages = pages_for(Spec(n_layer=2, v_trans=v_trans))
    bad = bytearray(pages[0].to_bytes())
    bad[6] ^= 1  # flags bit 0 = v_trans
    with pytest.raises(StateFormatError):
        page = page_from_bytes(bytes(bad))
        # what it returns instead: V views smaller than the V bytes the size check counted
        v_bytes = sum(v.size for v in page.v)
        assert v_bytes == page.n_tokens * sum(la.v_bytes_per_cell() for la in page.layout.layers)


def test_page_with_v_embd_on_row_layout_is_rejected() -> None:
    _, pages = pages_for(Spec(n_layer=1, v_trans=False))
    bad = bytearray(pages[0].to_bytes())
    bad[HEADER_SIZE + 20] ^= 1  # v_embd 0 -> 1 on a non-transposed layer
    with pytest.raises(StateFormatError):
        page_from_bytes(bytes(bad))


def test_page_header_errors_have_messages() -> None:
    layout, pages = pages_for(Spec(n_layer=2))
    raw = pages[0].to_bytes()
    with pytest.raises(StateFormatError, match="not a skippy page"):
        page_from_bytes(b"XXXX" + raw[4:])
    with pytest.raises(StateFormatError, match="version"):
        page_from_bytes(raw[:4] + struct.pack("<H", PAGE_FORMAT_VERSION + 1) + raw[6:])
    with pytest.raises(StateFormatError, match="truncated"):
        page_from_bytes(raw[:10])
    with pytest.raises(StateFormatError, match="layer table"):
        page_from_bytes(raw[: HEADER_SIZE + 5])
    with pytest.raises(StateFormatError, match="header says"):
        page_from_bytes(raw[:-1])
    zero_tokens = bytearray(raw)
    struct.pack_into("<I", zero_tokens, 16, 0)
    with pytest.raises(StateFormatError, match="implausible"):
        page_from_bytes(bytes(zero_tokens))
    assert layout.n_layer == 2


def test_page_with_layers_of_different_sizes() -> None:
    # hand-built layout check: LayerLayout per layer is kept in order through a page
    spec = Spec(n_layer=2, n_embd_k=(32, 16), n_embd_v=(16, 48), v_trans=True)
    layout, pages = pages_for(spec)
    assert layout.layers == (LayerLayout(1, 64, 1, 2, 16), LayerLayout(1, 32, 1, 2, 48))
    assert all(p.layout.layers == layout.layers for p in pages)


def test_range_state_slices_by_absolute_position() -> None:
    """A range capture (cells [p0, p1) of a sequence) is cut by absolute positions."""
    spec = Spec(n_layer=2, v_trans=True)
    content = make_content(spec, 15, seed=9)  # rows are looked up by position
    blob = build_state(content, 10, order=[p + 5 for p in shuffled(10, 3)]).data
    with pytest.raises(StateFormatError, match="contiguous from 0"):
        parse_state(blob).order()
    state = parse_state(blob, first=5)
    page = slice_state(state, 7, 12)
    assert (page.start, page.n_tokens) == (7, 5)
    for il in range(spec.n_layer):
        np.testing.assert_array_equal(page.k[il], content.k[il][7:12])
    with pytest.raises(StateFormatError, match="outside"):
        slice_state(state, 4, 8)
    assert [p.start for p in cut_pages(state, 4)] == [5, 9, 13]


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_parallel_assembly_writes_the_same_bytes(
    spec: Spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    # large blobs are assembled by a thread pool, one task per layer's K and V (transposed V
    # included); forced on here for small states, it must write exactly the sequential bytes
    import skippy_llama.state.pages as pages_module

    content = make_content(spec, 37, seed=5)
    state = parse_state(build_state(content).data, ext_bytes=spec.ext_bytes)
    pages = [page_from_bytes(p.to_bytes()) for p in cut_pages(state, 8)]
    sequential = bytes(assemble(pages, state.layout))
    monkeypatch.setattr(pages_module, "PARALLEL_BYTES", 0)
    assert bytes(assemble(pages, state.layout)) == sequential == build_state(content).data


@pytest.mark.parametrize("spec", [Spec(n_layer=2, v_trans=True), Spec(n_layer=2, ext_bytes=12)])
def test_pages_past_a_resident_prefix_assemble_at_their_positions(spec: Spec) -> None:
    """An append blob: cells [start, 20) from the page holding ``start`` onwards, at their own
    positions, byte for byte the matching slice of the whole state."""
    content = make_content(spec, 20, seed=9)
    state = parse_state(build_state(content).data, ext_bytes=spec.ext_bytes)
    pages = [page_from_bytes(p.to_bytes()) for p in cut_pages(state, 8)]
    for start in (3, 8, 13, 19):
        first = next(i for i, p in enumerate(pages) if p.start <= start < p.end)
        tail = [pages[first].span(start, pages[first].end), *pages[first + 1 :]]
        blob = assemble(tail, state.layout, start=start)
        part = parse_state(blob, ext_bytes=spec.ext_bytes, first=start)
        assert np.array_equal(part.positions, np.arange(start, 20, dtype=np.int32))
        got = Page(start, part.n_tokens, part.layout, part.ext, part.k, part.v)
        assert got.to_bytes() == slice_state(state, start, 20).to_bytes()
        with pytest.raises(StateFormatError, match="consecutive"):
            assemble(tail, state.layout)  # positions from 0 do not fit
    assert pages[0].span(0, 8) is pages[0]
    for bad in ((8, 9), (5, 5), (-1, 3)):
        with pytest.raises(StateFormatError, match="cannot take"):
            pages[0].span(*bad)
