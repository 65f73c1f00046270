"""``skippy-llama package create|verify`` in a real subprocess.

The ``model`` tests use the real SmolLM2-135M-Instruct GGUF; each CLI call that reads its
geometry pays GGUFReader's parse of the 49k-token vocabulary (seconds), so they are few.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
# An example commit id: the tests are offline, so it only has to be well-formed.
SHA = "0123456789abcdef0123456789abcdef01234567"

# SmolLM2-135M-Instruct's config.json as published (geometry and dtype fields).
SMOL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 49152,
}
SMOL_GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH", "")) if p
    )
    return subprocess.run(
        [sys.executable, "-m", "skippy_llama.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
        check=False,
    )


def write_dir(path: Path, files: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (path / name).write_text(json.dumps(content))
    return path


def tiny_gguf(path: Path) -> Path:
    """A small llama GGUF (4 layers, 64 wide) so non-model CLI tests stay fast."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(4)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_token_list([f"tok{i}" for i in range(32)])
    w.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TINY_CONFIG = {
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
}


def test_help_texts() -> None:
    top = cli("package", "--help")
    assert top.returncode == 0 and "create" in top.stdout and "verify" in top.stdout
    create = cli("package", "create", "--help")
    assert create.returncode == 0
    for flag in ("--gguf", "--repo-id", "--revision", "--metadata-dir", "--from-hf-cache"):
        assert flag in create.stdout
    assert "40-hex" in create.stdout
    verify = cli("package", "verify", "--help")
    assert verify.returncode == 0 and "--json" in verify.stdout and "exit status" in verify.stdout


