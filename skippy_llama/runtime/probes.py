"""Load-time probes: where this model, build and CPU let a cached prefix end, exactly.

- :func:`cache_refusal`: why the paged cache refuses the model outright (embeddings,
  recurrent or hybrid memory), read from its context and metadata alone.
- :func:`canonical_granule`: reused prefixes end at multiples of this (1: any token).
- :func:`lone_decodes_exact`: whether a token decoded alone leaves the cells and logits a
  batched prefill gives it (then a reply is reusable as generated).

Each probe decodes a short fixed prompt a few ways with plain ``Llama.eval`` and compares; its
verdict is kept per model, build, CPU and kernel settings (``split_verdicts``), so later loads
pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import llama_cpp
import numpy as np

from ..identity import paging_refusal
from . import split_verdicts
from .seam import backend_name, registered_backends
from .working import WorkingSequence

#: The lone-decode probe (see :func:`lone_decodes_exact`): this many tokens decoded one at a
#: time after the split probe's prompt (stock SmolLM2 Q4_1 on AVX-512 gives the same logits
#: for a lone 16th token, but not for a lone 17th to 24th).
LONE_PROBE_TOKENS = 8
#: The split probe (see :func:`split_invariant`): a prompt of this many tokens, decoded whole
#: and then split after each of these many tokens (parts of every residue class that grouped
#: kernels treat apart, and the two-token tail a prompt's suffix can be: Gemma 3 Q4_K_M differs
#: at each of them, SmolLM2 Q4_1 at none).
SPLIT_PROBE_TOKENS = 16
SPLIT_PROBE_AT = (1, 3, 6, 11, 13, 14)
#: The context fields that choose llama.cpp's kernels, part of a probe verdict's key.
_KERNEL_FIELDS = (
    "n_ctx",
    "n_batch",
    "n_ubatch",
    "n_seq_max",
    "n_threads",
    "n_threads_batch",
    "type_k",
    "type_v",
    "flash_attn_type",
    "offload_kqv",
    "swa_full",
    "kv_unified",
)


def cache_refusal(llm: llama_cpp.Llama) -> str | None:
    """Why the paged cache cannot serve ``llm`` at all (None: it may): embedding contexts, and
    models whose memory is not per-token (recurrent or hybrid)."""
    if llm.context_params.embeddings:
        return "embedding contexts are not cached"
    if llm._is_recurrent or llm._is_hybrid:
        arch = str(llm.metadata.get("general.architecture", "unknown"))
        return paging_refusal(arch, (), recurrent=True)
    return None


def canonical_granule(seq: WorkingSequence) -> tuple[int, str | None]:
    """Reused prefixes end at multiples of this; every prefill starts at one. With it, why
    caching must be off (no canonical split exists), or None.

    On GPU builds, and on the CPU with flash attention on, llama.cpp's kernels make K/V bytes
    and logits depend on how a prompt is split into micro-batches. Every prefill is then
    decoded in chunks whose boundaries sit at multiples of ``n_ubatch`` (``Llama.eval``
    splits by ``n_batch``, a multiple of it), and cached cells are reused only up to such
    a boundary, so a cached run decodes exactly the micro-batches a cold one does. On the
    CPU with flash attention off the bytes do not depend on the split for most weight
    types (any token boundary then), but not for all (see :func:`split_invariant`), nor
    with a BLAS backend.
    """
    llm = seq.llm
    flash = llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    # a BLAS build hands llama.cpp's matrix products of 32 or more tokens to BLAS (ggml-blas
    # min_batch) and smaller ones to ggml's kernels: too large for the probe to see
    blas = "BLAS" in registered_backends()
    if backend_name() == "CPU" and not flash and not blas and split_invariant(seq):
        return 1, None
    n_ubatch = int(llm.context_params.n_ubatch)
    if llm.n_batch % n_ubatch:
        return n_ubatch, (
            f"n_batch {llm.n_batch} is not a multiple of n_ubatch {n_ubatch}: "
            "prefills cannot be split canonically"
        )
    return n_ubatch, None


def split_invariant(seq: WorkingSequence) -> bool:
    """Whether this model's prefill gives every token the same results however the prompt
    is split into batches (asked on the CPU with flash attention off).

    Most weight types do there (SmolLM2 Q4_1: 0 of 70 splits of a 171-token prompt changed
    its last logits), but weights that ggml repacks for the CPU (Q4_0, Q4_K, IQ4_NL on AVX2,
    more on Arm) go through kernels that take a batch's columns in groups, so a token's
    results depend on where its batch starts and ends: Gemma 3 270M Q4_K_M changed its last
    logits at 54 of 70 splits, by up to 1.46 (``benchmarks/experiments/probe_split.py``), and an L1 hit
    reused at such a point answered differently from a cold prompt. A short prompt decoded
    whole, then split at several points, decides: any difference and reuse ends on
    ``n_ubatch`` boundaries, as on GPU builds. Costs thirteen decodes of 16 tokens or fewer
    (0.45 s for SmolLM2 on two cores) the first time a model is loaded with given kernel
    settings on a build and CPU; later loads reuse the verdict (``split_verdicts``).
    """
    if not seq.caching or seq.llm.n_ctx() <= SPLIT_PROBE_TOKENS:
        return False
    return _kept_verdict(seq.llm, "split", lambda: _probe_split(seq))


def lone_decodes_exact(seq: WorkingSequence) -> bool:
    """Whether tokens decoded one at a time (a reply being generated) leave the same cells
    and logits as the same tokens in a batched prefill (asked where any batch split is).

    Stock ggml-cpu hands products of one column to ``vec_dot``, which sums in another order
    than the sgemm kernels batches take, so a reply's cells differ from a cold prefill's
    and must be decoded again as a batch before a next turn reuses them (the repair, or
    the next prefill): exactness's whole cost in a linear chat. The native patch 0004 sends
    single columns through sgemm too, and this probe then finds them equal, so replies are
    reused as generated. Decodes the split probe's prompt whole, then all but its last
    ``LONE_PROBE_TOKENS`` tokens followed by those one at a time, and compares the
    sequence's state bytes (every cell) and the last logits. Kept like the split verdict.
    """
    if seq.llm.n_ctx() <= SPLIT_PROBE_TOKENS + LONE_PROBE_TOKENS:
        return False
    return _kept_verdict(seq.llm, "lone", lambda: _probe_lone(seq))


def _kept_verdict(llm: llama_cpp.Llama, probe: str, run: Callable[[], bool]) -> bool:
    """``probe``'s verdict for this model, build, CPU and kernel settings: kept, else run."""
    p = llm.context_params
    settings = (probe, *(f"{f}={int(getattr(p, f))}" for f in _KERNEL_FIELDS))
    key = split_verdicts.verdict_key(llm.model_path, settings)
    verdict = split_verdicts.lookup(key)
    if verdict is None:
        verdict = run()
        split_verdicts.remember(key, verdict)
    return verdict


