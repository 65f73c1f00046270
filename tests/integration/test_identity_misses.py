"""Every newly covered identity field, with the real model and a real L3 directory.

For each field: pages are written under one value; a process reopening the store with another
value must miss (cold, no cached tokens) and answer exactly as plain ``llama_cpp.Llama`` with that
value; the same value must hit, so each test can fail. Fields that are KV-neutral on this build
(the batch split with flash attention off for split-invariant weights, offload settings on CPU)
must hit.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
from modelhelpers import TEXT, last_logits

from skippy_llama.config import Settings
from skippy_llama.events import CacheEvent
from skippy_llama.identity import file_digest
from skippy_llama.packages.create import create_package
from skippy_llama.packages.manifest import read_manifest
from skippy_llama.runtime.llama import SkippyLlama

pytestmark = pytest.mark.model

N_CTX = 512
PROMPT = TEXT + "In the logbook that night the keeper wrote"
N_EMBD, N_EMBD_KV, RANK = 576, 192, 8


@pytest.fixture(autouse=True)
def _private_memo(tmp_path: Path) -> Iterator[None]:
    """Keep the model-digest memo out of the real home."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    yield
    if old is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = old


def _settings(store: Path) -> Settings:
    return Settings(l3={"mode": "fixed", "budget": "1GiB", "directory": str(store)})


def _skippy(model: Path, store: Path, kwargs: dict[str, Any]) -> tuple[str, CacheEvent]:
    llm = SkippyLlama(
        str(model), n_ctx=N_CTX, verbose=False, cache_settings=_settings(store), **kwargs
    )
    try:
        out = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)
        event = llm.last_cache_event
        assert event is not None
        disk = llm.prefix_cache.disk
        assert disk is not None and llm.flush_cache(60)
    finally:
        llm.close()
    return str(out["choices"][0]["text"]), event  # type: ignore[index]


def _plain(model: Path, kwargs: dict[str, Any]) -> str:
    llm = llama_cpp.Llama(str(model), n_ctx=N_CTX, verbose=False, **kwargs)
    try:
        out = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)
    finally:
        llm.close()
    return str(out["choices"][0]["text"])  # type: ignore[index]


def _write_then_read(
    model: Path, store: Path, write: dict[str, Any], read: dict[str, Any]
) -> tuple[str, CacheEvent]:
    _, first = _skippy(model, store, write)
    assert first.tier == "cold"
    return _skippy(model, store, read)


def _assert_miss(model: Path, store: Path, write: dict[str, Any], read: dict[str, Any]) -> None:
    out, event = _write_then_read(model, store, write, read)
    assert event.tier == "cold" and event.cached_tokens == 0, event
    assert out == _plain(model, read)


def _assert_hit(model: Path, store: Path, write: dict[str, Any], read: dict[str, Any]) -> None:
    out, event = _write_then_read(model, store, write, read)
    assert event.tier == "l3" and event.cached_tokens >= 64, event
    assert out == _plain(model, read)


