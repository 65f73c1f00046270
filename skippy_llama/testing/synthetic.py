"""Tiny synthetic GGUFs of recurrent and hybrid model families (random weights, real layout).

The model registry carries only llama-architecture models, yet most new open models keep state
that is not per token (issue 46): Mamba2 (recurrent), Qwen3.5 (Gated DeltaNet layers beside
attention), Granite 4 hybrid (Mamba2 layers beside attention) and LFM2 (short-convolution layers
beside attention). These writers give each family the tensor names, shapes and hyperparameters
llama.cpp 0.3.36's loader wants (``src/models/<family>.cpp``, ``load_arch_tensors``) at a size
that loads in milliseconds, so tests can check exactness on every family without a download.
Outputs are noise (random weights); logits are still a deterministic function of the state,
which is all an exactness test needs.

The vocabulary is a small SentencePiece (``llama``) one built here: control tokens, the 256
byte-fallback tokens, printable ASCII and ``▁`` + letter pieces, so any text tokenizes.

Command line::

    python -m skippy_llama.testing.synthetic OUT.gguf FAMILY [--seed N]
"""

from __future__ import annotations

import argparse
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

#: The families this module writes: llama.cpp architecture name -> what its memory keeps.
FAMILIES: dict[str, str] = {
    "mamba2": "recurrent (Mamba2 SSM state + conv state per sequence)",
    "qwen35": "hybrid: Gated DeltaNet layers (recurrent) + full attention every 4th layer",
    "granitehybrid": "hybrid: Mamba2 layers (recurrent) + full attention layers",
    "lfm2": "hybrid: short-convolution layers (conv state) + full attention layers",
}

_SPACE = "\u2581"  # SentencePiece's word-boundary mark


