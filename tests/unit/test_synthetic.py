"""The synthetic model writers: files gguf-py reads back with each family's layout (no llama.cpp)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from skippy_llama.testing.synthetic import FAMILIES, Shape, vocabulary, write_model


def test_vocabulary_has_control_and_byte_tokens() -> None:
    tokens, scores, types = vocabulary()
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3 : 3 + 256] == [f"<0x{b:02X}>" for b in range(256)]
    assert len(tokens) == len(set(tokens)) == len(scores) == len(types)
    assert types[3:259] == [int(gguf.TokenType.BYTE)] * 256


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_written_file_has_the_family_layout(family: str, tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", family)
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == family
    assert reader.fields[f"{family}.block_count"].contents() == Shape().n_layer
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight"} <= names
    recurrent = {
        "mamba2": "blk.0.ssm_in.weight",
        "qwen35": "blk.0.ssm_alpha.weight",
        "granitehybrid": "blk.0.ssm_in.weight",
        "lfm2": "blk.0.shortconv.in_proj.weight",
    }[family]
    assert recurrent in names
    # the hybrids also attend (qwen35 in every 4th layer, the others in every 2nd)
    assert ("blk.3.attn_k.weight" in names) == (family != "mamba2")


def test_same_seed_same_file(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a.gguf", "lfm2", seed=3).read_bytes()
    b = write_model(tmp_path / "b.gguf", "lfm2", seed=3).read_bytes()
    c = write_model(tmp_path / "c.gguf", "lfm2", seed=4).read_bytes()
    assert a == b != c


def test_unknown_family_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no synthetic writer"):
        write_model(tmp_path / "x.gguf", "rwkv7")