def probe_tokens(llm: llama_cpp.Llama, n: int) -> list[int]:
    """The load-time probes' prompt: ``n`` fixed tokens spread over the vocabulary."""
    return [(7919 * i + 101) % llm.n_vocab() for i in range(n)]


def _plain_eval(llm: llama_cpp.Llama, tokens: list[int]) -> None:
    llama_cpp.Llama.eval(llm, tokens)  # plain decodes: no cache involved


def _probe_lone(seq: WorkingSequence) -> bool:
    llm = seq.llm
    vocab = llm.n_vocab()
    n = SPLIT_PROBE_TOKENS + LONE_PROBE_TOKENS
    tokens = probe_tokens(llm, n)

    def decoded(batched: int) -> tuple[bytes, Any]:
        seq.drop()
        _plain_eval(llm, tokens[:batched])
        for token in tokens[batched:]:
            _plain_eval(llm, [token])
        return seq.seam.state(), seq.seam.last_logits(vocab)

    try:
        cells, logits = decoded(n)
        lone_cells, lone_logits = decoded(SPLIT_PROBE_TOKENS)
        return cells == lone_cells and np.array_equal(logits, lone_logits)
    finally:
        seq.drop()


def _probe_split(seq: WorkingSequence) -> bool:
    llm = seq.llm
    vocab = llm.n_vocab()
    tokens = probe_tokens(llm, SPLIT_PROBE_TOKENS)

    def last_logits(split: int) -> Any:
        seq.drop()
        for part in (tokens[:split], tokens[split:]):
            if part:
                _plain_eval(llm, part)
        return seq.seam.last_logits(vocab)

    try:
        whole = last_logits(0)
        return all(np.array_equal(last_logits(k), whole) for k in SPLIT_PROBE_AT)
    finally:
        seq.drop()