def _lora(path: Path, seed: int) -> Path:
    """A valid LoRA adapter GGUF for SmolLM2: block 0's K and V projections, rank 8."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(RANK))
    for proj in ("attn_k", "attn_v"):
        # numpy shapes are ggml's reversed: lora_a ne = [n_embd, r], lora_b ne = [r, n_out]
        a = rng.normal(0, 0.5, (RANK, N_EMBD)).astype(np.float32)
        b = rng.normal(0, 0.5, (N_EMBD_KV, RANK)).astype(np.float32)
        writer.add_tensor(f"blk.0.{proj}.weight.lora_a", a)
        writer.add_tensor(f"blk.0.{proj}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("lora")
    return _lora(d / "a.gguf", 1), _lora(d / "b.gguf", 2)


def test_lora_adapter_changes_the_output(smollm2_path: Path, adapters: tuple[Path, Path]) -> None:
    # otherwise the miss tests below would prove nothing about correctness
    assert _plain(smollm2_path, {"lora_path": str(adapters[0])}) != _plain(smollm2_path, {})


@pytest.mark.parametrize(
    ("write", "read"),
    [
        ({"lora": 0}, {}),
        ({}, {"lora": 0}),
        ({"lora": 0}, {"lora": 1}),
        ({"lora": 0, "lora_scale": 1.0}, {"lora": 0, "lora_scale": 0.5}),
    ],
    ids=["lora-removed", "lora-added", "other-adapter", "other-scale"],
)
def test_lora_change_misses(
    smollm2_path: Path,
    tmp_path: Path,
    adapters: tuple[Path, Path],
    write: dict[str, Any],
    read: dict[str, Any],
) -> None:
    def kwargs(spec: dict[str, Any]) -> dict[str, Any]:
        out = dict(spec)
        if "lora" in out:
            out["lora_path"] = str(adapters[out.pop("lora")])
        return out

    _assert_miss(smollm2_path, tmp_path / "l3", kwargs(write), kwargs(read))


def test_same_lora_hits(smollm2_path: Path, tmp_path: Path, adapters: tuple[Path, Path]) -> None:
    same = {"lora_path": str(adapters[0]), "lora_scale": 0.75}
    _assert_hit(smollm2_path, tmp_path / "l3", same, same)


OVERRIDE = {"llama.rope.freq_base": 1000.0}


def _prompt_logits(model: Path, kwargs: dict[str, Any]) -> np.ndarray[Any, np.dtype[np.float32]]:
    llm = llama_cpp.Llama(str(model), n_ctx=N_CTX, verbose=False, **kwargs)
    try:
        llm.eval(llm.tokenize(PROMPT.encode()))
        return last_logits(llm)
    finally:
        llm.close()


def test_kv_overrides_change_misses(smollm2_path: Path, tmp_path: Path) -> None:
    # the override changes the K/V (so the logits); otherwise this test would prove nothing
    assert not np.array_equal(
        _prompt_logits(smollm2_path, {"kv_overrides": OVERRIDE}), _prompt_logits(smollm2_path, {})
    )
    _assert_miss(smollm2_path, tmp_path / "l3", {"kv_overrides": OVERRIDE}, {})


def test_same_kv_overrides_hit(smollm2_path: Path, tmp_path: Path) -> None:
    same = {"kv_overrides": OVERRIDE}
    _assert_hit(smollm2_path, tmp_path / "l3", same, same)


@pytest.mark.parametrize("field", ["n_batch", "n_ubatch"])
def test_batch_split_misses_with_flash_attention(
    smollm2_path: Path, tmp_path: Path, field: str
) -> None:
    write = {"flash_attn": True, "n_batch": 64, "n_ubatch": 64}
    _assert_miss(smollm2_path, tmp_path / "l3", write, {**write, field: 32})


def test_same_batch_split_hits_with_flash_attention(smollm2_path: Path, tmp_path: Path) -> None:
    same = {"flash_attn": True, "n_batch": 64, "n_ubatch": 64}
    _assert_hit(smollm2_path, tmp_path / "l3", same, same)


def test_batch_split_is_neutral_on_cpu_without_flash_attention(
    smollm2_path: Path, tmp_path: Path
) -> None:
    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("GPU build: the batch split changes K/V bytes, so it is identity there")
    _assert_hit(
        smollm2_path,
        tmp_path / "l3",
        {"n_batch": 256, "n_ubatch": 256},
        {"n_batch": 64, "n_ubatch": 32},
    )


@pytest.fixture(scope="module")
def repacked_model(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 requantized to Q4_K_M: weights ggml repacks for the CPU (AVX2, Arm), whose
    prefill depends on the batch split (measured: splitting 24 tokens changes the last logits
    at 17 of 23 points; a page prefilled 50 tokens at a time restored under a 32-token split
    answered 0.41 away from cold before the split entered the identity)."""
    import ctypes

    out = tmp_path_factory.mktemp("q4km") / "smollm2-q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(
        str(smollm2_path).encode(), str(out).encode(), ctypes.byref(params)
    )
    assert rc == 0
    return out


SPLIT_50: dict[str, Any] = {"n_batch": 50, "n_ubatch": 50}


def _require_split_dependent(model: Path) -> None:
    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("GPU build: the batch split is identity there for every model")
    llm = SkippyLlama(str(model), n_ctx=N_CTX, verbose=False, **SPLIT_50)
    try:
        if llm.granule == 1:
            pytest.skip("this CPU does not repack Q4_K weights: the prefill is split-invariant")
    finally:
        llm.close()


@pytest.mark.parametrize(
    "read", [{"n_batch": 100, "n_ubatch": 50}, {"n_batch": 50, "n_ubatch": 25}], ids=str
)
def test_batch_split_misses_where_the_cpu_prefill_depends_on_it(
    repacked_model: Path, tmp_path: Path, read: dict[str, Any]
) -> None:
    _require_split_dependent(repacked_model)
    _assert_miss(repacked_model, tmp_path / "l3", SPLIT_50, read)


def test_same_batch_split_hits_where_the_cpu_prefill_depends_on_it(
    repacked_model: Path, tmp_path: Path
) -> None:
    _require_split_dependent(repacked_model)
    _assert_hit(repacked_model, tmp_path / "l3", SPLIT_50, SPLIT_50)


def test_offload_settings_are_neutral_on_cpu(smollm2_path: Path, tmp_path: Path) -> None:
    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("GPU build: offload settings are identity here (unit-tested rule)")
    _assert_hit(
        smollm2_path,
        tmp_path / "l3",
        {"n_gpu_layers": 0, "offload_kqv": True},
        {"n_gpu_layers": -1, "offload_kqv": False, "op_offload": False},
    )


