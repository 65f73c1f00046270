"""The server's memory budget: how many conversations it keeps restorable (``--memory-budget``).

A server is the many-users case. The library's L1 keeps resident prefixes of at most ``n_ctx``
tokens in all (KV memory at most twice plain ``Llama``'s), which holds two or three of eight
600-token chats: the rest prefilled their whole prompt again (issue 34: TTFT p50 4.6x
``llama_cpp.server --cache``'s). ``skippy-llama serve`` instead sizes L1 from a host-memory
budget, like the peer's 2 GiB RAM cache: every resident prefix is a checkpoint holding its own
cells (``DESIGN.md`` section 11; in host RAM on the CPU build, in the cache's device memory where
K/V is offloaded), so ``budget / KV bytes per token`` tokens of them fit, in up to
:data:`SLOT_CAP` slots.

The KV bytes per token are read from the GGUF's metadata before the model loads (llama.cpp's own
reader, vocabulary only: about 0.1 s), since the L1 budget and the number of sequence ids are
fixed when the context is built.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..sizes import format_size, human_size

GiB = 1 << 30
#: ``--memory-budget`` unless given: the peer's default (``llama_cpp.server --cache true``
#: keeps a 2 GiB RAM cache).
DEFAULT_BUDGET = 2 * GiB
#: The budget never takes more than this share of the memory free at start-up (MemAvailable).
AVAILABLE_SHARE = 0.5
#: Resident prefixes at most: 63 spare sequence ids keep ``n_seq_max`` at 64 (the runtime rounds
#: 1 + slots up to a power of two; llama.cpp allows 256, ``LLAMA_MAX_SEQ``, and
#: ``l1.max_prefixes`` 64). An unused id costs a logits row in llama.cpp's output buffer
#: (n_vocab x 4 bytes: 12 MiB for SmolLM2's 64) and no K/V; whether 64 ids slow a prefill against
#: 16 is measured in ``benchmarks/README.md`` ("Serving defaults", ``probe_seq_max.py``).
SLOT_CAP = 63
#: At least as many slots as ``serve`` kept before it had a budget.
SLOT_FLOOR = 16
#: Conversations are sized at ``n_ctx`` tokens for the "about N conversations" line; slots are
#: sized for conversations this many times shorter, since most are.
SHORT_FACTOR = 4


@dataclass(frozen=True)
class MemoryPlan:
    """What ``--memory-budget`` resolved to, and the L1 settings it gives the server."""

    requested_bytes: int
    #: ``default`` or ``cli``
    source: str
    available_bytes: int | None
    budget_bytes: int
    kv_bytes_per_token: int
    n_ctx: int
    budget_tokens: int
    max_prefixes: int

    #: L1 settings given by a flag, variable or file instead of the budget
    overridden: tuple[str, ...] = ()

    def resolved(self, budget_tokens: int, max_prefixes: int) -> MemoryPlan:
        """This plan with the L1 settings the server actually got (a user's win over it)."""
        over = tuple(
            name
            for name, mine, got in (
                ("l1.budget_tokens", self.budget_tokens, budget_tokens),
                ("l1.max_prefixes", self.max_prefixes, max_prefixes),
            )
            if mine != got
        )
        if not over:
            return self
        return dataclasses.replace(
            self, budget_tokens=budget_tokens, max_prefixes=max_prefixes, overridden=over
        )

    @property
    def resident_bytes(self) -> int:
        """What the resident prefixes may take at most."""
        return self.budget_tokens * self.kv_bytes_per_token

    @property
    def capped(self) -> bool:
        return self.budget_bytes < self.requested_bytes

    @property
    def conversations(self) -> int:
        """Conversations of ``n_ctx`` tokens the budget keeps resident at once."""
        return min(self.budget_tokens // self.n_ctx, self.max_prefixes)

    def describe(self) -> str:
        """The start-up line."""
        cap = ""
        if self.capped and self.available_bytes is not None:
            cap = (
                f", capped at {AVAILABLE_SHARE:.0%} of the {human_size(self.available_bytes)} "
                f"available (asked {format_size(self.requested_bytes)})"
            )
        over = ""
        if self.overridden:
            over = f"; {' and '.join(self.overridden)} set, so they hold {human_size(self.resident_bytes)}"
        return (
            f"memory budget {human_size(self.budget_bytes)} ({self.source}{cap}) for resident "
            f"prefixes{over}: {self.budget_tokens:,} tokens at "
            f"{human_size(self.kv_bytes_per_token)} of K/V each, about {self.conversations} "
            f"conversations of this length ({self.n_ctx:,} tokens, n_ctx), up to "
            f"{self.max_prefixes} resident at once"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "requested_bytes": self.requested_bytes,
            "source": self.source,
            "available_bytes": self.available_bytes,
            "available_share": AVAILABLE_SHARE,
            "budget_bytes": self.budget_bytes,
            "capped": self.capped,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "budget_tokens": self.budget_tokens,
            "max_prefixes": self.max_prefixes,
            "n_ctx": self.n_ctx,
            "conversations": self.conversations,
            "resident_bytes_max": self.resident_bytes,
            "overridden": list(self.overridden),
        }


def available_memory() -> int | None:
    """MemAvailable of ``/proc/meminfo`` (free memory the kernel can hand out without swapping),
    else free physical pages; None where neither is known."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(AttributeError, OSError, ValueError):
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    return None


def plan_memory(
    requested: int | None,
    *,
    kv_bytes_per_token: int,
    n_ctx: int,
    page_tokens: int,
    available: int | None,
) -> MemoryPlan:
    """Size L1 for a server from a host-memory budget (``None``: :data:`DEFAULT_BUDGET`).

    Raises:
        ConfigError: the budget holds less than one page of tokens.
    """
    source = "default" if requested is None else "cli"
    asked = DEFAULT_BUDGET if requested is None else requested
    budget = asked
    if available is not None:
        budget = min(budget, int(available * AVAILABLE_SHARE))
    tokens = budget // max(kv_bytes_per_token, 1)
    if tokens < page_tokens:
        need = format_size(-(-page_tokens * kv_bytes_per_token // (1 << 20)) << 20)
        where = (
            f" ({AVAILABLE_SHARE:.0%} of the {human_size(available)} available)"
            if budget < asked and available is not None
            else ""
        )
        raise ConfigError(
            f"--memory-budget {format_size(asked)} holds {tokens} tokens of resident prefixes"
            f"{where} at {kv_bytes_per_token} bytes of K/V per token, less than one page "
            f"({page_tokens} tokens); give at least {need}, e.g. --memory-budget 2GiB"
        )
    slots = min(SLOT_CAP, max(SLOT_FLOOR, SHORT_FACTOR * tokens // n_ctx))
    return MemoryPlan(
        requested_bytes=asked,
        source=source,
        available_bytes=available,
        budget_bytes=budget,
        kv_bytes_per_token=kv_bytes_per_token,
        n_ctx=n_ctx,
        budget_tokens=tokens,
        max_prefixes=slots,
    )


# ---------------------------------------------------------------------- K/V bytes from the GGUF


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """llama.cpp logs the whole vocabulary load to fd 2; keep the start-up output readable."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _type_bytes(ggml_type: int) -> float:
    """Bytes per element of a ggml type (a block's bytes over its elements for quantized ones)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return size / block


def kv_bytes_per_token(model_path: str, type_k: int, type_v: int) -> int | None:
    """K and V bytes one token takes in every layer's cache, from the GGUF's metadata.

    ``n_layer x n_head_kv x (head_k x size(type_k) + head_v x size(type_v))``, as llama.cpp
    sizes its cache. Sliding-window layers are counted whole (a checkpoint of such a model
    holds only their window: the estimate errs towards fewer conversations). None where the
    metadata does not say (per-layer head counts, other attention layouts).

    Raises:
        ConfigError: the file is not a GGUF llama.cpp reads.
    """
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with _quiet_stderr():
        model = llama_cpp.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        raise ConfigError(f"--model {model_path!r}: llama.cpp cannot read this GGUF")
    try:

        def meta(key: str) -> str | None:
            buf = ctypes.create_string_buffer(256)
            n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
            return buf.value.decode("utf-8", "replace") if n >= 0 else None

        def number(key: str) -> int | None:
            text = meta(key)
            return int(text) if text is not None and text.strip().isdigit() else None

        arch = meta("general.architecture") or ""
        layers = number(f"{arch}.block_count")
        heads = number(f"{arch}.attention.head_count")
        kv_heads = number(f"{arch}.attention.head_count_kv") or heads
        embd = number(f"{arch}.embedding_length")
        head = embd // heads if embd and heads else None
        head_k = number(f"{arch}.attention.key_length") or head
        head_v = number(f"{arch}.attention.value_length") or head
    finally:
        llama_cpp.llama_model_free(model)
    if not (layers and kv_heads and head_k and head_v):
        return None
    per_head = head_k * _type_bytes(type_k) + head_v * _type_bytes(type_v)
    return int(layers * kv_heads * per_head)
