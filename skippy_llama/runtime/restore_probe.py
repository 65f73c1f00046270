"""Probe: is a whole-sequence state restore exact for models whose memory is not per token?

For a recurrent or hybrid model (Mamba2, Gated DeltaNet, short-convolution layers beside
attention) a prefix can be restored only where its whole per-sequence state was captured: a
*restore point* (issue 46, DESIGN.md section 13). This probe decodes a prompt of ``p`` tokens in
sequence 0, captures the sequence (``llama_state_seq_get_data``), clears the memory, restores the
capture (``llama_state_seq_set_data``) and decodes a suffix, then compares the suffix's logits
bit for bit with

- a cold prefill of prompt + suffix in one batch (what plain ``Llama`` computes), and
- the same split without the restore (prompt, then suffix: only the restore differs).

It repeats that with the prompt prefilled in chunks ending at ``p``, and with a device
checkpoint (``LLAMA_STATE_SEQ_FLAGS_ON_DEVICE``, the L1 mechanism of DESIGN.md section 11)
instead of a host blob. Uses llama.cpp's C API directly on its own model and context.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from ..errors import TierError
from . import native

#: The sequence the probe decodes in, and the slot its device checkpoints use.
_SEQ, _SLOT = 0, 1


@dataclass
class PointResult:
    """Exactness at one prompt end ``p`` (each ``*_exact``: every suffix logit bit-identical)."""

    prompt_tokens: int
    suffix_tokens: int
    #: cold prompt-then-suffix (no restore) equals cold prompt+suffix in one batch
    split_exact: bool
    #: host-blob restore at p + suffix equals the one-batch cold prefill
    restore_exact: bool
    #: host-blob restore at p + suffix equals the same split without a restore
    restore_matches_split: bool
    #: as ``restore_exact``, the prompt prefilled in chunks of ``chunk`` tokens ending at p
    chunked_restore_exact: bool
    #: device checkpoint (ON_DEVICE) restore + suffix equals the one-batch cold prefill, or why not
    device_checkpoint: str
    #: attention cells of a longer sequence sharing [0, p), cut back to p, plus a snapshot of
    #: only the recurrent state at p (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``), then the suffix,
    #: equals the one-batch cold prefill: restore point = attention pages + snapshot(p)
    snapshot_exact: bool
    #: bytes of that snapshot (the whole state for a purely recurrent model)
    snapshot_bytes: int
    #: the control: a capture of another prompt, restored at p, changes the suffix's logits
    #: (the comparisons can fail)
    control_differs: bool
    #: largest |difference| of the host-blob restore's logits from the one-batch cold ones
    max_abs_diff: float
    state_bytes: int


@dataclass
class ProbeReport:
    """What :func:`probe_restore_points` found for one model file."""

    model: str
    architecture: str
    recurrent: bool
    hybrid: bool
    n_vocab: int
    #: whole-sequence state bytes of an empty-ish sequence (1 token) and growth per token
    state_bytes_1: int
    state_bytes_per_token: float
    chunk: int
    flash_attn: bool
    points: list[PointResult] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """Whether a host-blob restore was exact at every probed prompt end."""
        return all(p.restore_exact and p.chunked_restore_exact for p in self.points)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["exact"] = self.exact
        return out


class _Probe:
    """A model and context of llama.cpp's C API with a batch of ``n_batch`` tokens; ``owned``
    handles are freed by :meth:`close` (a borrowed context, a ``Llama``'s, is left alone)."""

    def __init__(self, model: Any, ctx: Any, n_batch: int, *, owned: bool) -> None:
        self.model, self.ctx, self.owned = model, ctx, owned
        vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    @classmethod
    def load(cls, path: str, n_ctx: int, n_threads: int, flash_attn: bool) -> _Probe:
        """Its own model and a two-sequence context (working sequence, checkpoint slot)."""
        mparams = llama_cpp.llama_model_default_params()
        model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
        if not model:
            raise TierError(f"could not load {path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_ctx
        cparams.n_ubatch = n_ctx
        cparams.n_seq_max = 2
        cparams.kv_unified = True
        cparams.n_threads = cparams.n_threads_batch = n_threads
        # llama.cpp's default (auto) turns flash attention on where plain Llama turns it off
        cparams.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise TierError(f"could not create a context for {path}")
        return cls(model, ctx, n_ctx, owned=True)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        if self.owned:
            llama_cpp.llama_free(self.ctx)
            llama_cpp.llama_model_free(self.model)

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(native.memory(self.ctx), True)

    def decode(self, tokens: Sequence[int], start: int, outputs_from: int) -> None:
        """Decode ``tokens`` at positions ``start..`` in one batch; logits for positions
        ``>= outputs_from``."""
        b = self.batch
        for i, token in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = _SEQ
            b.logits[i] = start + i >= outputs_from
        b.n_tokens = len(tokens)
        rc = int(llama_cpp.llama_decode(self.ctx, b))
        if rc != 0:
            raise TierError(f"llama_decode returned {rc}")

    def logits(self, n: int) -> npt.NDArray[np.float32]:
        """The last ``n`` output rows of the last decode."""
        rows = [
            np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(self.ctx, i - n), shape=(self.n_vocab,)
            ).copy()
            for i in range(n)
        ]
        return np.stack(rows)

    def prefill(self, tokens: Sequence[int], chunk: int | None = None) -> None:
        """Clear, then decode ``tokens`` from position 0 in chunks of ``chunk`` (one batch when
        None); no logits are asked for."""
        self.clear()
        step = chunk or len(tokens)
        for start in range(0, len(tokens), step):
            self.decode(tokens[start : start + step], start, len(tokens))

    def state(self, flags: int = 0) -> bytes:
        """Sequence 0's state (``llama_state_seq_get_data_ext`` with ``flags``)."""
        size = int(llama_cpp.llama_state_seq_get_size_ext(self.ctx, _SEQ, flags))
        buf = (ctypes.c_uint8 * size)()
        written = int(llama_cpp.llama_state_seq_get_data_ext(self.ctx, buf, size, _SEQ, flags))
        if written != size:
            raise TierError(f"llama_state_seq_get_data_ext wrote {written} of {size} bytes")
        return bytes(buf)

    def restore(self, blob: bytes, flags: int = 0, *, clear: bool = True) -> None:
        """Set sequence 0 from ``blob`` (after clearing the memory unless ``clear`` is False)."""
        if clear:
            self.clear()
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        read = int(llama_cpp.llama_state_seq_set_data_ext(self.ctx, buf, len(blob), _SEQ, flags))
        if read != len(blob):
            raise TierError("llama_state_seq_set_data_ext refused the capture")


@contextmanager
def _opened(path: str, n_ctx: int, n_threads: int, flash_attn: bool = False) -> Iterator[_Probe]:
    probe = _Probe.load(path, n_ctx, n_threads, flash_attn)
    try:
        yield probe
    finally:
        probe.close()


def probe_tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    """``n`` random ordinary token ids (above the three control tokens)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, n_vocab, size=n)]


def _point(
    probe: _Probe, tokens: list[int], p: int, chunk: int, *, device: bool = True
) -> PointResult:
    n = len(tokens)
    suffix = tokens[p:]
    # cold: the whole prompt in one batch, logits for the suffix's positions
    probe.clear()
    probe.decode(tokens, 0, p)
    cold = probe.logits(n - p)
    # the same split without a restore
    probe.prefill(tokens[:p])
    probe.decode(suffix, p, p)
    split = probe.logits(n - p)
    # host blob: capture at p, clear, restore, decode the suffix
    probe.prefill(tokens[:p])
    blob = probe.state()
    probe.restore(blob)
    probe.decode(suffix, p, p)
    restored = probe.logits(n - p)
    # chunks ending at p
    probe.prefill(tokens[:p], chunk)
    probe.restore(probe.state())
    probe.decode(suffix, p, p)
    chunked = probe.logits(n - p)
    snapshot_exact, snapshot_bytes = _snapshot(probe, tokens, p, cold)
    # the control: the capture of a prompt that differs in its first token
    first = 3 + (tokens[0] - 3 + 1) % (probe.n_vocab - 3)  # another ordinary token
    probe.prefill([first, *tokens[1:p]])
    probe.restore(probe.state())
    probe.decode(suffix, p, p)
    other = probe.logits(n - p)
    return PointResult(
        prompt_tokens=p,
        suffix_tokens=n - p,
        split_exact=bool(np.array_equal(split, cold)),
        restore_exact=bool(np.array_equal(restored, cold)),
        restore_matches_split=bool(np.array_equal(restored, split)),
        chunked_restore_exact=bool(np.array_equal(chunked, cold)),
        device_checkpoint=_device_checkpoint(probe, tokens, p, cold) if device else "skipped",
        control_differs=not np.array_equal(other, cold),
        snapshot_exact=snapshot_exact,
        snapshot_bytes=snapshot_bytes,
        max_abs_diff=float(np.max(np.abs(restored - cold))),
        state_bytes=len(blob),
    )


def _snapshot(
    probe: _Probe, tokens: list[int], p: int, cold: npt.NDArray[np.float32]
) -> tuple[bool, int]:
    """Restore p from a longer sequence's attention cells plus a recurrent-only snapshot."""
    partial = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    probe.prefill(tokens[:p])
    snapshot = probe.state(partial)
    # a longer sequence sharing [0, p) and differing after it
    probe.prefill([*tokens[:p], *reversed(tokens[p:])])
    longer = probe.state()
    probe.restore(longer)
    probe.restore(snapshot, partial, clear=False)
    # the recurrent state now sits at p - 1, so the cut of the attention cells [p, ...) succeeds
    if not native.seq_rm(probe.ctx, _SEQ, p, -1):
        return False, len(snapshot)
    probe.decode(tokens[p:], p, p)
    return bool(np.array_equal(probe.logits(len(tokens) - p), cold)), len(snapshot)


def _device_checkpoint(
    probe: _Probe, tokens: list[int], p: int, cold: npt.NDArray[np.float32]
) -> str:
    """Checkpoint sequence 0 at p into the slot as L1 does, clear, restore, decode the suffix."""
    probe.prefill(tokens[:p])
    try:
        meta = native.checkpoint(probe.ctx, _SEQ, _SLOT, p, on_device=True)
        probe.clear()
        native.restore_checkpoint(probe.ctx, meta, _SEQ, on_device=True)
        probe.decode(tokens[p:], p, p)
    except TierError as exc:
        return f"error: {exc}"
    return "exact" if np.array_equal(probe.logits(len(tokens) - p), cold) else "differs"


def probe_restore_points(
    model_path: str | Path,
    *,
    prompt_ends: Sequence[int] = (1, 17, 64, 100),
    suffix_tokens: int = 24,
    chunk: int = 16,
    n_threads: int = 1,
    flash_attn: bool = False,
    seed: int = 0,
) -> ProbeReport:
    """Probe restore exactness at each of ``prompt_ends`` (see the module docstring)."""
    n = max(prompt_ends) + suffix_tokens
    n_ctx = max(256, 1 << (n - 1).bit_length())
    with _opened(str(model_path), n_ctx, n_threads, flash_attn) as probe:
        arch = _metadata(probe.model, "general.architecture")
        tokens = probe_tokens(n, probe.n_vocab, seed)
        probe.prefill(tokens[:1])
        one = len(probe.state())
        probe.prefill(tokens[:65])
        per_token = (len(probe.state()) - one) / 64
        report = ProbeReport(
            model=Path(model_path).name,
            architecture=arch,
            recurrent=bool(llama_cpp.llama_model_is_recurrent(probe.model)),
            hybrid=bool(llama_cpp.llama_model_is_hybrid(probe.model)),
            n_vocab=probe.n_vocab,
            state_bytes_1=one,
            state_bytes_per_token=per_token,
            chunk=chunk,
            flash_attn=flash_attn,
        )
        for p in prompt_ends:
            report.points.append(_point(probe, tokens[: p + suffix_tokens], p, chunk))
    return report


def _metadata(model: Any, key: str) -> str:
    buf = ctypes.create_string_buffer(256)
    n = int(llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf)))
    return buf.value.decode("utf-8", "replace") if n >= 0 else "unknown"


