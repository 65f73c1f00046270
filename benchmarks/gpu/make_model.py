"""Write a synthetic llama-architecture GGUF (random F16 weights) with a real SPM vocabulary.

Timings of prefill and KV state transfer do not depend on the weights' values, so a model of a
realistic size can be made where no model hub is reachable. ``benchmarks/gpu/run.sh`` writes the
1.1B model of the GPU figures with it (22 layers x 2048 wide, 32 heads, 4 KV heads, FFN 5632;
22,540 state bytes per token at F16)::

    python benchmarks/gpu/make_model.py OUT.gguf VOCAB.gguf 22 2048 32 4 5632 32768

``VOCAB.gguf`` is a vocabulary-only GGUF such as ``vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf``
of the llama-cpp-python sdist. Arguments: n_layer n_embd n_head n_head_kv n_ff [n_ctx].
"""

from __future__ import annotations

import sys

import gguf
import numpy as np

_TOKENIZER_FIELDS = {
    "tokenizer.ggml.tokens": "add_token_list",
    "tokenizer.ggml.scores": "add_token_scores",
    "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.model": "add_tokenizer_model",
    "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id",
    "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id",
    "tokenizer.ggml.add_bos_token": "add_add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_add_eos_token",
}


def main(argv: list[str]) -> None:
    if len(argv) < 7:
        sys.exit(__doc__)
    out, vocab_path = argv[0], argv[1]
    n_layer, n_embd, n_head, n_kv, n_ff = map(int, argv[2:7])
    n_ctx = int(argv[7]) if len(argv) > 7 else 16384
    hd = n_embd // n_head
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name("synthetic-llama")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(hd)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens = None
    for name, field in gguf.GGUFReader(vocab_path).fields.items():
        if name in _TOKENIZER_FIELDS:
            value = field.contents()
            if name == "tokenizer.ggml.tokens":
                tokens = value
            getattr(writer, _TOKENIZER_FIELDS[name])(value)
    if tokens is None:
        sys.exit(f"{vocab_path} holds no tokenizer.ggml.tokens")
    n_vocab = len(tokens)
    rng = np.random.default_rng(0)

    def rnd(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", rnd(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", rnd(n_vocab, n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(p + "attn_q.weight", rnd(n_head * hd, n_embd))
        writer.add_tensor(p + "attn_k.weight", rnd(n_kv * hd, n_embd))
        writer.add_tensor(p + "attn_v.weight", rnd(n_kv * hd, n_embd))
        writer.add_tensor(p + "attn_output.weight", rnd(n_embd, n_head * hd))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(p + "ffn_gate.weight", rnd(n_ff, n_embd))
        writer.add_tensor(p + "ffn_up.weight", rnd(n_ff, n_embd))
        writer.add_tensor(p + "ffn_down.weight", rnd(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print("wrote", out, "vocab", n_vocab)


if __name__ == "__main__":
    main(sys.argv[1:])
