"""Live K/V cache dtype resolution: a pure function over user input and publisher metadata.

The order is DESIGN §6:

1. ``user_override`` — an explicit K and/or V type from the user;
2. ``publisher_kv_declaration`` — ``kv_cache_dtype`` in ``config.json`` or
   ``generation_config.json``, or ``quantization_config.kv_cache_scheme``;
3. ``publisher_compute_dtype`` — ``dtype`` / ``torch_dtype`` mapped to a live KV type;
4. ``default`` — F16/F16.

Publisher rules only see metadata that the package loader validated against the GGUF (it passes
``publisher=None`` otherwise). Quantized K/V (Q8_0, Q4_0) come only from a declaration or the user:
nothing here looks at model size or weight quantization, so they can never be inferred.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ..errors import ConfigError
from .publisher import PublisherMetadata

RULE_USER: Final = "user_override"
RULE_DECLARATION: Final = "publisher_kv_declaration"
RULE_COMPUTE: Final = "publisher_compute_dtype"
RULE_DEFAULT: Final = "default"
#: Every rule, highest priority first.
RULES: Final = (RULE_USER, RULE_DECLARATION, RULE_COMPUTE, RULE_DEFAULT)

#: ggml type ids (``enum ggml_type``) of the K/V cache types llama.cpp accepts, as passed to
#: llama-cpp-python's ``type_k`` / ``type_v``. Publisher rules only ever produce the first four.
GGML_TYPE_IDS: Final[Mapping[str, int]] = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q8_0": 8,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "IQ4_NL": 20,
    "BF16": 30,
}
_NAME_BY_ID: Final = {v: k for k, v in GGML_TYPE_IDS.items()}

_FP8_NAMES: Final = frozenset(
    {
        "fp8",
        "float8",
        "fp8_e4m3",
        "fp8_e5m2",
        "fp8_e4m3fn",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "e4m3",
        "e5m2",
    }
)
# bfloat16 and FP8 map to F16 because llama.cpp has no FP8 cache and F16 is the portable
# choice that every backend supports with and without flash attention (DESIGN §6 "for now").
_FLOAT_NAMES: Final[Mapping[str, str]] = {
    "float16": "F16",
    "fp16": "F16",
    "f16": "F16",
    "half": "F16",
    "float32": "F32",
    "fp32": "F32",
    "f32": "F32",
    "float": "F32",
    "bfloat16": "F16",
    "bf16": "F16",
    **dict.fromkeys(_FP8_NAMES, "F16"),
}
# Integer KV declarations name a quantized cache, the only way Q8_0/Q4_0 come from a publisher.
_QUANT_NAMES: Final[Mapping[str, str]] = {
    "int8": "Q8_0",
    "i8": "Q8_0",
    "q8": "Q8_0",
    "q8_0": "Q8_0",
    "int4": "Q4_0",
    "i4": "Q4_0",
    "q4": "Q4_0",
    "q4_0": "Q4_0",
}
_USER_ALIASES: Final[Mapping[str, str]] = {
    "float16": "F16",
    "fp16": "F16",
    "half": "F16",
    "float32": "F32",
    "fp32": "F32",
    "bfloat16": "BF16",
    "bf16": "BF16",
}


@dataclass(frozen=True)
class KVDtypeResolution:
    """The live K and V cache types, the rule that chose them, and why every other rule did not.

    ``rule`` is the highest-priority rule that decided at least one side; ``rule_k``/``rule_v``
    say which rule decided each side (they differ only when the user overrode one side).
    ``skipped`` maps every rule that decided neither side to the reason.
    """

    type_k: str
    type_v: str
    rule: str
    detail: str
    skipped: Mapping[str, str] = field(default_factory=dict)
    rule_k: str = ""
    rule_v: str = ""

    def __post_init__(self) -> None:
        if not self.rule_k:
            object.__setattr__(self, "rule_k", self.rule)
        if not self.rule_v:
            object.__setattr__(self, "rule_v", self.rule)

    @property
    def ggml_type_k(self) -> int:
        """ggml type id for llama-cpp-python's ``type_k``."""
        return GGML_TYPE_IDS[self.type_k]

    @property
    def ggml_type_v(self) -> int:
        """ggml type id for llama-cpp-python's ``type_v``."""
        return GGML_TYPE_IDS[self.type_v]

    @property
    def needs_flash_attn(self) -> bool:
        """A quantized V cache: llama.cpp builds one only with flash attention on."""
        return self.type_v not in ("F16", "F32", "BF16")

    def llama_kwargs(self) -> dict[str, int]:
        """``{"type_k": id, "type_v": id}``, ready for ``llama_cpp.Llama(**kwargs)``."""
        return {"type_k": self.ggml_type_k, "type_v": self.ggml_type_v}

    def describe(self) -> str:
        """One line for status output, e.g. ``K=F16 V=F16 by publisher_compute_dtype (...)``."""
        return f"K={self.type_k} V={self.type_v} by {self.rule} ({self.detail})"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view, for ``--json`` status output."""
        return {
            "type_k": self.type_k,
            "type_v": self.type_v,
            "rule": self.rule,
            "rule_k": self.rule_k,
            "rule_v": self.rule_v,
            "detail": self.detail,
            "skipped": dict(self.skipped),
        }


def normalize_user_type(value: str | int, *, name: str = "type_k") -> str:
    """Turn a user-given K/V type (``"q8_0"``, ``"F16"``, ``"float16"`` or a ggml id) into its name.

    Raises :class:`ConfigError` naming the setting and the accepted values for anything else.
    """
    accepted = ", ".join(GGML_TYPE_IDS)
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a KV cache type; use one of {accepted}")
    if isinstance(value, int):
        if value in _NAME_BY_ID:
            return _NAME_BY_ID[value]
        raise ConfigError(
            f"{name}={value} is not a ggml type id llama.cpp accepts for the KV cache; "
            f"use one of {accepted} (ids {sorted(_NAME_BY_ID)})"
        )
    text = str(value).strip()
    upper = text.upper()
    if upper in GGML_TYPE_IDS:
        return upper
    if text.lower() in _USER_ALIASES:
        return _USER_ALIASES[text.lower()]
    raise ConfigError(f"{name}={value!r} is not a supported KV cache type; use one of {accepted}")


def _dtype_key(raw: str) -> str:
    key = raw.strip().lower()
    return key.removeprefix("torch.")


@dataclass(frozen=True)
class _Declaration:
    source: str
    raw: object
    types: tuple[str, str] | None  # None: present but not usable (reason in note)
    note: str


def _parse_kv_dtype_value(source: str, raw: object) -> _Declaration:
    if isinstance(raw, str):
        key = _dtype_key(raw)
        if key == "auto":
            return _Declaration(source, raw, None, f"{source}={raw!r} defers to the compute dtype")
        if key in _QUANT_NAMES:
            t = _QUANT_NAMES[key]
            return _Declaration(source, raw, (t, t), f"{source}={raw!r} → {t}")
        if key in _FLOAT_NAMES:
            t = _FLOAT_NAMES[key]
            why = " (no FP8 cache in llama.cpp)" if key in _FP8_NAMES else ""
            return _Declaration(source, raw, (t, t), f"{source}={raw!r} → {t}{why}")
        return _Declaration(source, raw, None, f"{source}={raw!r} is not a recognised KV dtype")
    if isinstance(raw, Mapping):
        # A per-side form {"k": ..., "v": ...} (or key/value): both sides must be recognised.
        k_raw = raw.get("k", raw.get("key"))
        v_raw = raw.get("v", raw.get("value"))
        if k_raw is None or v_raw is None:
            return _Declaration(source, raw, None, f"{source}={raw!r} does not name both K and V")
        k = _parse_kv_dtype_value(f"{source}.k", k_raw)
        v = _parse_kv_dtype_value(f"{source}.v", v_raw)
        if k.types is None or v.types is None:
            return _Declaration(source, raw, None, (k if k.types is None else v).note)
        return _Declaration(
            source, raw, (k.types[0], v.types[1]), f"{source}: K {k.note}, V {v.note}"
        )
    return _Declaration(source, raw, None, f"{source}={raw!r} is not a recognised KV dtype")


def _parse_kv_cache_scheme(source: str, raw: object) -> _Declaration:
    # compressed-tensors form: {"num_bits": 8, "type": "float"|"int", "strategy": ..., ...}
    if not isinstance(raw, Mapping):
        return _Declaration(source, raw, None, f"{source}={raw!r} is not a scheme object")
    bits = raw.get("num_bits")
    kind = str(raw.get("type", "")).lower()
    mapped: str | None = None
    if kind == "float" and bits == 8:
        mapped = "F16"
        note = f"{source} is FP8 (float, 8 bits) → F16 (no FP8 cache in llama.cpp)"
    elif kind == "float" and bits in (16, 32):
        mapped = "F16" if bits == 16 else "F32"
        note = f"{source} is float{bits} → {mapped}"
    elif kind == "int" and bits == 8:
        mapped = "Q8_0"
        note = f"{source} is int8 → Q8_0"
    elif kind == "int" and bits == 4:
        mapped = "Q4_0"
        note = f"{source} is int4 → Q4_0"
    else:
        note = f"{source} (type={kind or None!r}, num_bits={bits!r}) has no llama.cpp KV type"
    return _Declaration(source, raw, (mapped, mapped) if mapped else None, note)


def _sections(config: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    # Multimodal configs keep the language model's settings under text_config.
    out: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    text = config.get("text_config")
    if isinstance(text, Mapping):
        out.append(("text_config.", text))
    return out


def _publisher_declarations(pub: PublisherMetadata) -> list[_Declaration]:
    found: list[_Declaration] = []
    docs: list[tuple[str, Mapping[str, Any]]] = [("config.json", pub.config)]
    if pub.generation_config is not None:
        docs.append(("generation_config.json", pub.generation_config))
    for fname, doc in docs:
        for prefix, section in _sections(doc):
            if section.get("kv_cache_dtype") is not None:
                src = f"{fname} {prefix}kv_cache_dtype"
                found.append(_parse_kv_dtype_value(src, section["kv_cache_dtype"]))
    for prefix, section in _sections(pub.config):
        for qkey in ("quantization_config", "compression_config"):
            q = section.get(qkey)
            if isinstance(q, Mapping) and q.get("kv_cache_scheme") is not None:
                src = f"config.json {prefix}{qkey}.kv_cache_scheme"
                found.append(_parse_kv_cache_scheme(src, q["kv_cache_scheme"]))
    return found


def _declaration_rule(pub: PublisherMetadata) -> tuple[tuple[str, str] | None, str]:
    decls = _publisher_declarations(pub)
    if not decls:
        return None, (
            "no kv_cache_dtype in config.json or generation_config.json and no "
            "quantization_config.kv_cache_scheme"
        )
    usable = [d for d in decls if d.types is not None]
    if not usable:
        return None, "; ".join(d.note for d in decls)
    distinct = {d.types for d in usable}
    if len(distinct) > 1:
        # Disagreeing declarations are a publisher error; trusting either one would be a guess.
        return None, "conflicting KV declarations: " + "; ".join(d.note for d in usable)
    return usable[0].types, "; ".join(d.note for d in usable)


def _compute_rule(pub: PublisherMetadata) -> tuple[str | None, str]:
    notes: list[str] = []
    for prefix, section in _sections(pub.config):
        # transformers >= 4.56 writes "dtype"; older releases wrote "torch_dtype".
        for key in ("dtype", "torch_dtype"):
            raw = section.get(key)
            if raw is None:
                continue
            src = f"config.json {prefix}{key}={raw!r}"
            if not isinstance(raw, str):
                notes.append(f"{src} is not a dtype name")
                continue
            name = _dtype_key(raw)
            if name in _FLOAT_NAMES:
                t = _FLOAT_NAMES[name]
                why = " (no FP8 cache in llama.cpp)" if name in _FP8_NAMES else ""
                return t, f"{src} → {t}{why}"
            notes.append(f"{src} has no live KV mapping")
    if not notes:
        return None, "config.json states no dtype or torch_dtype"
    return None, "; ".join(notes)


def resolve_kv_dtype(
    *,
    user_k: str | int | None,
    user_v: str | int | None,
    publisher: PublisherMetadata | None,
    publisher_unavailable: str | None = None,
) -> KVDtypeResolution:
    """Resolve the live K/V cache types (DESIGN §6). Pure: no I/O, no globals.

    ``user_k``/``user_v`` are explicit user choices (names like ``"q8_0"`` or ggml ids), each
    optional; a side the user leaves open falls through to the publisher rules. ``publisher`` must
    be metadata the package loader already validated against the GGUF, or ``None``;
    ``publisher_unavailable`` is the reason it is ``None`` (shown for the skipped publisher rules).

    Raises :class:`ConfigError` for a user type llama.cpp does not accept.
    """
    uk = normalize_user_type(user_k, name="type_k") if user_k is not None else None
    uv = normalize_user_type(user_v, name="type_v") if user_v is not None else None

    # Evaluate the rules below the user override once, in order; the first that yields wins.
    reasons: dict[str, str] = {}
    fallback: tuple[str, str, str, str] | None = None  # (k, v, rule, detail)
    no_pub = publisher_unavailable or "the package has no publisher metadata"
    if publisher is None:
        reasons[RULE_DECLARATION] = no_pub
        reasons[RULE_COMPUTE] = no_pub
    else:
        decl, decl_note = _declaration_rule(publisher)
        if decl is not None:
            fallback = (decl[0], decl[1], RULE_DECLARATION, decl_note)
        else:
            reasons[RULE_DECLARATION] = decl_note
            comp, comp_note = _compute_rule(publisher)
            if comp is not None:
                fallback = (comp, comp, RULE_COMPUTE, comp_note)
            else:
                reasons[RULE_COMPUTE] = comp_note
    if fallback is None:
        fallback = ("F16", "F16", RULE_DEFAULT, "no higher rule applied: F16/F16")

    fk, fv, frule, fdetail = fallback
    type_k, rule_k = (uk, RULE_USER) if uk is not None else (fk, frule)
    type_v, rule_v = (uv, RULE_USER) if uv is not None else (fv, frule)
    used = {rule_k, rule_v}
    rule = next(r for r in RULES if r in used)

    if rule == RULE_USER:
        if uk is not None and uv is not None:
            detail = f"user asked for K={uk} V={uv}"
        elif uk is not None:
            detail = f"user asked for K={uk}; V={type_v} from {frule}: {fdetail}"
        else:
            detail = f"user asked for V={uv}; K={type_k} from {frule}: {fdetail}"
    else:
        detail = fdetail

    skipped: dict[str, str] = {}
    for r in RULES:
        if r in used:
            continue
        if r == RULE_USER:
            skipped[r] = "no user K/V type given"
        elif r in reasons:
            skipped[r] = reasons[r]
        elif r == frule:
            skipped[r] = f"overridden by the user (would give K={fk} V={fv}: {fdetail})"
        else:
            skipped[r] = f"not consulted: {frule} applies first"
    return KVDtypeResolution(
        type_k=type_k,
        type_v=type_v,
        rule=rule,
        detail=detail,
        skipped=skipped,
        rule_k=rule_k,
        rule_v=rule_v,
    )


def resolve_user_kv_types(kwargs: dict[str, Any]) -> KVDtypeResolution:
    """The K/V types a plain load chose (``type_k``/``type_v`` in the ``Llama`` keyword
    arguments, no model package); names such as ``"q8_0"`` in ``kwargs`` are replaced by the
    ggml ids llama.cpp wants."""
    resolution = resolve_kv_dtype(
        user_k=kwargs.get("type_k"),
        user_v=kwargs.get("type_v"),
        publisher=None,
        publisher_unavailable="the model was not loaded from a model package",
    )
    for side, ggml_id in (("type_k", resolution.ggml_type_k), ("type_v", resolution.ggml_type_v)):
        if isinstance(kwargs.get(side), str):
            kwargs[side] = ggml_id
    return resolution
