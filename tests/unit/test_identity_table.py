"""The identity table covers every parameter of the installed llama-cpp-python, and its rules.

Introspects ``llama_cpp.Llama.__init__`` and the ctypes ``_fields_`` of ``llama_context_params``
and ``llama_model_params``: a name the table does not classify fails, so an upgrade that adds a
parameter cannot slip past the cache identity. Needs llama_cpp, not a model.
"""

from __future__ import annotations

import ctypes
import inspect
from typing import Any

import llama_cpp
import pytest

from skippy_llama.identity import CacheIdentity, ModelIdentity
from skippy_llama.runtime.identity_params import (
    CONTEXT_FIELDS,
    LLAMA_INIT,
    MODEL_FIELDS,
    Conditions,
    canonical_kv_overrides,
    has_longrope,
    select_params,
)


def test_every_llama_init_parameter_is_classified() -> None:
    names = set(inspect.signature(llama_cpp.Llama.__init__).parameters)
    assert names - set(LLAMA_INIT) == set(), "classify these in identity_params.LLAMA_INIT"
    assert set(LLAMA_INIT) - names == set(), "stale entries in LLAMA_INIT"


@pytest.mark.parametrize(
    ("struct", "table"),
    [
        (llama_cpp.llama_context_params, CONTEXT_FIELDS),
        (llama_cpp.llama_model_params, MODEL_FIELDS),
    ],
)
def test_every_struct_field_is_classified(struct: Any, table: dict[str, Any]) -> None:
    names = {f[0] for f in struct._fields_}
    assert names - set(table) == set(), f"classify these fields of {struct.__name__}"
    assert set(table) - names == set(), f"stale entries for {struct.__name__}"


def test_every_entry_has_a_reason_and_every_via_a_target() -> None:
    targets = {f"context.{n}" for n in CONTEXT_FIELDS} | {f"model.{n}" for n in MODEL_FIELDS}
    for table in (LLAMA_INIT, CONTEXT_FIELDS, MODEL_FIELDS):
        for name, entry in table.items():
            assert entry.reason.strip(), name
            if entry.rule == "via":
                assert entry.via in targets | {"lora"}, name


def _values(**changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"lora": None, "device_names": ["CUDA0: NVIDIA H200"]}
    for prefix, table in (("context", CONTEXT_FIELDS), ("model", MODEL_FIELDS)):
        for name, entry in table.items():
            if entry.rule not in ("typed", "neutral"):
                values[f"{prefix}.{name}"] = 0
    values.update(changes)
    return values


ALL_ON = Conditions(gpu=True, flash_attn=True, longrope=True)
CPU = Conditions(gpu=False, flash_attn=False, longrope=False)
CONDITIONAL = {
    "offload": Conditions(gpu=True, flash_attn=False, longrope=False),
    "batch_split": Conditions(gpu=False, flash_attn=True, longrope=False),
    "longrope": Conditions(gpu=False, flash_attn=False, longrope=True),
}


def _root(params: dict[str, Any]) -> bytes:
    model = ModelIdentity(digest="xxh3:" + "d" * 32, architecture="llama")
    return CacheIdentity(
        model=model,
        layout_digest="l",
        type_k=1,
        type_v=1,
        flash_attn=False,
        v_trans=True,
        rope_freq_base=0.0,
        rope_freq_scale=0.0,
        yarn=(),
        n_swa=0,
        kv_unified=False,
        backend="CPU",
        params=params,
    ).root


IDENTITY_KEYS = sorted(
    [f"context.{n}" for n, e in CONTEXT_FIELDS.items() if e.rule not in ("typed", "neutral")]
    + [f"model.{n}" for n, e in MODEL_FIELDS.items() if e.rule not in ("typed", "neutral")]
    + ["lora", "device_names"]
)


@pytest.mark.parametrize("key", IDENTITY_KEYS)
def test_changing_any_identity_value_misses_where_it_applies(key: str) -> None:
    base = _root(select_params(_values(), ALL_ON))
    assert base != _root(select_params(_values(**{key: 1}), ALL_ON))


@pytest.mark.parametrize(("rule", "conditions"), sorted(CONDITIONAL.items()))
def test_conditional_rules(rule: str, conditions: Conditions) -> None:
    keys = [
        f"{prefix}.{n}"
        for prefix, table in (("context", CONTEXT_FIELDS), ("model", MODEL_FIELDS))
        for n, e in table.items()
        if e.rule == rule
    ]
    assert keys
    for key in keys:
        # in the identity exactly where the condition holds ...
        changed = select_params(_values(**{key: 7}), conditions)
        assert _root(select_params(_values(), conditions)) != _root(changed), key
        # ... and out of it on CPU with flash attention off and no LongRoPE
        assert select_params(_values(**{key: 7}), CPU) == select_params(_values(), CPU), key


