"""GGUF geometry, package create/verify/load, and hub-cache sourcing, on small real GGUF files.

The GGUFs are written with the ``gguf`` package's GGUFWriter and read back with its GGUFReader:
nothing about GGUF reading is mocked, the files are just tiny so the tests stay fast.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from skippy_llama.errors import ConfigError, PackageError
from skippy_llama.packages import create as create_mod
from skippy_llama.packages.create import create_package
from skippy_llama.packages.geometry import (
    FIELDS,
    compare_geometry,
    hf_geometry,
    read_gguf_geometry,
)
from skippy_llama.packages.kvdtype import RULE_COMPUTE, RULE_DECLARATION, RULE_DEFAULT, RULE_USER
from skippy_llama.packages.loader import load_package
from skippy_llama.packages.manifest import MANIFEST_NAME, read_manifest
from skippy_llama.packages.verify import verify_package

REPO = "tiny-org/tiny-llama"
SHA = "0123456789abcdef0123456789abcdef01234567"


def write_gguf(
    path: Path,
    *,
    layers: int = 4,
    hidden: int = 64,
    heads: int | list[int] = 4,
    kv_heads: int = 2,
    vocab: int = 32,
    ctx: int = 256,
    rope: float | None = 10000.0,
    key_length: int | None = None,
    vocab_size_key: int | None = None,
    embedding: bool = True,
    split_count: int | None = None,
) -> Path:
    """A minimal llama-architecture GGUF stating the given geometry."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if rope is not None:
        w.add_rope_freq_base(rope)
    if key_length is not None:
        w.add_key_length(key_length)
    if vocab_size_key is not None:
        w.add_uint32("llama.vocab_size", vocab_size_key)
    if split_count is not None:
        w.add_uint16("split.count", split_count)
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    if embedding:
        w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))
    else:
        w.add_tensor("output_norm.weight", np.zeros((hidden,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_config(**over: Any) -> dict[str, Any]:
    """A config.json that agrees with :func:`write_gguf`'s defaults."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 32,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
    }
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf")


def meta_dir(tmp_path: Path, config: dict[str, Any], gen: dict[str, Any] | None = None) -> Path:
    d = tmp_path / "publisher"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if gen is not None:
        (d / "generation_config.json").write_text(json.dumps(gen))
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    (d / "README.md").write_text("not a publisher file the package carries")
    return d


def make(tmp_path: Path, model: Path, config: dict[str, Any] | None = None, **kw: Any) -> Path:
    out = tmp_path / "pkg"
    if config is not None:
        kw["metadata_dir"] = meta_dir(tmp_path, config, kw.pop("gen", None))
    create_package(out, gguf=[model], repo_id=REPO, revision=SHA, **kw)
    return out


# --- geometry ---------------------------------------------------------------------------------


def test_gguf_geometry_is_read_with_its_sources(model: Path) -> None:
    g = read_gguf_geometry(model)
    assert (g.architecture, g.layers, g.hidden_size, g.heads, g.kv_heads) == ("llama", 4, 64, 4, 2)
    assert (g.head_dim, g.vocab, g.context_length, g.rope_base) == (16, 32, 256, 10000.0)
    assert g.sources["layers"] == "llama.block_count"
    assert g.sources["head_dim"] == "embedding_length / head_count"
    assert g.sources["vocab"] == "token_embd.weight rows"
    assert g.split_count == 1


def test_gguf_geometry_prefers_explicit_keys(tmp_path: Path) -> None:
    g = read_gguf_geometry(
        write_gguf(tmp_path / "m.gguf", key_length=32, vocab_size_key=40, vocab=40)
    )
    assert (g.head_dim, g.sources["head_dim"]) == (32, "llama.attention.key_length")
    assert (g.vocab, g.sources["vocab"]) == (40, "llama.vocab_size")


def test_gguf_vocab_from_token_list_without_embedding(tmp_path: Path) -> None:
    g = read_gguf_geometry(write_gguf(tmp_path / "m.gguf", vocab=48, embedding=False, rope=None))
    assert (g.vocab, g.sources["vocab"]) == (48, "tokenizer.ggml.tokens length")
    assert g.rope_base is None and "rope_base" not in g.sources


def test_per_layer_head_counts(tmp_path: Path) -> None:
    uniform = read_gguf_geometry(write_gguf(tmp_path / "u.gguf", heads=[4, 4, 4, 4]))
    assert uniform.heads == 4
    varied = read_gguf_geometry(write_gguf(tmp_path / "v.gguf", heads=[4, 8, 4, 8]))
    assert varied.heads is None and varied.head_dim is None


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(PackageError, match="not a readable GGUF"):
        read_gguf_geometry(bad)


def test_all_fields_match(model: Path) -> None:
    cmp = compare_geometry(read_gguf_geometry(model), hf_config(head_dim=16))
    assert cmp.mismatches == ()
    assert cmp.compared == FIELDS


MISMATCHES = [
    ("layers", {"num_hidden_layers": 5}, "num_hidden_layers=5", "llama.block_count=4"),
    ("hidden_size", {"hidden_size": 128}, "hidden_size=128", "llama.embedding_length=64"),
    ("heads", {"num_attention_heads": 8}, "num_attention_heads=8", "head_count=4"),
    ("kv_heads", {"num_key_value_heads": 4}, "num_key_value_heads=4", "head_count_kv=2"),
    ("head_dim", {"head_dim": 32}, "head_dim=32", "embedding_length / head_count=16"),
    ("vocab", {"vocab_size": 33}, "vocab_size=33", "token_embd.weight rows=32"),
    ("context_length", {"max_position_embeddings": 512}, "max_position_embeddings=512", "=256"),
    ("rope_base", {"rope_theta": 500000.0}, "rope_theta=500000.0", "rope.freq_base=10000.0"),
]


@pytest.mark.parametrize(("field", "over", "cfg_text", "gguf_text"), MISMATCHES)
def test_each_field_mismatch_is_named(
    model: Path, field: str, over: dict[str, Any], cfg_text: str, gguf_text: str
) -> None:
    cmp = compare_geometry(read_gguf_geometry(model), hf_config(**over))
    assert [m.field for m in cmp.mismatches] == [field]
    text = cmp.mismatches[0].describe()
    assert cfg_text in text and gguf_text in text


def test_fields_stated_on_one_side_only_are_not_compared(model: Path) -> None:
    cfg = hf_config(num_key_value_heads=None, rope_theta=None, head_dim=None)
    cmp = compare_geometry(read_gguf_geometry(model), cfg)
    assert cmp.mismatches == ()
    assert "kv_heads" not in cmp.compared and "rope_base" not in cmp.compared
    statuses = {c.field: c.status for c in cmp.checks}
    assert statuses["kv_heads"] == "gguf_only"


def test_config_shapes(model: Path) -> None:
    g = read_gguf_geometry(model)
    nested = {"model_type": "llava", "text_config": hf_config(num_hidden_layers=9)}
    assert hf_geometry(nested)["layers"] == ("text_config.num_hidden_layers", 9)
    assert [m.field for m in compare_geometry(g, nested).mismatches] == ["layers"]
    v5 = hf_config(rope_theta=None, rope_parameters={"rope_theta": 10000, "rope_type": "default"})
    assert hf_geometry(v5)["rope_base"] == ("rope_parameters.rope_theta", 10000)
    assert compare_geometry(g, v5).mismatches == ()
    # float32 storage in the GGUF: a value equal up to float32 rounding is the same value
    assert compare_geometry(g, hf_config(rope_theta=10000.0000001)).mismatches == ()
    # booleans are not numbers here
    assert "layers" not in hf_geometry({"num_hidden_layers": True})


# --- create / verify / load -------------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_create_lists_every_file_with_size_and_sha256(tmp_path: Path, model: Path) -> None:
    pkg = make(tmp_path, model, hf_config(), gen={"bos_token_id": 1})
    m = read_manifest(pkg)
    assert (m.repo_id, m.revision, m.gguf) == (REPO, SHA, ["tiny.gguf"])
    listed = {f.path: f for f in m.files}
    on_disk = sorted(
        p.relative_to(pkg).as_posix()
        for p in pkg.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME
    )
    assert (
        sorted(listed)
        == on_disk
        == [
            "metadata/config.json",
            "metadata/generation_config.json",
            "metadata/tokenizer_config.json",
            "tiny.gguf",
        ]
    )
    for rel, entry in listed.items():
        assert entry.size == (pkg / rel).stat().st_size
        assert entry.sha256 == sha256(pkg / rel)
    assert sha256(pkg / "tiny.gguf") == sha256(model)
    assert m.geometry == read_gguf_geometry(model)
    assert m.validation.publisher_metadata == "validated"
    assert set(m.validation.compared_fields) == set(FIELDS) - {"head_dim"}
    assert not list(tmp_path.glob(".pkg.partial-*"))


def test_validated_package_resolves_from_publisher(tmp_path: Path, model: Path) -> None:
    pkg = make(tmp_path, model, hf_config(torch_dtype="float32"))
    report = verify_package(pkg)
    assert report.intact and report.verdict == "validated"
    loaded = load_package(pkg)
    assert loaded.gguf_path == pkg.resolve() / "tiny.gguf"
    assert loaded.publisher is not None and loaded.publisher_reason is None
    assert loaded.publisher.revision == SHA
    r = loaded.resolve()
    assert (r.type_k, r.type_v, r.rule) == ("F32", "F32", RULE_COMPUTE)
    assert (r.ggml_type_k, r.ggml_type_v) == (0, 0)


def test_declared_q8_and_user_override(tmp_path: Path, model: Path) -> None:
    pkg = make(tmp_path, model, hf_config(), gen={"kv_cache_dtype": "q8_0"})
    loaded = load_package(pkg)
    r = loaded.resolve()
    assert (r.type_k, r.type_v, r.rule) == ("Q8_0", "Q8_0", RULE_DECLARATION)
    assert "generation_config.json kv_cache_dtype='q8_0'" in r.detail
    assert r.llama_kwargs() == {"type_k": 8, "type_v": 8}
    o = loaded.resolve(user_k="f16", user_v="f16")
    assert (o.type_k, o.type_v, o.rule) == ("F16", "F16", RULE_USER)


def test_package_without_metadata_stays_readable(tmp_path: Path, model: Path) -> None:
    pkg = make(tmp_path, model)
    assert not (pkg / "metadata").exists()
    report = verify_package(pkg)
    assert report.intact and report.verdict == "absent"
    loaded = load_package(pkg)
    assert loaded.publisher is None
    r = loaded.resolve()
    assert (r.type_k, r.type_v, r.rule) == ("F16", "F16", RULE_DEFAULT)
    assert "no publisher metadata" in r.skipped[RULE_COMPUTE]


def test_geometry_mismatch_rejects_publisher_metadata(tmp_path: Path, model: Path) -> None:
    pkg = make(tmp_path, model, hf_config(num_hidden_layers=40, kv_cache_dtype="q8_0"))
    m = read_manifest(pkg)
    assert m.validation.publisher_metadata == "rejected"
    assert any("num_hidden_layers=40" in r for r in m.validation.reasons)
    loaded = load_package(pkg)  # still loads: rejected metadata is not an error
    assert loaded.publisher is None and loaded.verification.verdict == "rejected"
    assert loaded.publisher_reason is not None and "layers" in loaded.publisher_reason
    r = loaded.resolve()
    # the forged config's Q8 declaration is not used
    assert (r.type_k, r.type_v, r.rule) == ("F16", "F16", RULE_DEFAULT)
    assert "num_hidden_layers=40" in r.skipped[RULE_DECLARATION]


def test_config_stating_no_geometry_is_rejected(tmp_path: Path, model: Path) -> None:
    pkg = make(tmp_path, model, {"torch_dtype": "float32"})
    report = verify_package(pkg)
    assert report.verdict == "rejected"
    assert "states none of the geometry fields" in report.reasons[0]


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("change", "culprit", "problem"),
    [
        (lambda p: flip_byte(p / "metadata/config.json", 2), "metadata/config.json", "sha256"),
        (lambda p: flip_byte(p / "tiny.gguf"), "tiny.gguf", "sha256"),
        (
            lambda p: (p / "metadata/config.json").write_text(
                json.dumps(hf_config(torch_dtype="float32"))
            ),
            "metadata/config.json",
            "size",
        ),
        (lambda p: (p / "metadata/tokenizer_config.json").unlink(), "tokenizer_config", "missing"),
        (
            lambda p: (p / "metadata/extra.json").write_text("{}"),
            "metadata/extra.json",
            "not listed",
        ),
    ],
    ids=["edited-config", "edited-gguf", "resized-config", "missing-file", "unlisted-file"],
)
def test_tampering_names_the_file(
    tmp_path: Path, model: Path, change: Any, culprit: str, problem: str
) -> None:
    pkg = make(tmp_path, model, hf_config())
    change(pkg)
    report = verify_package(pkg)
    assert report.verdict == "tampered" and not report.intact
    assert any(culprit in p.path and problem in p.problem for p in report.problems), report.problems
    with pytest.raises(PackageError, match="failed verification") as err:
        load_package(pkg)
    assert culprit in str(err.value)


def test_edited_manifest_geometry_is_caught(tmp_path: Path, model: Path) -> None:
    pkg = make(tmp_path, model, hf_config())
    raw = json.loads((pkg / MANIFEST_NAME).read_text())
    raw["geometry"]["layers"] = 5
    (pkg / MANIFEST_NAME).write_text(json.dumps(raw))
    report = verify_package(pkg)
    assert report.verdict == "tampered"
    assert report.problems[0].path == MANIFEST_NAME
    assert "layers=5" in report.problems[0].problem


def test_skipping_hashes_checks_sizes_only(tmp_path: Path, model: Path) -> None:
    pkg = make(tmp_path, model, hf_config())
    flip_byte(pkg / "tiny.gguf")  # same size, different bytes
    assert verify_package(pkg, hashes=False).intact
    assert load_package(pkg, verify_hashes=False).verification.hashes_checked is False
    assert not verify_package(pkg, hashes=True).intact


@pytest.mark.parametrize("revision", ["main", "v1.0", "0123abc"])
def test_create_rejects_a_moving_revision(tmp_path: Path, model: Path, revision: str) -> None:
    with pytest.raises(ConfigError, match="--revision") as err:
        create_package(tmp_path / "pkg", gguf=[model], repo_id=REPO, revision=revision)
    assert repr(revision) in str(err.value) and "40-hex" in str(err.value)
    assert not (tmp_path / "pkg").exists()


def test_create_input_errors(tmp_path: Path, model: Path) -> None:
    kw: dict[str, Any] = {"repo_id": REPO, "revision": SHA}
    with pytest.raises(ConfigError, match="does not exist"):
        create_package(tmp_path / "a", gguf=[tmp_path / "missing.gguf"], **kw)
    with pytest.raises(ConfigError, match="--repo-id"):
        create_package(tmp_path / "a", gguf=[model], repo_id="justaname", revision=SHA)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(ConfigError, match="not an empty folder"):
        create_package(busy, gguf=[model], **kw)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        create_package(empty, gguf=[model], metadata_dir=empty, **kw)
    with pytest.raises(ConfigError, match="not both"):
        create_package(
            tmp_path / "a", gguf=[model], metadata_dir=tmp_path, from_hf_cache=True, **kw
        )
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{oops")
    with pytest.raises(PackageError, match=r"config\.json .* is not valid JSON"):
        create_package(tmp_path / "a", gguf=[model], metadata_dir=broken, **kw)
    # an empty existing folder is fine
    create_package(empty, gguf=[model], **kw)
    assert (empty / MANIFEST_NAME).is_file()


def test_split_count_must_match_the_files_given(tmp_path: Path) -> None:
    shard = write_gguf(tmp_path / "m-00001-of-00002.gguf", split_count=2)
    with pytest.raises(ConfigError, match=r"split.count=2 but 1 file"):
        create_package(tmp_path / "pkg", gguf=[shard], repo_id=REPO, revision=SHA)


def test_failed_create_leaves_nothing(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(src: Path, dst: Path) -> tuple[int, str]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(create_mod, "copy_hashing", disk_full)
    with pytest.raises(OSError, match="No space"):
        create_package(tmp_path / "pkg", gguf=[model], repo_id=REPO, revision=SHA)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_hardlink_mode(tmp_path: Path, model: Path) -> None:
    pkg = make(tmp_path, model, hf_config(), link="hardlink")
    assert os.path.samefile(pkg / "tiny.gguf", model)
    assert verify_package(pkg).verdict == "validated"


# --- the huggingface_hub cache ----------------------------------------------------------------


def build_hub_cache(root: Path, repo_id: str, sha: str, files: dict[str, Any]) -> Path:
    """The on-disk layout huggingface_hub writes: blobs, snapshot symlinks, refs/main."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    for name, content in files.items():
        data = json.dumps(content).encode()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    return root


def test_package_from_a_local_hub_cache(tmp_path: Path, model: Path) -> None:
    cache = build_hub_cache(
        tmp_path / "hub",
        REPO,
        SHA,
        {
            "config.json": hf_config(torch_dtype="float32"),
            "generation_config.json": {"bos_token_id": 1},
            "special_tokens_map.json": {"bos_token": "<s>"},
        },
    )
    out = tmp_path / "pkg"
    result = create_package(
        out, gguf=[model], repo_id=REPO, revision=SHA, from_hf_cache=True, hf_cache_dir=cache
    )
    assert result.manifest.metadata_names() == (
        "config.json",
        "generation_config.json",
        "special_tokens_map.json",
    )
    # copied as real files, not links into the cache
    assert not (out / "metadata" / "config.json").is_symlink()
    assert result.manifest.validation.publisher_metadata == "validated"
    r = load_package(out).resolve()
    assert (r.type_k, r.rule) == ("F32", RULE_COMPUTE)


def test_hub_cache_without_that_revision(tmp_path: Path, model: Path) -> None:
    cache = build_hub_cache(tmp_path / "hub", REPO, SHA, {"config.json": hf_config()})
    other = "f" * 40
    with pytest.raises(PackageError, match="not in the local cache") as err:
        create_package(
            tmp_path / "pkg",
            gguf=[model],
            repo_id=REPO,
            revision=other,
            from_hf_cache=True,
            hf_cache_dir=cache,
        )
    msg = str(err.value)
    assert other in msg and f"refs/main is {SHA}" in msg and "--allow-download" in msg
    assert not (tmp_path / "pkg").exists()
