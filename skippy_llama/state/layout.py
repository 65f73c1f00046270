"""The KV layout of a llama.cpp sequence state: what must match for bytes to be interchangeable."""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

# ggml type ids of the row types we name in messages; others are carried as plain integers.
GGML_TYPE_NAMES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    30: "BF16",
}
FLOAT_TYPES = frozenset({0, 1, 30})


def type_name(ggml_type: int) -> str:
    """Name a ggml type id (``1 -> 'F16'``), falling back to ``type<N>``."""
    return GGML_TYPE_NAMES.get(ggml_type, f"type{ggml_type}")


@dataclass(frozen=True)
class LayerLayout:
    """One layer's K and V storage as llama.cpp serializes it.

    ``v_unit`` is the V row size in bytes when V is not transposed, or the element size when it
    is; ``v_embd`` is ``n_embd_v_gqa`` for transposed V and 0 otherwise.
    """

    k_type: int
    k_row: int
    v_type: int
    v_unit: int
    v_embd: int

    def v_bytes_per_cell(self) -> int:
        return self.v_unit * self.v_embd if self.v_embd else self.v_unit

    def digest_key(self) -> bytes:
        """This layer's part of :meth:`KVLayout.digest` (never change: stored pages match it)."""
        return f"|{self.k_type},{self.k_row},{self.v_type},{self.v_unit},{self.v_embd}".encode()


@dataclass(frozen=True)
class KVLayout:
    """Everything about a state blob's byte layout that is not per-token content.

    ``layers`` are the layers of the state's first (or only) memory section. A sliding-window
    model's state (llama.cpp's ``llama_kv_cache_iswa``) has a second section, the
    sliding-window layers' cache, written after the first with the same ``v_trans``, streams
    and cell ext; its layers are ``swa_layers`` (empty for a one-section state). Only
    one-section layouts can be paged (:attr:`pageable`): the second section holds only the
    window's cells, so a prefix of a capture is not the state of that prefix.
    """

    v_trans: bool
    layers: tuple[LayerLayout, ...]
    n_stream: int = 1
    stream: int = 0
    ext_bytes: int = 0
    swa_layers: tuple[LayerLayout, ...] = ()

    @property
    def n_layer(self) -> int:
        """Layers of the first section (the only one pages hold)."""
        return len(self.layers)

    @property
    def n_sections(self) -> int:
        """Memory sections of the state: 2 for a sliding-window (iSWA) model, else 1."""
        return 2 if self.swa_layers else 1

    @property
    def pageable(self) -> bool:
        """Whether states of this layout may be cut into pages (one section only)."""
        return not self.swa_layers

    @property
    def meta_bytes_per_cell(self) -> int:
        # pos (i32) + n_seq_id (u32 = 1) + optional cell ext + one seq id (i32)
        return 12 + self.ext_bytes

    @property
    def kv_bytes_per_cell(self) -> int:
        """K/V bytes of one token in every layer, both sections of an iSWA state included
        (a token inside the window has a cell in each section's cache)."""
        return sum(
            layer.k_row + layer.v_bytes_per_cell() for layer in (*self.layers, *self.swa_layers)
        )

    @property
    def bytes_per_token(self) -> int:
        """Serialized state bytes per token (cell metadata included; for an iSWA state, of a
        token inside the window, which has a cell in each section)."""
        return self.kv_bytes_per_cell + self.meta_bytes_per_cell * self.n_sections

    def describe(self) -> str:
        first = self.layers[0] if self.layers else None
        types = f"K {type_name(first.k_type)} V {type_name(first.v_type)}" if first else "no layers"
        swa = f" + {len(self.swa_layers)} sliding-window" if self.swa_layers else ""
        return f"{self.n_layer}{swa} layers, {types}, v_trans={int(self.v_trans)}"

    def digest(self) -> str:
        """A stable hex digest of the layout, used in the cache identity.

        Stream count and index are left out: they place cells, they do not change their bytes,
        and ``assemble`` writes the live context's own placement. A second (sliding-window)
        section adds its layers after a marker, so a one-section layout's digest is what it
        always was and no two-section layout shares it.
        """
        h = xxhash.xxh3_128()
        h.update(f"{int(self.v_trans)}|{self.ext_bytes}".encode())
        for layer in self.layers:
            h.update(layer.digest_key())
        if self.swa_layers:
            h.update(b"|swa")
            for layer in self.swa_layers:
                h.update(layer.digest_key())
        return h.hexdigest()
