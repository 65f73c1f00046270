"""Settings: pydantic-settings over CLI flags > ``SKIPPY_*`` env > TOML file > defaults.

Precedence is resolved per field, and :func:`load_settings` keeps the winning source of every field
so that ``skippy-llama kv-cache status`` can say where each value came from. Configuration is
fail-closed: any invalid value raises :class:`~skippy_llama.errors.ConfigError` naming the field,
the value and an example of a valid one.
"""

from __future__ import annotations

import contextvars
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from .errors import ConfigError
from .sizes import format_size, parse_size

CONFIG_ENV = "SKIPPY_CONFIG"
GiB = 1 << 30
MiB = 1 << 20
#: The smallest useful L3 store: below it a few long prompts' pages do not fit at once, so every
#: record evicts the last one (the store's ``ENTRY_FLOOR``; a fixed budget under it is an error).
L3_BUDGET_FLOOR = 64 * MiB
#: L3 admission/eviction policies a store can run (``skippy_llama.tiers.l3.policies``).
L3Policy = Literal["reuse", "lru", "shipped"]

Size = Annotated[int, BeforeValidator(parse_size), PlainSerializer(format_size, return_type=str)]


def _repair_mode(value: Any) -> Any:
    # true/false (the setting's earlier form, and what env files often hold) mean always/never
    if isinstance(value, bool):
        return "always" if value else "never"
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return "always" if value.strip().lower() in ("true", "1") else "never"
    return value


#: When generated tokens are re-decoded as a batch (``l1.repair_generated``).
Repair = Annotated[Literal["auto", "always", "never"], BeforeValidator(_repair_mode)]
#: How L3 stores page bytes (see ``skippy_llama.codecs``).
Compression = Literal["auto", "zstd", "none"]
#: Which page codec a tier stores with: ``native`` (exact pages, compressed per ``compression``)
#: or ``cachegen`` (lossy, experimental, only where the roster qualifies it). A remote tier takes
#: the same setting; the codec is part of the cache identity either way.
PageCodec = Literal["native", "cachegen"]

_EXAMPLES = {
    "page_tokens": "128",
    "namespace": "'my-app'",
    "l1.max_prefixes": "8",
    "l1.budget_tokens": "2048",
    "l2.budget": "'2GiB'",
    "l3.mode": "'fixed' (with l3.budget) or 'auto' or 'off'",
    "l3.budget": "'32GiB'",
    "l3.directory": "'/var/cache/skippy-llama'",
    "l3.minimum_free": "'16GiB'",
    "l3.writer_queue": "64",
    "l3.writer_nice": "10 (0 to 19)",
    "l3.policy": "'reuse' (default), 'lru' or 'shipped'",
    "l3.codec": "'native' (default) or 'cachegen'",
    "l3.trace_file": "'/tmp/skippy-trace.jsonl'",
    "l3.secret_file": "'/etc/skippy-llama/l3.key' (created with `head -c 32 /dev/urandom`)",
    "remote.url": "'redis://cache-host:6379/0' or 'unix:///run/redis/redis.sock'",
    "remote.secret_file": "'/etc/skippy-llama/remote.key' (created with `head -c 32 /dev/urandom`)",
    "remote.timeout_ms": "250",
    "remote.namespace": "'skippy' (letters, digits, '.', '_', '-')",
    "remote.ttl": "604800 (seconds; none: keys never expire)",
    "remote.breaker_failures": "3",
    "remote.breaker_backoff_s": "10",
    "remote.codec": "'native' (default) or 'cachegen'",
}

_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "skippy_config_file", default=None
)


def _absolute(value: object) -> Path:
    path = Path(str(value)).expanduser()
    if not path.is_absolute():
        raise ValueError(f"directory {str(value)!r} must be an absolute path")
    return path


def _absolute_file(value: object) -> Path:
    path = Path(str(value)).expanduser()
    if not path.is_absolute():
        raise ValueError(f"file {str(value)!r} must be an absolute path")
    return path


def _default_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "skippy-llama" / "kv"


