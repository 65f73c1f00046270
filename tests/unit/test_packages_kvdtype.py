"""Live K/V dtype resolution (DESIGN §6): every rule, every mapping, table-driven."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_llama.errors import ConfigError
from skippy_llama.packages.kvdtype import (
    GGML_TYPE_IDS,
    RULE_COMPUTE,
    RULE_DECLARATION,
    RULE_DEFAULT,
    RULE_USER,
    RULES,
    normalize_user_type,
    resolve_kv_dtype,
)
from skippy_llama.packages.publisher import PublisherMetadata

# A config shaped like SmolLM2-135M-Instruct's, which the cases below vary.
BASE: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}


def pub(
    config: dict[str, Any] | None = None, gen: dict[str, Any] | None = None
) -> PublisherMetadata:
    return PublisherMetadata(
        repo_id="org/name",
        revision="0" * 40,
        config={**BASE, **(config or {})},
        generation_config=gen,
    )


Cfg = dict[str, Any]


def case(
    case_id: str,
    want: str,
    rule: str,
    config: Cfg | None = None,
    gen: Cfg | None = None,
    user: tuple[Any, Any] = (None, None),
) -> Any:
    """One row: ``want`` is "K/V" ("F16/F16"); no config and no gen means no publisher."""
    k, v = want.split("/")
    return pytest.param(user[0], user[1], config, gen, k, v, rule, id=case_id)


Q8 = {"num_bits": 8, "type": "float"}
CASES = [
    # rule 4: nothing known
    case("no-metadata", "F16/F16", RULE_DEFAULT),
    # rule 3: compute dtype mappings
    case("float16", "F16/F16", RULE_COMPUTE, {"torch_dtype": "float16"}),
    case("float32", "F32/F32", RULE_COMPUTE, {"torch_dtype": "float32"}),
    case("bfloat16", "F16/F16", RULE_COMPUTE, {"torch_dtype": "bfloat16"}),
    case("fp8-e4m3fn", "F16/F16", RULE_COMPUTE, {"torch_dtype": "float8_e4m3fn"}),
    case("fp8-e5m2", "F16/F16", RULE_COMPUTE, {"torch_dtype": "float8_e5m2"}),
    case("dtype-key", "F32/F32", RULE_COMPUTE, {"dtype": "float32"}),
    case("dtype-wins", "F32/F32", RULE_COMPUTE, {"dtype": "float32", "torch_dtype": "float16"}),
    case("torch-prefix", "F16/F16", RULE_COMPUTE, {"torch_dtype": "torch.float16"}),
    case("text-config", "F32/F32", RULE_COMPUTE, {"text_config": {"torch_dtype": "float32"}}),
    case("unknown-dtype", "F16/F16", RULE_DEFAULT, {"torch_dtype": "int8"}),
    case("auto-dtype", "F16/F16", RULE_DEFAULT, {"torch_dtype": "auto"}),
    # Weight quantization never makes the cache quantized.
    case(
        "gptq-int4-weights",
        "F16/F16",
        RULE_COMPUTE,
        {"torch_dtype": "float16", "quantization_config": {"quant_method": "gptq", "bits": 4}},
    ),
    case(
        "fp8-weights",
        "F16/F16",
        RULE_COMPUTE,
        {"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8"}},
    ),
    # rule 2: explicit declarations
    case("decl-q8", "Q8_0/Q8_0", RULE_DECLARATION, {"kv_cache_dtype": "q8_0", "dtype": "bfloat16"}),
    case(
        "decl-int8-generation-config",
        "Q8_0/Q8_0",
        RULE_DECLARATION,
        {"torch_dtype": "float32"},
        {"kv_cache_dtype": "int8"},
    ),
    case("decl-q4", "Q4_0/Q4_0", RULE_DECLARATION, {"kv_cache_dtype": "int4"}),
    case(
        "decl-fp8", "F16/F16", RULE_DECLARATION, {"kv_cache_dtype": "fp8_e4m3", "dtype": "float32"}
    ),
    case(
        "decl-f32", "F32/F32", RULE_DECLARATION, {"kv_cache_dtype": "float32", "dtype": "float16"}
    ),
    case(
        "decl-per-side",
        "Q8_0/F16",
        RULE_DECLARATION,
        {"kv_cache_dtype": {"k": "q8_0", "v": "float16"}},
    ),
    case("decl-auto", "F32/F32", RULE_COMPUTE, {"kv_cache_dtype": "auto", "dtype": "float32"}),
    case("decl-unknown", "F32/F32", RULE_COMPUTE, {"kv_cache_dtype": "q3_k", "dtype": "float32"}),
    case(
        "decl-conflict",
        "F32/F32",
        RULE_COMPUTE,
        {"kv_cache_dtype": "q8_0", "torch_dtype": "float32"},
        {"kv_cache_dtype": "q4_0"},
    ),
    case(
        "decl-agree",
        "Q8_0/Q8_0",
        RULE_DECLARATION,
        {"kv_cache_dtype": "q8_0"},
        {"kv_cache_dtype": "int8"},
    ),
    case(
        "scheme-fp8",
        "F16/F16",
        RULE_DECLARATION,
        {"dtype": "float32", "quantization_config": {"kv_cache_scheme": Q8}},
    ),
    case(
        "scheme-int8",
        "Q8_0/Q8_0",
        RULE_DECLARATION,
        {"quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "int"}}},
    ),
    case(
        "scheme-int4-compression-config",
        "Q4_0/Q4_0",
        RULE_DECLARATION,
        {"compression_config": {"kv_cache_scheme": {"num_bits": 4, "type": "int"}}},
    ),
    case(
        "scheme-null",
        "F32/F32",
        RULE_COMPUTE,
        {"dtype": "float32", "quantization_config": {"kv_cache_scheme": None}},
    ),
    case(
        "scheme-int2-unsupported",
        "F16/F16",
        RULE_COMPUTE,
        {
            "dtype": "float16",
            "quantization_config": {"kv_cache_scheme": {"num_bits": 2, "type": "int"}},
        },
    ),
    # rule 1: the user wins over everything
    case(
        "user-over-declaration",
        "F32/F32",
        RULE_USER,
        {"kv_cache_dtype": "q8_0", "torch_dtype": "float16"},
        {"kv_cache_dtype": "q8_0"},
        user=("f32", "f32"),
    ),
    case("user-q4-no-metadata", "Q4_0/Q4_0", RULE_USER, user=("q4_0", "Q4_0")),
    case("user-ggml-ids", "Q8_0/Q8_0", RULE_USER, {"dtype": "float32"}, user=(8, 8)),
    case("user-k-only", "Q8_0/F32", RULE_USER, {"dtype": "float32"}, user=("q8_0", None)),
    case("user-v-only", "Q4_0/BF16", RULE_USER, {"kv_cache_dtype": "int4"}, user=(None, "bf16")),
]


@pytest.mark.parametrize(
    ("user_k", "user_v", "config", "gen", "want_k", "want_v", "want_rule"),
    CASES,
)
def test_resolution_table(
    user_k: Any,
    user_v: Any,
    config: dict[str, Any] | None,
    gen: dict[str, Any] | None,
    want_k: str,
    want_v: str,
    want_rule: str,
) -> None:
    publisher = None if config is None and gen is None else pub(config, gen)
    r = resolve_kv_dtype(user_k=user_k, user_v=user_v, publisher=publisher)
    assert (r.type_k, r.type_v, r.rule) == (want_k, want_v, want_rule)
    # Every rule is accounted for: it decided a side, or it is skipped with a reason.
    assert set(r.skipped) | {r.rule_k, r.rule_v} == set(RULES)
    assert not set(r.skipped) & {r.rule_k, r.rule_v}
    assert all(reason.strip() for reason in r.skipped.values())
    assert r.llama_kwargs() == {"type_k": GGML_TYPE_IDS[want_k], "type_v": GGML_TYPE_IDS[want_v]}


def test_quantized_types_only_when_declared_or_asked() -> None:
    """No config without a KV declaration ever yields Q8_0/Q4_0, whatever else it says."""
    configs: list[dict[str, Any]] = [
        {"torch_dtype": t}
        for t in ("float16", "bfloat16", "float32", "float8_e4m3fn", "int8", "int4", "auto")
    ]
    configs += [
        {"torch_dtype": "float16", "quantization_config": {"quant_method": m, "bits": b}}
        for m in ("gptq", "awq", "bitsandbytes")
        for b in (4, 8)
    ]
    configs += [{"num_hidden_layers": 80, "hidden_size": 8192, "torch_dtype": "bfloat16"}]
    for config in configs:
        r = resolve_kv_dtype(user_k=None, user_v=None, publisher=pub(config))
        assert r.type_k in ("F16", "F32") and r.type_v in ("F16", "F32"), config


def test_reasons_name_what_was_found() -> None:
    r = resolve_kv_dtype(user_k=None, user_v=None, publisher=pub({"torch_dtype": "bfloat16"}))
    assert r.rule == RULE_COMPUTE
    assert "torch_dtype='bfloat16'" in r.detail and "F16" in r.detail
    assert "kv_cache_dtype" in r.skipped[RULE_DECLARATION]
    assert r.skipped[RULE_USER] == "no user K/V type given"
    assert RULE_COMPUTE in r.skipped[RULE_DEFAULT]


def test_conflicting_declarations_are_reported_and_not_used() -> None:
    r = resolve_kv_dtype(
        user_k=None,
        user_v=None,
        publisher=pub({"kv_cache_dtype": "q8_0"}, {"kv_cache_dtype": "q4_0"}),
    )
    assert r.rule == RULE_DEFAULT
    reason = r.skipped[RULE_DECLARATION]
    assert (
        "conflicting" in reason and "config.json" in reason and "generation_config.json" in reason
    )


def test_user_override_reports_what_it_overrode() -> None:
    r = resolve_kv_dtype(user_k="f16", user_v="f16", publisher=pub({"kv_cache_dtype": "q8_0"}))
    assert r.rule == RULE_USER
    assert "overridden by the user" in r.skipped[RULE_DECLARATION]
    assert "Q8_0" in r.skipped[RULE_DECLARATION]


def test_partial_override_keeps_the_other_side_provenance() -> None:
    r = resolve_kv_dtype(user_k="q8_0", user_v=None, publisher=pub({"torch_dtype": "float32"}))
    assert (r.rule_k, r.rule_v) == (RULE_USER, RULE_COMPUTE)
    assert RULE_COMPUTE not in r.skipped
    assert "V=F32 from publisher_compute_dtype" in r.detail


def test_unavailable_publisher_reason_is_shown() -> None:
    why = "publisher metadata not used: geometry mismatch, layers: ..."
    r = resolve_kv_dtype(user_k=None, user_v=None, publisher=None, publisher_unavailable=why)
    assert r.rule == RULE_DEFAULT
    assert r.skipped[RULE_DECLARATION] == why
    assert r.skipped[RULE_COMPUTE] == why


@pytest.mark.parametrize("bad", ["q3_k", "fp8", "", "int8", -1, 5, 99, True])
def test_bad_user_types_are_config_errors(bad: Any) -> None:
    with pytest.raises(ConfigError, match="type_v"):
        resolve_kv_dtype(user_k=None, user_v=bad, publisher=None)


@pytest.mark.parametrize(
    ("given", "name"),
    [
        ("f16", "F16"),
        ("FP16", "F16"),
        ("float32", "F32"),
        ("q8_0", "Q8_0"),
        ("Q4_0", "Q4_0"),
        ("bfloat16", "BF16"),
        ("iq4_nl", "IQ4_NL"),
        (0, "F32"),
        (1, "F16"),
        (2, "Q4_0"),
        (8, "Q8_0"),
    ],
)
def test_user_type_normalization(given: Any, name: str) -> None:
    assert normalize_user_type(given) == name


def test_type_ids_match_ggml() -> None:
    """The ids handed to llama-cpp-python are ggml's, as the gguf package defines them."""
    for name, tid in GGML_TYPE_IDS.items():
        assert gguf.GGMLQuantizationType[name].value == tid