def test_cpu_identity_leaves_out_batch_offload_and_context_length() -> None:
    chosen = select_params(_values(), CPU)
    for key in ("context.n_batch", "context.n_ubatch", "context.n_ctx", "model.n_gpu_layers"):
        assert key not in chosen
    for key in ("context.offload_kqv", "context.op_offload", "model.split_mode", "device_names"):
        assert key not in chosen
    for key in ("model.kv_overrides", "lora", "context.swa_full", "context.attention_type"):
        assert key in chosen


def test_a_split_dependent_cpu_prefill_puts_the_batch_split_in_the_identity() -> None:
    split = Conditions(gpu=False, flash_attn=False, longrope=False, split_dependent=True)
    chosen = select_params(_values(), split)
    assert "context.n_batch" in chosen and "context.n_ubatch" in chosen
    assert "model.n_gpu_layers" not in chosen  # still a CPU build: offload stays out
    assert _root(chosen) != _root(select_params(_values(**{"context.n_ubatch": 7}), split))


def test_gpu_identity_has_offload_and_device() -> None:
    chosen = select_params(_values(), CONDITIONAL["offload"])
    for key in (
        "model.n_gpu_layers",
        "model.split_mode",
        "model.main_gpu",
        "model.tensor_split",
        "context.offload_kqv",
        "context.op_offload",
        "device_names",
        "context.n_batch",
        "context.n_ubatch",
    ):
        assert key in chosen


def test_unclassified_or_missing_values_are_errors() -> None:
    with pytest.raises(KeyError, match="unclassified"):
        select_params(_values(**{"context.new_field": 1}), CPU)
    values = _values()
    del values["model.kv_overrides"]
    with pytest.raises(KeyError, match="kv_overrides"):
        select_params(values, CPU)


def test_kv_overrides_are_canonical_and_typed() -> None:
    assert canonical_kv_overrides(None) is None and canonical_kv_overrides({}) is None
    a = canonical_kv_overrides({"b": 1, "a": "x"})
    assert a == canonical_kv_overrides({"a": "x", "b": 1})  # order does not matter
    assert a != canonical_kv_overrides({"a": "x", "b": 1.0})
    assert canonical_kv_overrides({"k": True}) != canonical_kv_overrides({"k": 1})


def test_longrope_detection(tmp_path: Any) -> None:
    plain = tmp_path / "plain.gguf"
    plain.write_bytes(b"GGUF" + b"blk.0.attn_q.weight" * 10)
    longrope = tmp_path / "longrope.gguf"
    longrope.write_bytes(b"GGUF" + b"rope_factors_long.weight" + bytes(100))
    assert not has_longrope(str(plain))
    assert has_longrope(str(longrope))
    assert has_longrope(str(tmp_path / "missing.gguf"))  # unreadable: assume it matters


def test_pointer_fields_enter_the_identity_as_set_or_unset_never_as_addresses() -> None:
    from skippy_llama.runtime.identity_params import _plain

    params = llama_cpp.llama_context_default_params()
    fields = dict(type(params)._fields_)
    assert _plain(params.ctx_other, fields["ctx_other"]) is False
    buf = ctypes.create_string_buffer(8)
    params.ctx_other = ctypes.cast(buf, ctypes.c_void_p)
    assert _plain(params.ctx_other, fields["ctx_other"]) is True
    assert _plain(params.n_batch, fields["n_batch"]) == params.n_batch


def test_cross_backend_drops_only_the_backend_component() -> None:
    """With cross_backend, offload settings and device names leave the identity, the batch split
    stays on every build (so a CPU build and a GPU build agree on it), everything else stays."""
    gpu = Conditions(gpu=True, flash_attn=False, longrope=False, cross_backend=True)
    cpu = Conditions(gpu=False, flash_attn=False, longrope=False, cross_backend=True)
    offload = [
        f"{prefix}.{n}"
        for prefix, table in (("context", CONTEXT_FIELDS), ("model", MODEL_FIELDS))
        for n, e in table.items()
        if e.rule == "offload"
    ]
    assert offload
    for key in offload:
        assert select_params(_values(**{key: 7}), gpu) == select_params(_values(), gpu), key
    assert "device_names" not in select_params(_values(), gpu)
    assert select_params(_values(), gpu) == select_params(_values(), cpu)
    for key in ("context.n_batch", "context.n_ubatch", "model.kv_overrides", "lora"):
        assert key in select_params(_values(), cpu), key
    # off by default
    assert Conditions(gpu=True, flash_attn=False, longrope=False).cross_backend is False