#: The load-time check (:func:`restores_exactly`): prompt ends, suffix tokens, chunk tokens.
CHECK_ENDS, CHECK_SUFFIX, CHECK_CHUNK = (1, 13), 8, 4
#: The same where lone decodes are inexact (the stock library): no piece of a single token (a
#: one-token prompt, or 13 in chunks of 4 ending with [12, 13), differs there for that reason
#: alone: with these every synthetic family restored exactly on the stock build).
LONE_FREE_ENDS, LONE_FREE_CHUNK = (2, 13), 5
#: Tokens the lone-decode part of the check decodes one at a time after a restore (stock
#: kernels differ on some tokens only: on the stock build a synthetic LFM2's logits were 8e-4
#: off for one lone token and equal for the next, so one token proves nothing).
CHECK_LONE = 6


def restores_exactly(model: Any, ctx: Any, *, lone_free: bool = False) -> bool:
    """Whether, in this context (a ``Llama``'s: its kernel settings), a whole-sequence restore
    at a prompt end followed by a batched suffix gives a cold one-batch prefill's logits bit for
    bit, after a prefill in one batch and in chunks. Clears the context's memory.

    ``lone_free``: decode no piece of a single token (where lone decodes are inexact, the
    runtime never does; see :func:`lone_suffixes_exact`).

    Decodes about 20 tokens a dozen times: milliseconds for the synthetic models.
    """
    ends, chunk = (LONE_FREE_ENDS, LONE_FREE_CHUNK) if lone_free else (CHECK_ENDS, CHECK_CHUNK)
    n = max(ends) + CHECK_SUFFIX
    probe = _Probe(model, ctx, n, owned=False)
    try:
        tokens = probe_tokens(n, probe.n_vocab)
        for p in ends:
            point = _point(probe, tokens[: p + CHECK_SUFFIX], p, chunk, device=False)
            if not (point.restore_exact and point.chunked_restore_exact and point.control_differs):
                return False
        return True
    finally:
        probe.clear()
        probe.close()