def test_context_length_is_not_identity_without_longrope(
    smollm2_path: Path, tmp_path: Path
) -> None:
    # SmolLM2 has no LongRoPE factors: another n_ctx keeps its pages (the rule is unit-tested)
    store = tmp_path / "l3"
    _skippy(smollm2_path, store, {})
    llm = SkippyLlama(
        str(smollm2_path), n_ctx=N_CTX * 2, verbose=False, cache_settings=_settings(store)
    )
    try:
        out = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)
        event = llm.last_cache_event
        assert "context.n_ctx" not in llm.cache_identity.params
    finally:
        llm.close()
    assert event is not None and event.tier == "l3"
    assert out["choices"][0]["text"] == _plain(smollm2_path, {})  # type: ignore[index]


def test_in_place_rewrite_with_restored_mtime_changes_the_identity(
    smollm2_path: Path, tmp_path: Path
) -> None:
    model = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2_path, model)
    store = tmp_path / "l3"
    _, first = _skippy(model, store, {})
    digest = file_digest(model)
    before = model.stat()
    with model.open("r+b") as f:  # flip one byte of the last tensor: same size, same inode
        f.seek(before.st_size - 1)
        last = f.read(1)
        f.seek(before.st_size - 1)
        f.write(bytes([last[0] ^ 0x01]))
    os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (model.stat().st_size, model.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    llm = SkippyLlama(str(model), n_ctx=N_CTX, verbose=False, cache_settings=_settings(store))
    try:
        assert llm.cache_identity.model.digest != digest
        llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)
        event = llm.last_cache_event
    finally:
        llm.close()
    assert first.tier == "cold" and event is not None and event.tier == "cold"


def test_l1_only_hashes_nothing(smollm2_path: Path, tmp_path: Path) -> None:
    llm = SkippyLlama(str(smollm2_path), n_ctx=N_CTX, verbose=False, cache_settings=Settings())
    try:
        assert not llm.cache_identity.durable
        llm.create_completion(PROMPT, max_tokens=4, temperature=0.0)
        llm.create_completion(PROMPT, max_tokens=4, temperature=0.0)
        event = llm.last_cache_event
    finally:
        llm.close()
    assert event is not None and event.tier == "l1"  # the per-process identity still serves L1
    assert not (tmp_path / "xdg" / "skippy-llama").exists()  # no digest was computed


def test_from_package_reuses_the_verified_sha256(smollm2_path: Path, tmp_path: Path) -> None:
    from test_package_cli import SHA, SMOL_CONFIG, SMOL_REPO

    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "config.json").write_text(json.dumps(SMOL_CONFIG))
    pkg = tmp_path / "pkg"
    create_package(
        pkg, gguf=[smollm2_path], repo_id=SMOL_REPO, revision=SHA, metadata_dir=meta, link="copy"
    )
    sha = {f.path: f.sha256 for f in read_manifest(pkg).files}
    manifest = read_manifest(pkg)
    llm = SkippyLlama.from_package(
        pkg, n_ctx=N_CTX, verbose=False, cache_settings=_settings(tmp_path / "l3")
    )
    try:
        assert llm.cache_identity.model.digest == "sha256:" + sha[manifest.gguf[0]]
    finally:
        llm.close()


GPU = bool(llama_cpp.llama_supports_gpu_offload())
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a GPU build of llama-cpp-python")
#: Canonical batching reuses whole micro-batches on GPU builds: small ones, so PROMPT has some.
SPLIT = {"n_batch": 64, "n_ubatch": 64}


@needs_gpu
def test_gpu_identity_names_the_offload_and_device(smollm2_path: Path, tmp_path: Path) -> None:
    llm = SkippyLlama(
        str(smollm2_path),
        n_ctx=N_CTX,
        n_gpu_layers=-1,
        verbose=False,
        cache_settings=_settings(tmp_path / "l3"),
    )
    try:
        params = llm.cache_identity.params
    finally:
        llm.close()
    for key in ("model.n_gpu_layers", "context.offload_kqv", "context.n_batch", "device_names"):
        assert key in params
    assert any(not name.startswith("CPU") for name in params["device_names"])


@needs_gpu
@pytest.mark.parametrize(
    ("write", "read"),
    [
        ({"n_gpu_layers": 0, **SPLIT}, {"n_gpu_layers": -1, **SPLIT}),
        ({"n_gpu_layers": -1, **SPLIT}, {"n_gpu_layers": -1, "offload_kqv": False, **SPLIT}),
        ({"n_gpu_layers": -1, **SPLIT}, {"n_gpu_layers": -1, "op_offload": False, **SPLIT}),
    ],
    ids=["n_gpu_layers", "offload_kqv", "op_offload"],
)
def test_offload_change_misses_on_gpu(
    smollm2_path: Path, tmp_path: Path, write: dict[str, Any], read: dict[str, Any]
) -> None:
    _assert_miss(smollm2_path, tmp_path / "l3", write, read)


@needs_gpu
def test_same_offload_hits_on_gpu(smollm2_path: Path, tmp_path: Path) -> None:
    same = {"n_gpu_layers": -1, **SPLIT}
    _assert_hit(smollm2_path, tmp_path / "l3", same, same)
