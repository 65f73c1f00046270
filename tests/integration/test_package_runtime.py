"""SkippyLlama.from_package applies the resolved live K/V dtype; run and status report it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_package_cli import SHA, SMOL_CONFIG, SMOL_REPO

from skippy_llama.config import Settings
from skippy_llama.errors import PackageError
from skippy_llama.packages.create import create_package
from skippy_llama.runtime.llama import SkippyLlama

pytestmark = pytest.mark.model
F16, F32, Q8_0 = 1, 0, 8


def _package(tmp_path: Path, smollm2_path: Path, config: dict[str, object]) -> Path:
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "config.json").write_text(json.dumps(config))
    out = tmp_path / "pkg"
    create_package(
        out,
        gguf=[smollm2_path],
        repo_id=SMOL_REPO,
        revision=SHA,
        metadata_dir=meta,
        link="hardlink",
    )
    return out


@pytest.fixture(scope="module")
def q8_package(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    config = {**SMOL_CONFIG, "kv_cache_dtype": "int8"}
    return _package(tmp_path_factory.mktemp("q8"), smollm2_path, config)


def test_publisher_kv_declaration_sets_the_live_cache_types(q8_package: Path) -> None:
    llm = SkippyLlama.from_package(q8_package, n_ctx=512, verbose=False, cache_settings=Settings())
    try:
        assert llm.kv_dtype.rule == "publisher_kv_declaration"
        assert (llm.context_params.type_k, llm.context_params.type_v) == (Q8_0, Q8_0)
        assert llm.cache_identity.type_k == Q8_0  # the identity follows the live types
        out = llm.create_completion("The sea is", max_tokens=4, temperature=0.0)
        assert out["choices"][0]["text"]
    finally:
        llm.close()


def test_user_override_beats_the_package(q8_package: Path) -> None:
    llm = SkippyLlama.from_package(
        q8_package, type_k="f32", type_v="f32", n_ctx=512, verbose=False, cache_settings=Settings()
    )
    try:
        assert llm.kv_dtype.rule == "user_override"
        assert (llm.context_params.type_k, llm.context_params.type_v) == (F32, F32)
    finally:
        llm.close()


def test_compute_dtype_bf16_maps_to_f16(tmp_path: Path, smollm2_path: Path) -> None:
    pkg = _package(tmp_path, smollm2_path, {**SMOL_CONFIG, "torch_dtype": "bfloat16"})
    llm = SkippyLlama.from_package(pkg, n_ctx=512, verbose=False, cache_settings=Settings())
    try:
        assert llm.kv_dtype.rule == "publisher_compute_dtype"
        assert (llm.context_params.type_k, llm.context_params.type_v) == (F16, F16)
    finally:
        llm.close()


def test_tampered_package_refuses_to_load(tmp_path: Path, smollm2_path: Path) -> None:
    pkg = _package(tmp_path, smollm2_path, dict(SMOL_CONFIG))
    (pkg / "metadata" / "config.json").write_text(
        json.dumps({**SMOL_CONFIG, "torch_dtype": "float32"})
    )
    with pytest.raises(PackageError, match=r"config\.json"):
        SkippyLlama.from_package(pkg, n_ctx=512, verbose=False, cache_settings=Settings())


def test_run_and_status_report_the_rule(q8_package: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Tides rise and fall because", "max_tokens": 3}) + "\n"
    )
    base = [sys.executable, "-m", "skippy_llama.cli.main"]
    run = subprocess.run(
        [*base, "run", "--package", str(q8_package), "--prompts", str(prompts), "--json", "--n-ctx", "512"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["kv_dtype"]["rule"] == "publisher_kv_declaration"
    assert (report["kv_dtype"]["type_k"], report["kv_dtype"]["type_v"]) == ("Q8_0", "Q8_0")
    assert report["totals"]["identical_outputs"] == 1
    status = subprocess.run(
        [*base, "kv-cache", "status", "--package", str(q8_package), "--type-k", "f16"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert "live K/V dtype: K=F16 V=Q8_0 by user_override" in status.stdout
