"""Model geometry from GGUF metadata (via the ``gguf`` package) and from a Hugging Face config.

A package's publisher metadata is used only if every geometry field that *both* the GGUF and
``config.json`` state agrees: a config copied from the wrong repository or revision would
otherwise steer the live KV dtype of a model it does not describe.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict

from ..errors import PackageError

#: Geometry fields, in report order.
FIELDS: Final = (
    "layers",
    "hidden_size",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "context_length",
    "rope_base",
)

#: config.json keys stating each field, most common first (aliases cover older architectures).
HF_KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    "layers": ("num_hidden_layers", "n_layer", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head", "n_heads"),
    "kv_heads": ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num"),
    "head_dim": ("head_dim",),
    "vocab": ("vocab_size", "padded_vocab_size"),
    "context_length": ("max_position_embeddings", "n_positions", "seq_length"),
    "rope_base": ("rope_theta",),
}

# rope_theta is stored as float32 in GGUF; anything closer than this is the same value.
_ROPE_REL_TOL: Final = 1e-6


class Geometry(BaseModel):
    """What a GGUF states about its shape; ``None`` where the file does not say.

    ``sources`` maps each stated field to the GGUF key (or tensor) it came from.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: str
    layers: int | None = None
    hidden_size: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    vocab: int | None = None
    context_length: int | None = None
    rope_base: float | None = None
    split_count: int = 1
    sources: dict[str, str] = {}

    def value(self, name: str) -> int | float | None:
        """The value of one of :data:`FIELDS`."""
        v = getattr(self, name)
        return v if isinstance(v, (int, float)) else None


def _field_scalar(reader: Any, key: str) -> Any:
    """A scalar field's value; for arrays, the common value if every element agrees, else None.

    Uses ``parts``/``data`` rather than ``ReaderField.contents()`` so older gguf releases work.
    """
    from gguf import GGUFValueType

    field = reader.get_field(key)
    if field is None:
        return None
    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    if types[0] == GGUFValueType.ARRAY:
        # Per-layer arrays (e.g. head counts of OpenELM) only compare when uniform.
        if len(types) < 2 or types[1] == GGUFValueType.STRING or not field.data:
            return None
        values = {field.parts[i][0].item() for i in field.data}
        return values.pop() if len(values) == 1 else None
    return field.parts[field.data[0]][0].item()


def _field_len(reader: Any, key: str) -> int | None:
    field = reader.get_field(key)
    return None if field is None else len(field.data)