@dataclass(frozen=True)
class Shape:
    """The sizes of a synthetic model (small by default: loads and decodes in milliseconds)."""

    n_layer: int = 4
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 2
    n_head_kv: int = 1
    n_ctx_train: int = 4096


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A tiny SentencePiece vocabulary: tokens, scores and token types (``gguf.TokenType``).

    Ids 0/1/2 are ``<unk>``/``<s>``/``</s>`` (llama.cpp's SPM defaults); every byte has a
    fallback token, so any UTF-8 text tokenizes.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces = [_SPACE, *(c for c in string.printable[:94])]
    pieces += [_SPACE + c for c in string.ascii_letters]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # SPM merges the best-scoring pair first: longer pieces score higher
    scores = [0.0] * (3 + 256) + [float(len(p)) for p in pieces]
    return tokens, scores, [int(t) for t in types]


class _Weights:
    """Deterministic random tensors: 2-D matrices in F16, everything else in F32 (as llama.cpp's
    converters store norms, biases, SSM parameters and convolution kernels)."""

    def __init__(self, writer: gguf.GGUFWriter, seed: int) -> None:
        self.writer = writer
        self.rng = np.random.default_rng(seed)

    def matrix(self, name: str, rows: int, cols: int, scale: float = 0.1) -> None:
        """A weight of ggml shape ``{cols, rows}`` (numpy ``(rows, cols)``), F16."""
        values = self.rng.standard_normal((rows, cols), dtype=np.float32) * scale
        self.writer.add_tensor(name, values.astype(np.float16))

    def f32(self, name: str, *shape: int, scale: float = 0.1, fill: float | None = None) -> None:
        """An F32 tensor of numpy shape ``shape`` (ggml's reversed): random, or ``fill``."""
        values: npt.NDArray[np.float32]
        if fill is not None:
            values = np.full(shape, fill, dtype=np.float32)
        else:
            values = self.rng.standard_normal(shape, dtype=np.float32) * scale
        self.writer.add_tensor(name, values)

    def negative(self, name: str, *shape: int) -> None:
        """SSM decay parameters (``ssm_a``) must be negative, or the state blows up."""
        values = -np.abs(self.rng.standard_normal(shape, dtype=np.float32)) - 0.1
        self.writer.add_tensor(name, values.astype(np.float32))


def _common(writer: gguf.GGUFWriter, arch: str, shape: Shape) -> None:
    writer.add_name(f"synthetic-{arch}")
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens, scores, types = vocabulary()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def _embeddings(w: _Weights, shape: Shape, output_norm: str = "output_norm.weight") -> None:
    n_vocab = len(vocabulary()[0])
    w.matrix("token_embd.weight", n_vocab, shape.n_embd, scale=1.0)
    w.f32(output_norm, shape.n_embd, fill=1.0)
    w.matrix("output.weight", n_vocab, shape.n_embd)


def _ffn(w: _Weights, i: int, shape: Shape, norm: str | None = "ffn_norm") -> None:
    p = f"blk.{i}."
    if norm is not None:
        w.f32(p + norm + ".weight", shape.n_embd, fill=1.0)
    w.matrix(p + "ffn_gate.weight", shape.n_ff, shape.n_embd)
    w.matrix(p + "ffn_up.weight", shape.n_ff, shape.n_embd)
    w.matrix(p + "ffn_down.weight", shape.n_embd, shape.n_ff)


# Mamba2's SSM sizes, shared by mamba2 and granitehybrid (granite asserts d_inner == 2 * n_embd)
_D_CONV, _D_STATE, _N_GROUP, _N_SSM_HEAD = 4, 16, 1, 4


def _ssm_hparams(writer: gguf.GGUFWriter, shape: Shape) -> None:
    writer.add_ssm_conv_kernel(_D_CONV)
    writer.add_ssm_inner_size(2 * shape.n_embd)
    writer.add_ssm_state_size(_D_STATE)
    writer.add_ssm_time_step_rank(_N_SSM_HEAD)
    writer.add_ssm_group_count(_N_GROUP)


def _mamba2_mixer(w: _Weights, i: int, shape: Shape) -> None:
    """``llama_model_mamba2::load_arch_tensors``' per-layer SSM tensors."""
    p = f"blk.{i}."
    d_inner = 2 * shape.n_embd
    conv_dim = d_inner + 2 * _N_GROUP * _D_STATE
    w.matrix(p + "ssm_in.weight", d_inner + conv_dim + _N_SSM_HEAD, shape.n_embd)
    w.f32(p + "ssm_conv1d.weight", conv_dim, _D_CONV)
    w.f32(p + "ssm_conv1d.bias", conv_dim)
    w.f32(p + "ssm_dt.bias", _N_SSM_HEAD)
    w.negative(p + "ssm_a", _N_SSM_HEAD, 1)
    w.f32(p + "ssm_d", _N_SSM_HEAD, 1, fill=1.0)
    w.f32(p + "ssm_norm.weight", _N_GROUP, d_inner // _N_GROUP, fill=1.0)
    w.matrix(p + "ssm_out.weight", shape.n_embd, d_inner)


def _attention(w: _Weights, i: int, shape: Shape, head_dim: int, *, q_gate: bool = False) -> None:
    p = f"blk.{i}."
    q_rows = head_dim * shape.n_head * (2 if q_gate else 1)
    w.matrix(p + "attn_q.weight", q_rows, shape.n_embd)
    w.matrix(p + "attn_k.weight", head_dim * shape.n_head_kv, shape.n_embd)
    w.matrix(p + "attn_v.weight", head_dim * shape.n_head_kv, shape.n_embd)
    w.matrix(p + "attn_output.weight", shape.n_embd, head_dim * shape.n_head)


def _write_mamba2(writer: gguf.GGUFWriter, w: _Weights, shape: Shape) -> None:
    _ssm_hparams(writer, shape)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    _embeddings(w, shape)
    for i in range(shape.n_layer):
        w.f32(f"blk.{i}.attn_norm.weight", shape.n_embd, fill=1.0)
        _mamba2_mixer(w, i, shape)


def _attention_layers(shape: Shape) -> list[bool]:
    """Which layers attend in the granite and LFM2 writers: every other one, the first
    recurrent (their real models are mostly recurrent layers)."""
    return [i % 2 == 1 for i in range(shape.n_layer)]


def _write_granitehybrid(writer: gguf.GGUFWriter, w: _Weights, shape: Shape) -> None:
    _ssm_hparams(writer, shape)
    attends = _attention_layers(shape)
    # a layer is recurrent iff its head_count_kv is 0; head_count stays one number, as in the
    # published GGUFs (the loader takes head sizes from layer 0's count)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv([shape.n_head_kv if a else 0 for a in attends])
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_rope_freq_base(10000.0)
    head_dim = shape.n_embd // shape.n_head
    _embeddings(w, shape)
    for i, attends_here in enumerate(attends):
        w.f32(f"blk.{i}.attn_norm.weight", shape.n_embd, fill=1.0)
        if attends_here:
            _attention(w, i, shape, head_dim)
        else:
            _mamba2_mixer(w, i, shape)
        _ffn(w, i, shape)


# Gated DeltaNet sizes (qwen35): key and value heads of one head size, 2 key heads, 4 value heads
_GDN_HEAD, _GDN_K_HEADS, _GDN_V_HEADS = 32, 2, 4
_QWEN35_HEAD, _QWEN35_ROT = 32, 16


def _write_qwen35(writer: gguf.GGUFWriter, w: _Weights, shape: Shape) -> None:
    value_dim = _GDN_HEAD * _GDN_V_HEADS
    key_dim = _GDN_HEAD * _GDN_K_HEADS
    conv_dim = 2 * key_dim + value_dim
    writer.add_ssm_conv_kernel(_D_CONV)
    writer.add_ssm_inner_size(value_dim)
    writer.add_ssm_state_size(_GDN_HEAD)
    writer.add_ssm_time_step_rank(_GDN_V_HEADS)
    writer.add_ssm_group_count(_GDN_K_HEADS)
    writer.add_full_attention_interval(4)  # layers 3, 7, ... attend (Qwen3.5's pattern)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(_QWEN35_HEAD)
    writer.add_value_length(_QWEN35_HEAD)
    writer.add_rope_dimension_count(_QWEN35_ROT)
    # M-RoPE sections in rotary pairs, summing to n_rot / 2 (text uses the first only)
    writer.add_rope_dimension_sections([4, 2, 2, 0])
    writer.add_rope_freq_base(10000.0)
    writer.add_feed_forward_length(shape.n_ff)
    _embeddings(w, shape)
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        w.f32(p + "attn_norm.weight", shape.n_embd, fill=1.0)
        w.f32(p + "post_attention_norm.weight", shape.n_embd, fill=1.0)
        if (i + 1) % 4 == 0:
            _attention(w, i, shape, _QWEN35_HEAD, q_gate=True)
            w.f32(p + "attn_q_norm.weight", _QWEN35_HEAD, fill=1.0)
            w.f32(p + "attn_k_norm.weight", _QWEN35_HEAD, fill=1.0)
        else:
            w.matrix(p + "attn_qkv.weight", conv_dim, shape.n_embd)
            w.matrix(p + "attn_gate.weight", value_dim, shape.n_embd)
            w.f32(p + "ssm_conv1d.weight", conv_dim, _D_CONV)
            w.f32(p + "ssm_dt.bias", _GDN_V_HEADS)
            w.negative(p + "ssm_a", _GDN_V_HEADS)
            w.matrix(p + "ssm_beta.weight", _GDN_V_HEADS, shape.n_embd)
            w.matrix(p + "ssm_alpha.weight", _GDN_V_HEADS, shape.n_embd)
            w.f32(p + "ssm_norm.weight", _GDN_HEAD, fill=1.0)
            w.matrix(p + "ssm_out.weight", shape.n_embd, value_dim)
        _ffn(w, i, shape, norm=None)


_SHORTCONV_L_CACHE = 3


def _write_lfm2(writer: gguf.GGUFWriter, w: _Weights, shape: Shape) -> None:
    attends = _attention_layers(shape)
    writer.add_shortconv_l_cache(_SHORTCONV_L_CACHE)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv([shape.n_head_kv if a else 0 for a in attends])
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_rope_freq_base(10000.0)
    head_dim = shape.n_embd // shape.n_head
    # LFM2's final norm is stored under the embedding norm's name
    _embeddings(w, shape, output_norm="token_embd_norm.weight")
    for i, attends_here in enumerate(attends):
        p = f"blk.{i}."
        w.f32(p + "attn_norm.weight", shape.n_embd, fill=1.0)
        if attends_here:
            w.f32(p + "attn_q_norm.weight", head_dim, fill=1.0)
            w.f32(p + "attn_k_norm.weight", head_dim, fill=1.0)
            _attention(w, i, shape, head_dim)
        else:
            w.f32(p + "shortconv.conv.weight", shape.n_embd, _SHORTCONV_L_CACHE)
            w.matrix(p + "shortconv.in_proj.weight", 3 * shape.n_embd, shape.n_embd)
            w.matrix(p + "shortconv.out_proj.weight", shape.n_embd, shape.n_embd)
        _ffn(w, i, shape)


_WRITERS: dict[str, Callable[[gguf.GGUFWriter, _Weights, Shape], None]] = {
    "mamba2": _write_mamba2,
    "qwen35": _write_qwen35,
    "granitehybrid": _write_granitehybrid,
    "lfm2": _write_lfm2,
}


def write_model(
    path: str | Path, family: str, *, shape: Shape | None = None, seed: int = 0
) -> Path:
    """Write a synthetic GGUF of ``family`` (a key of :data:`FAMILIES`) to ``path``.

    The same family, shape and seed always give the same file.

    Raises:
        ValueError: for a family this module does not write.
    """
    if family not in _WRITERS:
        raise ValueError(f"no synthetic writer for {family!r}; known: {sorted(_WRITERS)}")
    shape = shape or Shape()
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), family)
    _common(writer, family, shape)
    _WRITERS[family](writer, _Weights(writer, seed), shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    """``python -m skippy_llama.testing.synthetic OUT.gguf FAMILY [--seed N]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_model(args.out, args.family, seed=args.seed))


if __name__ == "__main__":
    main()