class L1Settings(BaseModel):
    """L1: resident prefixes kept in spare sequence ids of the live context."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(True, description="resident prefixes in the live context")
    max_prefixes: int = Field(
        4,
        ge=1,
        le=64,
        description="resident prefixes (device checkpoints, each sized to its prefix)",
    )
    budget_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens all resident prefixes may hold; default n_ctx (KV memory ≤ 2× plain Llama)",
    )
    repair_generated: Repair = Field(
        "auto",
        description=(
            "re-decode a reply as one batch right after it, so the next turn reuses it exactly: "
            "auto (chat completions, whose replies the next turn extends), always, or never "
            "(a next turn then decodes the reply within its own prefill)"
        ),
    )


class L2Settings(BaseModel):
    """L2: a bounded host-RAM mirror of L3 (off unless a budget is given)."""

    model_config = ConfigDict(extra="forbid")
    budget: Size | None = Field(None, description="RAM mirror budget, e.g. 2GiB; unset: L2 is off")


class L3Settings(BaseModel):
    """L3: the durable disk store on diskcache."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["off", "auto", "fixed"] = Field(
        "off",
        description=(
            "off, fixed (l3.budget), or auto: min(20 % of free + managed space, free − "
            "minimum_free, 64 GiB)"
        ),
    )
    budget: Size | None = Field(
        None, description="disk budget for mode fixed, e.g. 32GiB (floor 64MiB)"
    )
    directory: Annotated[Path, BeforeValidator(_absolute)] = Field(
        default_factory=_default_directory,
        description="the store directory, absolute ($XDG_CACHE_HOME/skippy-llama/kv by default)",
    )
    minimum_free: Size = Field(
        16 * GiB,
        description="free space kept on its filesystem; below it L3 turns read-only (floor 1GiB)",
    )
    writer_queue: int = Field(64, ge=1, le=4096, description="pending background writes")
    writer_nice: int = Field(
        10,
        ge=0,
        le=19,
        description=(
            "how far below the decode threads the writer thread runs (Linux thread nice; "
            "0: the same priority): compression and disk writes then take only CPU time the "
            "decode leaves idle"
        ),
    )
    shared_group: bool = Field(
        False,
        description="accept a store directory its group may write (everyone in it is trusted)",
    )
    secret_file: Annotated[Path, BeforeValidator(_absolute_file)] | None = Field(
        None,
        description=(
            "a file holding a secret (16-4096 bytes, not readable by others): every page, "
            "child-index entry and manifest is tagged with an HMAC under it, and one without a "
            "valid tag is a miss; processes sharing a store must share the secret"
        ),
    )
    compression: Compression = Field(
        "auto",
        description=(
            "how pages are stored: zstd (lossless, byte-shuffled: 0.86 of the bytes on F16 "
            "K/V), none, or auto (none: compressing took the CPU's decode threads a core's "
            "time and decompressing cost restores more than the disk it saved)"
        ),
    )
    codec: PageCodec = Field(
        "native",
        description=(
            "page codec: native (exact pages, the default) or cachegen (experimental, lossy: "
            "about a fifth of the bytes, but a restore is no longer bit-identical to a cold "
            "prefill). CacheGen is used only for a model, K/V layout and backend with a passing "
            "'cachegen' row in the roster (scripts/certify.py --cachegen); elsewhere pages stay "
            "native (logged once, counted). The codec and its parameters are part of the cache "
            "identity, so exact and lossy pages never mix"
        ),
    )
    policy: L3Policy = Field(
        "reuse",
        description=(
            "admission and eviction: reuse (frequency- and cost-aware, the default), lru, or "
            "shipped (the first release's probation policy); compare them on your own traffic "
            "with `skippy-llama kv-cache simulate`"
        ),
    )
    trace_file: Annotated[Path, BeforeValidator(_absolute_file)] | None = Field(
        None,
        description=(
            "append a JSON line per L3 lookup and record here (hashed page keys and sizes, no "
            "tokens or text) for `kv-cache simulate`; SKIPPY_TRACE=FILE does the same"
        ),
    )

    @field_validator("minimum_free")
    @classmethod
    def _reserve_floor(cls, value: int) -> int:
        # A field validator (not the model one) so the error is located at l3.minimum_free.
        if value < GiB:
            raise ValueError(f"{format_size(value)} is below the 1GiB floor")
        return value

    @field_validator("budget")
    @classmethod
    def _budget_floor(cls, value: int | None) -> int | None:
        if value is not None and value < L3_BUDGET_FLOOR:
            raise ValueError(
                f"{format_size(value)} is below the {format_size(L3_BUDGET_FLOOR)} floor, the "
                "smallest useful L3 store"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> L3Settings:
        if self.mode == "fixed" and self.budget is None:
            raise ValueError(
                "l3.mode 'fixed' needs l3.budget (none given), e.g. SKIPPY_L3__BUDGET=32GiB "
                "or --l3-budget 32GiB"
            )
        return self


#: Schemes ``remote.url`` may use: TCP (``rediss``: TLS), or a Unix socket.
REMOTE_SCHEMES = ("redis", "rediss", "unix")
_REMOTE_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _remote_url(value: object) -> str | None:
    """``remote.url`` checked for shape (the tier connects lazily; a server that is down at
    start is a miss, not an error): a scheme of :data:`REMOTE_SCHEMES`, a host (TCP) or an
    absolute socket path (unix), a database number, no unknown query parameters."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    text = str(value).strip()
    try:
        url = urlsplit(text)
        port = url.port
    except ValueError as exc:
        raise ValueError(f"does not parse as a URL: {exc}") from None
    if url.scheme not in REMOTE_SCHEMES:
        raise ValueError(f"scheme {url.scheme!r} is not one of {', '.join(REMOTE_SCHEMES)}")
    if url.scheme == "unix":
        if not url.path.startswith("/") or url.netloc:
            raise ValueError("a unix URL names an absolute socket path: unix:///path/to.sock")
        db = parse_qs(url.query).get("db", ["0"])[-1]
        extra = set(parse_qs(url.query)) - {"db"}
    else:
        if not url.hostname:
            raise ValueError("names no host")
        if port == 0:
            raise ValueError("port 0")
        db = url.path.lstrip("/") or "0"
        extra = set(parse_qs(url.query))
    if extra:
        raise ValueError(f"unknown query parameters {sorted(extra)}")
    if not db.isdigit():
        raise ValueError(f"database {db!r} is not a number")
    return text


def redact_url(url: str) -> str:
    """``url`` without its password (status output, logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


class RemoteSettings(BaseModel):
    """The shared remote tier on a Redis-protocol server (Redis, Valkey); off without a URL."""

    model_config = ConfigDict(extra="forbid")
    url: Annotated[str | None, BeforeValidator(_remote_url)] = Field(
        None,
        description=(
            "redis://host:port/db (rediss:// for TLS) or unix:///path/to.sock?db=N; "
            "unset: no remote tier"
        ),
    )
    secret_file: Annotated[Path, BeforeValidator(_absolute_file)] | None = Field(
        None,
        description=(
            "a file holding the secret every instance sharing the server holds (16-4096 bytes, "
            "not readable by others): every value is tagged with an HMAC under it, and one "
            "without a valid tag is a miss; required with remote.url"
        ),
    )
    timeout_ms: int = Field(
        250, ge=1, le=60_000, description="connect and per-command timeout (ms)"
    )
    namespace: str = Field(
        "skippy", description="key prefix on the server (several deployments can share one)"
    )
    ttl: int | None = Field(
        None,
        ge=1,
        description="seconds a pushed page or manifest lives unless pushed again (none: no expiry)",
    )
    breaker_failures: int = Field(
        3, ge=1, le=1000, description="consecutive failures that turn the tier off for a while"
    )
    breaker_backoff_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="how long the tier stays off after breaker_failures (doubles while it fails)",
    )
    codec: PageCodec = Field(
        "native",
        description=(
            "codec of the pages sent to and read from the server: native (exact pages, the "
            "default) or cachegen (experimental, lossy: about 0.2-0.5 of the bytes on the network, "
            "but a restore is no longer bit-identical to a cold prefill). Used only for a model, "
            "K/V layout and backend with a passing 'cachegen' row in the roster "
            "(scripts/certify.py --cachegen); elsewhere pages stay native (logged once). It makes "
            "the instance's cache identity a lossy one, which exact instances never read; L3 "
            "keeps storing pages with l3.codec"
        ),
    )

    @field_validator("namespace")
    @classmethod
    def _namespace_shape(cls, value: str) -> str:
        if not _REMOTE_NAMESPACE.fullmatch(value):
            raise ValueError("must be 1-64 letters, digits, '.', '_' or '-'")
        return value

    @model_validator(mode="after")
    def _check(self) -> RemoteSettings:
        if self.url is not None and self.secret_file is None:
            raise ValueError(
                "remote.url is set but remote.secret_file is not: the remote tier needs the "
                "shared secret every instance holds, e.g. SKIPPY_REMOTE__SECRET_FILE="
                "/etc/skippy-llama/remote.key (created with `head -c 32 /dev/urandom`)"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.url is not None


class NativeSettings(BaseModel):
    """Skippy's patched llama.cpp calls (range export, append import), see ``patches/``."""

    model_config = ConfigDict(extra="forbid")
    allow_uncertified: bool = Field(
        False,
        description=(
            "use the patched calls even where roster/split-certified.json does not certify the "
            "loaded library's recipe and the model's architecture/backend/KV layout"
        ),
    )


class Settings(BaseSettings):
    """All skippy-llama cache settings.

    ``Settings()`` reads ``SKIPPY_*`` environment variables (``__`` nests: ``SKIPPY_L3__MODE``) and
    the TOML file named by ``SKIPPY_CONFIG``; keyword arguments win over both. Use
    :func:`load_settings` to also learn which source set each field.
    """

    model_config = SettingsConfigDict(
        env_prefix="SKIPPY_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    page_tokens: int = Field(128, ge=16, le=8192, description="tokens per page")
    namespace: str = Field("", description="user namespace mixed into the cache identity")
    cross_backend: bool = Field(
        False,
        description=(
            "share pages across backends (CPU, CUDA, Metal, Vulkan) and offload settings; off by "
            "default because such pages are not bit-exact: measured agreement only"
        ),
    )
    pin_host_buffers: bool = Field(
        True,
        description=(
            "page-lock the reused host buffers of restores and captures on CUDA builds with K/V "
            "offloaded (cudaHostRegister: state copies run 4-5x faster); off to compare"
        ),
    )
    l1: L1Settings = Field(default_factory=lambda: L1Settings())
    l2: L2Settings = Field(default_factory=L2Settings)
    l3: L3Settings = Field(default_factory=lambda: L3Settings())
    remote: RemoteSettings = Field(default_factory=lambda: RemoteSettings())
    native: NativeSettings = Field(default_factory=NativeSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return tuple(source for _, source in _sources(settings_cls, init_settings))


def _config_path() -> Path | None:
    explicit = _config_file.get()
    if explicit is not None:
        return explicit
    from_env = os.environ.get(CONFIG_ENV)
    return Path(from_env) if from_env else None


def _sources(
    settings_cls: type[BaseSettings], init: PydanticBaseSettingsSource
) -> list[tuple[str, PydanticBaseSettingsSource]]:
    sources: list[tuple[str, PydanticBaseSettingsSource]] = [
        ("cli", init),
        ("env", EnvSettingsSource(settings_cls)),
    ]
    path = _config_path()
    if path is not None:
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} does not exist; pass an existing TOML file with "
                f"--config or {CONFIG_ENV}, e.g. /etc/skippy-llama.toml"
            )
        sources.append(("file", TomlConfigSettingsSource(settings_cls, toml_file=path)))
    return sources


def _leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path


def _all_fields(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _all_fields(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


@dataclass(frozen=True)
class LoadedSettings:
    """Validated settings plus the source (``cli``/``env``/``file``/``default``) of every field."""

    settings: Settings
    sources: dict[str, str] = field(default_factory=dict)
    config_file: Path | None = None


def config_error(exc: ValidationError) -> ConfigError:
    """Turn a pydantic ValidationError into a ConfigError that names field, value and example."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        loc = loc or "settings"
        value = err.get("input")
        message = err["msg"].removeprefix("Value error, ")
        example = _EXAMPLES.get(loc)
        hint = f" (example of a valid value: {example})" if example else ""
        if isinstance(value, dict):  # a model-level check: the message names the fields
            lines.append(f"invalid setting {loc}: {message}")
        else:
            lines.append(f"invalid setting {loc} = {value!r}: {message}{hint}")
    return ConfigError("; ".join(lines))


def load_settings(
    overrides: Mapping[str, Any] | None = None, config_file: Path | str | None = None
) -> LoadedSettings:
    """Load settings with per-field precedence CLI (``overrides``) > env > TOML file > default.

    Args:
        overrides: nested values from CLI flags or code, e.g. ``{"l3": {"mode": "auto"}}``.
        config_file: a TOML file; defaults to the ``SKIPPY_CONFIG`` environment variable.

    Raises:
        ConfigError: a value is invalid or the config file does not exist.
    """
    path = Path(config_file) if config_file is not None else None
    token = _config_file.set(path)
    try:
        init = InitSettingsSource(Settings, init_kwargs=dict(overrides or {}))
        sources = _sources(Settings, init)
        origin: dict[str, str] = dict.fromkeys(_all_fields(Settings), "default")
        for name, source in reversed(sources):
            for leaf in _leaves(source()):
                origin[leaf] = name
        try:
            settings = Settings(**dict(overrides or {}))
        except ValidationError as exc:
            raise config_error(exc) from None
        return LoadedSettings(settings=settings, sources=origin, config_file=_config_path())
    finally:
        _config_file.reset(token)
