"""The roster, the patch-queue digest and the verdict (pure: no model, no library)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from skippy_llama.errors import RosterError
from skippy_llama.roster import (
    LANES,
    PATCHES_DIR,
    SKIPPY_ABI_VERSION,
    Recipe,
    RestorePointRow,
    Roster,
    RosterRow,
    RowKey,
    decide,
    decide_points,
    expected_recipe,
    load_roster,
    parse_roster,
    queue_digest,
    queue_patches,
)
from skippy_llama.runtime import recipe as recipe_module
from skippy_llama.runtime.recipe import row_key
from skippy_llama.state.layout import KVLayout, LayerLayout

KEY = RowKey("llama", "CPU", "F16", "F16", False)
RECIPE = Recipe("0.3.36", "0c1e57098", SKIPPY_ABI_VERSION, "ab" * 32)
ROSTER = Roster(RECIPE, (RosterRow(KEY, ("range_export_slice", "append_import_exact"), "m", "d"),))


@pytest.fixture
def queue(tmp_path: Path) -> Path:
    dest = tmp_path / "patches"
    shutil.copytree(PATCHES_DIR, dest)
    return dest


def test_stock_library_gets_the_stock_verdict() -> None:
    verdict = decide(None, ROSTER, KEY)
    assert verdict.kind == "stock"
    assert not verdict.range_export and not verdict.append_import


def test_certified_row_allows_exactly_its_lanes() -> None:
    roster = Roster(RECIPE, (RosterRow(KEY, ("range_export_slice",), "m", "d"),))
    verdict = decide(RECIPE, roster, KEY)
    assert verdict.kind == "certified"
    assert verdict.range_export
    assert not verdict.append_import


@pytest.mark.parametrize(
    "library",
    [
        replace(RECIPE, queue_sha256="cd" * 32),
        replace(RECIPE, llama_cpp_python="0.3.37"),
        replace(RECIPE, llama_cpp_commit="unknown"),
    ],
)
def test_another_recipe_is_uncertified(library: Recipe) -> None:
    verdict = decide(library, ROSTER, KEY)
    assert verdict.kind == "uncertified"
    assert "another recipe" in verdict.reason
    assert not verdict.range_export and not verdict.append_import


def test_uncertified_row_and_override() -> None:
    other = replace(KEY, architecture="gemma3")
    assert decide(RECIPE, ROSTER, other).kind == "uncertified"
    forced = decide(RECIPE, ROSTER, other, allow_uncertified=True)
    assert forced.kind == "uncertified_override"
    assert forced.range_export and forced.append_import
    assert "allow_uncertified" in forced.reason


def test_no_roster_is_uncertified() -> None:
    assert decide(RECIPE, None, KEY).kind == "uncertified"


def test_unknown_abi_is_stock_even_with_override() -> None:
    library = replace(RECIPE, skippy_abi=SKIPPY_ABI_VERSION + 1)
    verdict = decide(library, ROSTER, KEY, allow_uncertified=True)
    assert verdict.kind == "stock"
    assert not verdict.append_import


def test_roster_round_trips_in_canonical_form() -> None:
    text = ROSTER.to_json()
    assert parse_roster(text) == ROSTER
    assert parse_roster(text).to_json() == text


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", "not JSON"),
        ('{"format": 99}', "format"),
        ('{"format": 1, "recipe": []}', "recipe"),
        (
            '{"format": 1, "recipe": {"llama_cpp_python": "x", "llama_cpp_commit": "y", '
            '"skippy_abi": "1", "queue_sha256": "z"}, "rows": []}',
            "skippy_abi",
        ),
    ],
)
def test_malformed_roster_is_a_roster_error(text: str, match: str) -> None:
    with pytest.raises(RosterError, match=match):
        parse_roster(text)


def test_roster_row_with_an_unknown_lane_is_refused() -> None:
    doc = ROSTER.to_json().replace("append_import_exact", "teleport")
    with pytest.raises(RosterError, match="lanes"):
        parse_roster(doc)


def test_missing_roster_file_is_none(tmp_path: Path) -> None:
    assert load_roster(tmp_path / "absent.json") is None


def test_queue_digest_changes_with_every_byte_name_and_order(queue: Path) -> None:
    base = queue_digest(queue)
    assert base == queue_digest(queue)
    names = [p.name for p in queue_patches(queue)]  # a proposed patch is only a comment there
    first = queue / names[0]
    data = first.read_bytes()
    first.write_bytes(data + b"\n")
    assert queue_digest(queue) != base
    first.write_bytes(data)
    (queue / "series").write_text("\n".join([names[1], names[0], *names[2:]]) + "\n")
    assert queue_digest(queue) != base
    (queue / "series").write_text("\n".join(names) + "\n")
    assert queue_digest(queue) == base
    renamed = queue / ("x" + names[0])
    first.rename(renamed)
    (queue / "series").write_text("\n".join([renamed.name, *names[1:]]) + "\n")
    assert queue_digest(queue) != base


def test_series_naming_a_missing_patch_is_refused(queue: Path) -> None:
    (queue / "series").write_text("9999-nonesuch.patch\n")
    with pytest.raises(RosterError, match="nonesuch"):
        queue_digest(queue)


def test_expected_recipe_names_this_checkout() -> None:
    recipe = expected_recipe()
    assert recipe.queue_sha256 == queue_digest(PATCHES_DIR)
    assert recipe.skippy_abi == SKIPPY_ABI_VERSION


def test_row_key_reads_flash_attention_from_v_transposition() -> None:
    layer = LayerLayout(k_type=1, k_row=128, v_type=8, v_unit=34, v_embd=0)
    key = row_key("llama", "CPU", KVLayout(v_trans=False, layers=(layer,)))
    assert key == RowKey("llama", "CPU", "F16", "Q8_0", True)
    trans = replace(layer, v_type=1, v_unit=2, v_embd=64)
    assert row_key("llama", "CPU", KVLayout(v_trans=True, layers=(trans,))).flash_attn is False


def test_failed_lanes_round_trip_and_are_checked() -> None:
    row = RosterRow(KEY, ("l1_stream_copy_exact",), "m", "d", (("page_restore_exact", "why"),))
    roster = Roster(RECIPE, (row,))
    text = roster.to_json()
    assert '"failed"' in text and parse_roster(text) == roster
    assert parse_roster(text).to_json() == text
    assert '"failed"' not in ROSTER.to_json()  # rows without failures keep the old form
    with pytest.raises(RosterError, match="failed"):
        parse_roster(text.replace('"page_restore_exact": "why"', '"teleport": "why"'))


def test_restore_point_rows_round_trip_and_are_checked() -> None:
    exact = RestorePointRow("qwen35", "hybrid", "CPU", False, "m", "d", True, "any prompt end", 9)
    refused = replace(exact, architecture="rwkv7", exact=False, reason="off by 0.5")
    roster = Roster(RECIPE, ROSTER.rows, (), (refused, exact))
    text = roster.to_json()
    assert parse_roster(text).to_json() == text
    assert set(parse_roster(text).restore_points) == {exact, refused}
    assert '"restore_points"' not in ROSTER.to_json()  # rosters without them keep the old form
    with pytest.raises(RosterError, match="needs its reason"):
        parse_roster(text.replace('"reason": "off by 0.5"', '"reason": ""'))


def test_restore_points_off_the_cpu_need_an_exact_row_of_this_recipe() -> None:
    row = RestorePointRow(
        "lfm2", "hybrid", "CUDA", False, "m", "d", True, "multiples of 64 tokens", 9
    )
    roster = Roster(RECIPE, ROSTER.rows, (), (row,))
    assert decide_points(RECIPE, roster, "lfm2", "CUDA", False).alignment == 64
    any_end = replace(row, positions="any prompt end")
    assert (
        decide_points(
            RECIPE, replace(roster, restore_points=(any_end,)), "lfm2", "CUDA", False
        ).alignment
        == 1
    )
    refused = [
        decide_points(None, roster, "lfm2", "CUDA", False),  # the stock library
        decide_points(RECIPE, None, "lfm2", "CUDA", False),  # no roster
        decide_points(replace(RECIPE, queue_sha256="cd" * 32), roster, "lfm2", "CUDA", False),
        decide_points(RECIPE, roster, "lfm2", "CUDA", True),  # flash attention: another row
        decide_points(RECIPE, roster, "qwen35", "CUDA", False),
        decide_points(RECIPE, roster, "lfm2", "Vulkan", False),
        decide_points(
            RECIPE,
            replace(roster, restore_points=(replace(row, exact=False, reason="0.09 off"),)),
            "lfm2",
            "CUDA",
            False,
        ),
        decide_points(
            RECIPE,
            replace(roster, restore_points=(replace(row, positions="every other Tuesday"),)),
            "lfm2",
            "CUDA",
            False,
        ),
    ]
    assert all(v.alignment is None and v.reason for v in refused)
    assert "certify.py --restore-points" in refused[4].reason


def test_the_checked_in_roster_has_a_restore_point_row_per_family() -> None:
    roster = load_roster()
    assert roster is not None
    rows = {(r.architecture, r.backend): r for r in roster.restore_points}
    for arch in ("mamba2", "qwen35", "granitehybrid", "lfm2", "gemma3"):
        assert rows[(arch, "CPU")].exact, arch
    assert rows[("gemma3", "CPU")].positions == "multiples of 512 tokens"


def test_row_key_counts_the_sliding_window_layers() -> None:
    f16 = LayerLayout(k_type=1, k_row=128, v_type=1, v_unit=2, v_embd=64)
    swa = KVLayout(v_trans=True, layers=(f16,), swa_layers=(f16,) * 5)
    assert row_key("gemma3", "CPU", swa) == RowKey("gemma3", "CPU", "F16", "F16", False)
    # layers of other types than the first name no single type: no row certifies them
    q8 = replace(f16, k_type=8, k_row=136)
    mixed = replace(swa, swa_layers=(q8,))
    assert row_key("gemma3", "CPU", mixed).type_k == "mixed"
    assert row_key("gemma3", "CPU", mixed).type_v == "F16"


def test_the_checked_in_roster_certifies_gemma3_for_l1_only() -> None:
    roster = load_roster()
    assert roster is not None
    for flash in (False, True):
        key = RowKey("gemma3", "CPU", "F16", "F16", flash)
        verdict = decide(roster.recipe, roster, key)
        assert verdict.kind == "certified", verdict.describe()
        assert verdict.lanes == ("l1_stream_copy_exact",)
        # the lanes that failed keep the stock paths, and the verdict says so and why
        assert not verdict.range_export and not verdict.append_import
        assert not verdict.allows("page_restore_exact") and not verdict.allows("restart_exact")
        assert "certified for l1_stream_copy_exact; stock paths for page_restore_exact" in (
            verdict.reason
        )
        report = verdict.to_json()
        assert report["lanes"] == ["l1_stream_copy_exact"]
        assert set(report["failed"]) == {
            "page_restore_exact",
            "range_export_slice",
            "append_import_exact",
            "restart_exact",
            "lone_decode_exact",
            "layer_copy_exact",
        }
        assert "llama_kv_cache_iswa" in report["failed"]["append_import_exact"]
        assert "llama_kv_cache_iswa" in report["failed"]["layer_copy_exact"]


def test_verdict_json_lists_the_lanes_it_allows() -> None:
    everything = decide(
        RECIPE, ROSTER, RowKey("x", "CPU", "F16", "F16", False), allow_uncertified=True
    )
    assert everything.kind == "uncertified_override"
    assert everything.to_json()["lanes"] == list(LANES)
    assert decide(None, ROSTER, KEY).to_json() == {
        "verdict": "stock",
        "reason": "stock: the llama.cpp library has no skippy patches [stock llama-cpp-python]",
        "lanes": [],
        "failed": {},
        "recipe": None,
    }
    full = decide(RECIPE, ROSTER, KEY)
    assert full.reason.endswith(
        "stock paths for page_restore_exact, l1_stream_copy_exact, restart_exact, "
        "lone_decode_exact, layer_copy_exact"
    )


@pytest.mark.parametrize("library", ["roster", "other", "stock"])
def test_native_status_reports_library_roster_and_verdict(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, library: str
) -> None:
    path = tmp_path / "roster.json"
    path.write_text(ROSTER.to_json())
    loaded = {"roster": RECIPE, "other": replace(RECIPE, queue_sha256="cd" * 32), "stock": None}
    monkeypatch.setattr(recipe_module, "library_recipe", lambda: loaded[library])
    verdict = decide(loaded[library], ROSTER, KEY)
    report = recipe_module.native_status(verdict, "m.gguf", roster_path=path)
    lines = recipe_module.format_native_status(report)
    assert report["roster"]["certifies_library"] is (library == "roster")
    assert (
        report["verdict"]["verdict"]
        == {"roster": "certified", "other": "uncertified", "stock": "stock"}[library]
    )
    assert lines[-1] == f"native verdict for m.gguf: {verdict.describe()}"
    if library == "stock":
        assert lines[0].startswith("native library: stock")
    elif library == "other":
        assert "certifies another recipe" in lines[1]
    else:
        assert "certifies it (1 rows)" in lines[1]
        assert lines[2] == f"    {KEY.describe()}: range_export_slice, append_import_exact"
    # no model: the library and roster only, and how to ask for a verdict
    bare = recipe_module.format_native_status(recipe_module.native_status(roster_path=path))
    assert "--model PATH" in bare[-1]
    missing = recipe_module.native_status(roster_path=tmp_path / "none.json")
    assert missing["roster"]["problem"].startswith("no roster")