def read_gguf_geometry(path: str | os.PathLike[str]) -> Geometry:
    """Read the geometry a GGUF file states, with the ``gguf`` package's ``GGUFReader``.

    ``GGUFReader`` parses every metadata array, so a large vocabulary costs seconds; callers that
    read the same file twice should keep the result. Raises :class:`PackageError` if the file is
    not a readable GGUF.
    """
    from gguf import GGUFReader

    p = Path(path)
    try:
        reader = GGUFReader(p)
    except (OSError, ValueError) as exc:
        raise PackageError(f"{p} is not a readable GGUF file: {exc}") from exc
    arch = _field_scalar(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise PackageError(f"{p} has no general.architecture; it is not a model GGUF")

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def take(name: str, key: str, value: Any) -> None:
        if name not in values and isinstance(value, (int, float)) and not isinstance(value, bool):
            values[name] = value
            sources[name] = key

    for name, suffix in (
        ("layers", "block_count"),
        ("hidden_size", "embedding_length"),
        ("heads", "attention.head_count"),
        ("kv_heads", "attention.head_count_kv"),
        ("head_dim", "attention.key_length"),
        ("vocab", "vocab_size"),
        ("context_length", "context_length"),
        ("rope_base", "rope.freq_base"),
    ):
        key = f"{arch}.{suffix}"
        take(name, key, _field_scalar(reader, key))

    # llama.cpp derives the head size the same way when key_length is absent.
    hidden, heads = values.get("hidden_size"), values.get("heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        take("head_dim", "embedding_length / head_count", hidden // heads)
    # The embedding matrix has one row per vocabulary entry (ggml shape is [n_embd, n_vocab]).
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight" and len(tensor.shape) >= 2:
            take("vocab", "token_embd.weight rows", int(tensor.shape[1]))
            break
    take("vocab", "tokenizer.ggml.tokens length", _field_len(reader, "tokenizer.ggml.tokens"))

    ints = {k: int(v) for k, v in values.items() if k != "rope_base"}
    rope = values.get("rope_base")
    split = _field_scalar(reader, "split.count")
    return Geometry(
        architecture=arch,
        rope_base=float(rope) if rope is not None else None,
        split_count=int(split) if isinstance(split, int) and split > 0 else 1,
        sources=sources,
        **ints,
    )


def hf_geometry(config: Mapping[str, Any]) -> dict[str, tuple[str, int | float]]:
    """The geometry fields ``config.json`` states: ``{field: (key, value)}``.

    Top-level keys win; ``text_config`` (multimodal repositories) fills in the rest, because that
    is the part a text GGUF is converted from.
    """
    out: dict[str, tuple[str, int | float]] = {}
    sections: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    if isinstance(config.get("text_config"), Mapping):
        sections.append(("text_config.", config["text_config"]))
    for name, keys in HF_KEYS.items():
        for prefix, section in sections:
            hit = next(
                (
                    (prefix + k, section[k])
                    for k in keys
                    if isinstance(section.get(k), (int, float))
                    and not isinstance(section.get(k), bool)
                ),
                None,
            )
            if hit is None and name == "rope_base":
                # transformers v5 moved rope_theta into rope_parameters.
                rp = section.get("rope_parameters")
                if isinstance(rp, Mapping) and isinstance(rp.get("rope_theta"), (int, float)):
                    hit = (prefix + "rope_parameters.rope_theta", rp["rope_theta"])
            if hit is not None:
                out[name] = hit
                break
    return out


Status = Literal["match", "mismatch", "gguf_only", "config_only", "neither"]


@dataclass(frozen=True)
class FieldCheck:
    """One geometry field compared between the GGUF and ``config.json``."""

    field: str
    status: Status
    gguf_key: str | None = None
    gguf_value: int | float | None = None
    config_key: str | None = None
    config_value: int | float | None = None

    def describe(self) -> str:
        """Human-readable one-liner, used as a rejection reason for mismatches."""
        g = f"GGUF {self.gguf_key}={self.gguf_value}"
        c = f"config.json {self.config_key}={self.config_value}"
        if self.status == "mismatch":
            return f"{self.field}: {c} but {g}"
        if self.status == "match":
            return f"{self.field}: {self.gguf_value} on both sides"
        if self.status == "gguf_only":
            return f"{self.field}: only the GGUF states it ({g})"
        if self.status == "config_only":
            return f"{self.field}: only config.json states it ({c})"
        return f"{self.field}: stated by neither"


@dataclass(frozen=True)
class GeometryComparison:
    """Every field of :data:`FIELDS` compared; only fields both sides state can mismatch."""

    checks: tuple[FieldCheck, ...]

    @property
    def mismatches(self) -> tuple[FieldCheck, ...]:
        """Fields stated on both sides with different values."""
        return tuple(c for c in self.checks if c.status == "mismatch")

    @property
    def compared(self) -> tuple[str, ...]:
        """Names of the fields both sides state."""
        return tuple(c.field for c in self.checks if c.status in ("match", "mismatch"))


def _same(name: str, a: int | float, b: int | float) -> bool:
    if name == "rope_base":
        return math.isclose(float(a), float(b), rel_tol=_ROPE_REL_TOL)
    return int(a) == b


def compare_geometry(gguf: Geometry, config: Mapping[str, Any]) -> GeometryComparison:
    """Compare the GGUF's geometry with what ``config.json`` states, field by field."""
    stated = hf_geometry(config)
    checks: list[FieldCheck] = []
    for name in FIELDS:
        gv = gguf.value(name)
        gk = gguf.sources.get(name)
        ck, cv = stated.get(name, (None, None))
        if gv is not None and cv is not None:
            status: Status = "match" if _same(name, gv, cv) else "mismatch"
        elif gv is not None:
            status = "gguf_only"
        elif cv is not None:
            status = "config_only"
        else:
            status = "neither"
        checks.append(FieldCheck(name, status, gk, gv, ck, cv))
    return GeometryComparison(tuple(checks))


_GEOMETRY_CACHE: dict[tuple[str, int, int, int], Geometry] = {}


def cached_gguf_geometry(path: str | os.PathLike[str]) -> Geometry:
    """:func:`read_gguf_geometry`, remembered in-process by (path, inode, size, mtime).

    ``create``, ``verify`` and ``load`` often read the same file in one process; GGUFReader takes
    seconds on a large vocabulary, and the stamp changes whenever the file does.
    """
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as exc:
        raise PackageError(f"cannot read GGUF {p}: {exc.strerror or exc}") from exc
    key = (str(p), st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _GEOMETRY_CACHE.get(key)
    if hit is None:
        hit = read_gguf_geometry(p)
        if len(_GEOMETRY_CACHE) >= 16:
            _GEOMETRY_CACHE.clear()
        _GEOMETRY_CACHE[key] = hit
    return hit