def lone_suffixes_exact(model: Any, ctx: Any) -> bool:
    """Whether, in this context, tokens decoded one at a time after a restore (a prompt that
    extends a restore point by one token) give a cold one-batch prefill's logits bit for bit:
    restores at ``CHECK_ENDS[-1]`` and each of the next ``CHECK_LONE - 1`` positions, each
    followed by one lone token. Clears the context's memory.

    Stock ggml-cpu computes a product of one column with ``vec_dot`` instead of the sgemm
    kernels of a batch (patch 0004 removes that), so there this fails for most models.
    """
    p0 = max(CHECK_ENDS)
    n = p0 + CHECK_LONE
    probe = _Probe(model, ctx, n, owned=False)
    try:
        tokens = probe_tokens(n, probe.n_vocab, seed=1)
        probe.clear()
        probe.decode(tokens, 0, p0)
        cold = probe.logits(CHECK_LONE)
        for i, p in enumerate(range(p0, n)):
            probe.prefill(tokens[:p])
            probe.restore(probe.state())
            probe.decode(tokens[p : p + 1], p, p)
            if not np.array_equal(probe.logits(1)[0], cold[i]):
                return False
        return True
    finally:
        probe.clear()
        probe.close()


def aligned_restores_exactly(llm: llama_cpp.Llama, align: int, suffix: int = CHECK_SUFFIX) -> bool:
    """Whether, in ``llm``'s own context and batching (``Llama.eval``: batches of ``n_batch``,
    micro-batches of ``n_ubatch``), a whole-sequence restore at ``align`` tokens (and at twice
    that where the context holds it) followed by the rest of the prompt gives the last logits
    of a cold ``Llama.eval`` of the whole prompt bit for bit. Clears the context's memory.

    The check where batch splits change results (a GPU, flash attention): with points on
    multiples of ``n_ubatch`` the rest of a prompt is decoded in the very micro-batches the
    cold prefill used, so the split cannot differ; what is left to prove is the restore.
    """
    n_ctx = llm.n_ctx()
    ends = [p for p in (align, 2 * align) if p + suffix <= n_ctx]
    if not ends:
        return False
    tokens = probe_tokens(max(ends) + suffix, llm.n_vocab())
    memory = native.memory(llm.ctx)

    def clear() -> None:
        llama_cpp.llama_memory_clear(memory, True)
        llm.n_tokens = 0

    def last() -> npt.NDArray[np.float32]:
        return np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)
        ).copy()

    try:
        for p in ends:
            prompt = tokens[: p + suffix]
            clear()
            llama_cpp.Llama.eval(llm, prompt)
            cold = last()
            clear()
            llama_cpp.Llama.eval(llm, prompt[:p])
            blob = bytearray(native.get_seq_state(llm.ctx, _SEQ))
            clear()
            if not native.set_seq_state(llm.ctx, blob, _SEQ):
                return False
            llm.input_ids[:p] = prompt[:p]
            llm.n_tokens = p
            llama_cpp.Llama.eval(llm, prompt[p:])
            if not np.array_equal(last(), cold):
                return False
        return True
    finally:
        clear()
