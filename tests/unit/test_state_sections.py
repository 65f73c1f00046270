"""Two-section (iSWA) sequence states: Gemma 3's layout is read, never paged, and damage is a
:class:`StateFormatError`.

A sliding-window model's state is llama.cpp's ``llama_kv_cache_iswa::state_write``: after the
shared magic and seq_id, the full-attention layers' cache writes its section (``n_stream`` on),
then the sliding-window layers' cache writes one of the same form holding only the window's
cells. The blobs are built with :mod:`statefixtures`, which does not use the parser.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from statefixtures import F16, Q8_0, Spec, build_state, make_content
from test_state_format import BASE as LAYOUT

from skippy_llama.errors import LayoutMismatchError, StateFormatError
from skippy_llama.state import (
    KVLayout,
    LayerLayout,
    assemble,
    check_layout,
    cut_pages,
    parse_layout,
    parse_sections,
    parse_state,
    slice_state,
)

HEADER = 8  # magic + seq_id, written once before the sections


def two_sections(
    base: Spec, swa: Spec, n: int = 9, window: int = 4, *, seed: int = 0
) -> tuple[bytes, bytes]:
    """(blob, first section alone as a blob): ``n`` cells in the first section, the last
    ``window`` of them in the second, as llama.cpp writes a sequence past its window."""
    first = build_state(make_content(base, n, seed)).data
    tail = list(range(n - window, n))
    second = build_state(make_content(swa, n, seed + 1), window, order=tail).data
    return first + second[HEADER:], first


# Gemma 3 270M in miniature: few full-attention layers, more sliding-window ones, V transposed
BASE = Spec(n_layer=1, k_type=F16, v_type=F16, n_embd_k=16, n_embd_v=16, v_trans=True)
SWA = Spec(n_layer=3, k_type=F16, v_type=F16, n_embd_k=16, n_embd_v=16, v_trans=True)


def test_two_sections_give_the_first_layout_plus_the_sliding_window_layers() -> None:
    blob, first = two_sections(BASE, SWA)
    layout = parse_layout(blob)
    one = parse_state(first).layout
    assert layout.layers == one.layers and layout.v_trans
    assert layout.swa_layers == (LayerLayout(F16, 32, F16, 2, 16),) * 3
    assert layout.n_sections == 2 and not layout.pageable and one.pageable
    assert layout == dataclasses.replace(one, swa_layers=layout.swa_layers)
    # a token inside the window has a cell in both caches: 4 layers' K and V, two cell records
    assert layout.kv_bytes_per_cell == 4 * (32 + 32)
    assert layout.bytes_per_token == 4 * 64 + 2 * 12
    assert "1 + 3 sliding-window layers" in layout.describe()
    sections = parse_sections(blob)
    assert [s.positions.tolist() for s in sections] == [list(range(9)), [5, 6, 7, 8]]


def test_one_section_layout_is_parse_states() -> None:
    built = build_state(make_content(SWA, 5)).data
    assert parse_layout(built) == parse_state(built).layout
    assert parse_layout(built).pageable and parse_layout(built).n_sections == 1


def test_a_one_section_digest_is_unchanged_and_a_second_section_changes_it() -> None:
    base = LAYOUT
    # the digest main computed before layouts had a second section: L3 stores keep matching
    assert base.digest() == "feec70b21e14b68e238787e18b4d2ff7"
    swa = dataclasses.replace(base, swa_layers=(LayerLayout(1, 64, 1, 2, 32),))
    assert swa.digest() != base.digest()
    # moving a layer between the sections is another layout
    moved = dataclasses.replace(base, layers=base.layers[:2], swa_layers=base.layers[2:])
    assert len({moved.digest(), base.digest(), swa.digest()}) == 3
    assert dataclasses.replace(swa, swa_layers=swa.swa_layers * 2).digest() != swa.digest()


def test_parse_state_refuses_the_second_section() -> None:
    blob, _ = two_sections(BASE, SWA)
    with pytest.raises(StateFormatError, match="second one, which pages cannot hold"):
        parse_state(blob)


def test_a_two_section_layout_never_matches_a_page_and_is_never_cut() -> None:
    blob, first = two_sections(BASE, SWA)
    live = parse_layout(blob)
    state = parse_state(first)
    pages = cut_pages(state, 4)
    with pytest.raises(LayoutMismatchError, match="memory section"):
        check_layout(live, pages[0].layout)
    with pytest.raises(LayoutMismatchError, match="sliding-window"):
        assemble(pages, live)
    # a live one-section layout does not take a two-section one either (either way a miss)
    with pytest.raises(LayoutMismatchError, match="memory section"):
        check_layout(state.layout, live)
    with pytest.raises(StateFormatError, match="cannot be cut"):
        slice_state(dataclasses.replace(state, layout=live), 0, 4)


def test_truncation_at_any_length_is_a_state_format_error() -> None:
    blob, first = two_sections(BASE, SWA)
    full = parse_layout(blob)
    for cut in range(len(blob)):
        if cut == len(first):
            # cut exactly after the first section: indistinguishable from a one-section state,
            # whose layout is another (no page or identity of the live one matches it)
            got = parse_layout(blob[:cut])
            assert got.pageable and got != full and got.digest() != full.digest()
            continue
        with pytest.raises(StateFormatError):
            parse_layout(blob[:cut])
        with pytest.raises(StateFormatError):
            parse_sections(blob[:cut])


def test_trailing_bytes_after_two_sections_are_refused() -> None:
    blob, _ = two_sections(BASE, SWA)
    for extra in (b"\0", b"\1\0\0\0", b"\1\0\0\0\0\0\0\0"):
        with pytest.raises(StateFormatError):
            parse_layout(blob + extra)


def test_three_sections_and_disagreeing_sections_are_refused() -> None:
    blob, _ = two_sections(BASE, SWA)
    third = build_state(make_content(SWA, 2)).data[HEADER:]
    with pytest.raises(StateFormatError, match="3 memory sections"):
        parse_layout(blob + third)
    rows = dataclasses.replace(SWA, v_trans=False)
    with pytest.raises(StateFormatError, match="v_trans"):
        parse_layout(two_sections(BASE, rows)[0])
    ext = dataclasses.replace(SWA, ext_bytes=12)
    with pytest.raises(StateFormatError):
        parse_layout(two_sections(BASE, ext)[0])
    # a second section in another stream than the first
    streams = dataclasses.replace(SWA, n_stream=2, stream=1)
    with pytest.raises(StateFormatError, match="n_stream"):
        parse_layout(two_sections(BASE, streams)[0])


def test_a_section_without_cells_or_no_section_is_refused() -> None:
    blob, first = two_sections(BASE, SWA)
    empty = build_state(make_content(SWA, 1), 0).data[HEADER:]
    with pytest.raises(StateFormatError, match="section 1 holds no cells"):
        parse_layout(first + empty)
    with pytest.raises(StateFormatError, match="no memory section"):
        parse_layout(blob[:HEADER])


@given(
    base_layers=st.integers(1, 3),
    swa_layers=st.integers(1, 4),
    v_trans=st.booleans(),
    quant=st.booleans(),
    n=st.integers(1, 7),
    window=st.integers(1, 7),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4),
    cut=st.integers(0, 10**6),
)
@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_arbitrary_damage_raises_only_state_format_error(
    base_layers: int,
    swa_layers: int,
    v_trans: bool,
    quant: bool,
    n: int,
    window: int,
    flips: list[tuple[int, int]],
    cut: int,
) -> None:
    k_type = Q8_0 if quant and not v_trans else F16
    base = Spec(n_layer=base_layers, k_type=k_type, v_trans=v_trans)
    swa = Spec(n_layer=swa_layers, k_type=k_type, v_trans=v_trans)
    blob, _ = two_sections(base, swa, n=n, window=min(window, n), seed=cut)
    assert parse_layout(blob).swa_layers == parse_sections(blob)[1].layout.layers
    bad = bytearray(blob)
    for off, xor in flips:
        bad[off % len(bad)] ^= xor
    damaged = bytes(bad[: cut % (len(bad) + 1)]) if cut % 2 else bytes(bad)
    try:
        layout = parse_layout(damaged)
    except StateFormatError as err:
        assert str(err)
    else:
        assert isinstance(layout, KVLayout)