def test_branch_name_is_refused_with_advice(tmp_path: Path) -> None:
    model = tiny_gguf(tmp_path / "tiny.gguf")
    meta = write_dir(tmp_path / "meta", {"config.json": TINY_CONFIG})
    r = cli(
        "package", "create", "--gguf", model, "--repo-id", "org/tiny", "--revision", "main",
        "--metadata-dir", meta, tmp_path / "pkg",
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.startswith("skippy-llama: error: --revision: revision 'main' is a branch")
    assert "40-hex commit" in r.stderr
    assert not (tmp_path / "pkg").exists()


def test_a_metadata_source_must_be_chosen(tmp_path: Path) -> None:
    model = tiny_gguf(tmp_path / "tiny.gguf")
    r = cli("package", "create", "--gguf", model, "--repo-id", "o/t", "--revision", SHA, tmp_path)
    assert r.returncode == 2
    assert "--metadata-dir" in r.stderr and "--no-metadata" in r.stderr


def test_verify_on_a_folder_that_is_not_a_package(tmp_path: Path) -> None:
    r = cli("package", "verify", tmp_path)
    assert r.returncode == 2
    assert "has no model-package.json" in r.stderr and "package create" in r.stderr


def test_hub_cache_package_via_env(tmp_path: Path) -> None:
    """HF_HUB_CACHE points huggingface_hub at a hand-built cache; nothing touches the network."""
    model = tiny_gguf(tmp_path / "tiny.gguf")
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / SHA
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    write_dir(repo / "refs", {})
    (repo / "refs" / "main").write_text(SHA)
    for name, content in {"config.json": TINY_CONFIG, "tokenizer_config.json": {}}.items():
        data = json.dumps(content).encode()
        blob = repo / "blobs" / hashlib.sha1(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    out = tmp_path / "pkg"
    r = cli(
        "package", "create", "--gguf", model, "--repo-id", "org/tiny", "--revision", SHA,
        "--from-hf-cache", out, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "metadata/config.json" in r.stdout and "publisher metadata: validated" in r.stdout
    v = cli("package", "verify", out, "--json")
    assert v.returncode == 0, v.stderr
    report = json.loads(v.stdout)
    assert report["verdict"] == "validated" and report["repo_id"] == "org/tiny"
    assert report["kv_dtype"]["type_k"] == "F32"
    assert report["kv_dtype"]["rule"] == "publisher_compute_dtype"
    # a revision the cache does not hold is an error that says what the cache does hold
    r2 = cli(
        "package", "create", "--gguf", model, "--repo-id", "org/tiny", "--revision", "e" * 40,
        "--from-hf-cache", tmp_path / "pkg2", env=env,
    )  # fmt: skip
    assert r2.returncode == 2
    assert f"refs/main is {SHA}" in r2.stderr and "--allow-download" in r2.stderr


def test_no_metadata_package(tmp_path: Path) -> None:
    model = tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "pkg"
    r = cli(
        "package", "create", "--gguf", model, "--repo-id", "org/tiny", "--revision", SHA,
        "--no-metadata", "--json", out,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    manifest = json.loads(r.stdout)
    assert manifest["validation"]["publisher_metadata"] == "absent"
    assert [f["path"] for f in manifest["files"]] == ["tiny.gguf"]
    v = cli("package", "verify", out)
    assert v.returncode == 0
    assert "publisher metadata: absent" in v.stdout
    assert "K=F16 V=F16 by default" in v.stdout


@pytest.mark.model
def test_real_model_create_verify_and_tamper(tmp_path: Path, smollm2_path: Path) -> None:
    meta = write_dir(
        tmp_path / "meta", {"config.json": SMOL_CONFIG, "generation_config.json": SMOL_GENERATION}
    )
    out = tmp_path / "smollm2-pkg"
    r = cli(
        "package", "create", "--gguf", smollm2_path, "--repo-id", SMOL_REPO, "--revision", SHA,
        "--metadata-dir", meta, out,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "publisher metadata: validated" in r.stdout
    assert "SmolLM2-135M-Instruct.Q4_1.gguf (98362432 bytes" in r.stdout

    v = cli("package", "verify", out)
    assert v.returncode == 0, v.stderr
    assert "sizes and sha256 match" in v.stdout
    assert "layers=30 hidden=576 heads=9 kv_heads=3 head_dim=64 vocab=49152 ctx=8192" in v.stdout
    assert (
        "K=F16 V=F16 by publisher_compute_dtype (config.json torch_dtype='bfloat16' → F16)"
        in v.stdout
    )

    gen = out / "metadata" / "generation_config.json"
    gen.write_text(json.dumps({**SMOL_GENERATION, "kv_cache_dtype": "q4_0"}))
    t = cli("package", "verify", out, "--json")
    assert t.returncode == 1
    report = json.loads(t.stdout)
    assert report["verdict"] == "tampered" and report["kv_dtype"] is None
    assert [p["path"] for p in report["problems"]] == ["metadata/generation_config.json"]
    assert "metadata/generation_config.json" in t.stderr and "failed verification" in t.stderr


@pytest.mark.model
def test_real_model_with_forged_config_is_not_trusted(tmp_path: Path, smollm2_path: Path) -> None:
    """A config.json of another model (24 layers, 9 KV heads) must not steer the KV dtype."""
    forged = {**SMOL_CONFIG, "num_hidden_layers": 24, "num_key_value_heads": 9}
    forged["kv_cache_dtype"] = "q8_0"
    meta = write_dir(tmp_path / "meta", {"config.json": forged})
    out = tmp_path / "pkg"
    r = cli(
        "package", "create", "--gguf", smollm2_path, "--repo-id", SMOL_REPO, "--revision", SHA,
        "--metadata-dir", meta, out,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "publisher metadata: REJECTED" in r.stdout
    assert "num_hidden_layers=24 but GGUF llama.block_count=30" in r.stdout
    assert "num_key_value_heads=9 but GGUF llama.attention.head_count_kv=3" in r.stdout

    v = cli("package", "verify", out, "--json")
    assert v.returncode == 0, v.stderr  # intact: rejected metadata is not a failure
    report = json.loads(v.stdout)
    assert report["verdict"] == "rejected" and report["intact"] is True
    status = {c["field"]: c["status"] for c in report["comparison"]}
    assert status["layers"] == status["kv_heads"] == "mismatch"
    assert status["hidden_size"] == status["vocab"] == status["rope_base"] == "match"
    kv = report["kv_dtype"]
    assert (kv["type_k"], kv["type_v"], kv["rule"]) == ("F16", "F16", "default")
    assert "num_hidden_layers=24" in kv["skipped"]["publisher_kv_declaration"]