def test_resolution_is_json_ready_and_describable() -> None:
    r = resolve_kv_dtype(user_k=None, user_v=None, publisher=pub({"torch_dtype": "float16"}))
    d = r.to_dict()
    assert d["type_k"] == "F16" and d["rule"] == RULE_COMPUTE and isinstance(d["skipped"], dict)
    assert r.describe().startswith("K=F16 V=F16 by publisher_compute_dtype")


_VALUES = st.one_of(
    st.sampled_from(
        ["float16", "bfloat16", "float32", "float8_e4m3fn", "int8", "int4", "q8_0", "auto", "fp8"]
    ),
    st.integers(min_value=0, max_value=1 << 20),
    st.booleans(),
    st.none(),
)
_KEYS = st.sampled_from(
    ["torch_dtype", "dtype", "num_hidden_layers", "hidden_size", "bits", "quant_method", "x"]
)
_CONFIGS = st.recursive(
    st.dictionaries(_KEYS, _VALUES, max_size=6),
    lambda inner: st.dictionaries(
        st.sampled_from(["quantization_config", "text_config", "rope_parameters"]), inner
    ),
    max_leaves=12,
)


@settings(max_examples=100, deadline=None)
@given(config=_CONFIGS, gen=st.one_of(st.none(), st.dictionaries(_KEYS, _VALUES, max_size=4)))
def test_no_declaration_means_no_quantized_cache(config: Cfg, gen: Cfg | None) -> None:
    """Whatever else a config says, without kv_cache_dtype/kv_cache_scheme K/V stay float."""
    r = resolve_kv_dtype(user_k=None, user_v=None, publisher=pub(config, gen))
    assert r.rule != RULE_DECLARATION
    assert r.type_k == r.type_v and r.type_k in ("F16", "F32")


def test_packages_do_not_import_llama_cpp() -> None:
    """The packages layer sits below the runtime (DESIGN §2)."""
    code = (
        "import sys, skippy_llama.packages.loader, skippy_llama.packages.create\n"
        "assert 'llama_cpp' not in sys.modules, 'llama_cpp imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
