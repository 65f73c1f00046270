"""The cache identity of a live ``llama_cpp.Llama``: one table that classifies every parameter.

Every parameter of ``llama_cpp.Llama.__init__`` and every field of ``llama_context_params`` and
``llama_model_params`` is listed here exactly once, as part of the cache identity or KV-neutral,
with the reason (``tests/unit/test_identity_table.py`` fails on any name the installed
llama-cpp-python has that the table lacks). Some belong to the identity only where they change the
bytes of a page:

- ``offload``: GPU builds only (which device computes a layer changes its kernels);
- ``batch_split``: GPU builds or flash attention on, where kernels depend on how the prompt was
  cut into batches (issue 12: on CPU with flash attention off they do not, except for weights
  ggml repacks and BLAS builds, which the runtime detects at load);
- ``longrope``: models with LongRoPE factors, whose rope switches between short and long factors
  by the per-sequence context length.

``cross_backend`` (off by default) drops only the backend component: the build's backend name,
the ``offload`` fields and the device names. The ``batch_split`` fields then stay in the identity
on every build, so that two backends share pages only where they split prompts alike.

The GGUF content digest is computed only when a tier that outlives the process (L2/L3) is on;
L1 alone gets a per-process identity, which can never address L2/L3 pages.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import llama_cpp

from ..codecs import select
from ..codecs.cachegen import CacheGenParams
from ..config import Settings
from ..errors import ConfigError, RosterError
from ..identity import CacheIdentity, ModelIdentity, file_digest, process_digest
from ..roster import load_roster
from . import native

log = logging.getLogger("skippy_llama")

Rule = Literal["identity", "typed", "offload", "batch_split", "longrope", "neutral", "via"]


@dataclass(frozen=True)
class Entry:
    """How one parameter or field relates to the cache identity, and why."""

    rule: Rule
    reason: str
    #: For ``via``: the struct field this ``Llama`` argument sets (``context.X`` / ``model.X``),
    #: or ``lora`` for the adapter, whose digest and scale are one identity value.
    via: str = ""


def _via(target: str, reason: str = "") -> Entry:
    return Entry("via", reason or f"sets {target}; classified there", target)


_SAMPLING = "sampling and prompt text only; the page keys hash the tokens themselves"
_NOT_CACHED = "embedding contexts are not cached (cache_disabled_reason)"
_CAUTION = "when in doubt, miss"

#: Arguments of ``llama_cpp.Llama.__init__``.
LLAMA_INIT: Mapping[str, Entry] = {
    "self": Entry("neutral", "the instance"),
    "model_path": Entry(
        "typed", "model.digest: the GGUF's content digest (a moved or renamed file keeps its pages)"
    ),
    "n_gpu_layers": _via("model.n_gpu_layers"),
    "split_mode": _via("model.split_mode"),
    "main_gpu": _via("model.main_gpu"),
    "tensor_split": _via("model.tensor_split"),
    "vocab_only": _via("model.vocab_only"),
    "use_mmap": _via("model.load_mode"),
    "use_mlock": _via("model.load_mode"),
    "kv_overrides": _via("model.kv_overrides"),
    "seed": Entry("neutral", _SAMPLING),
    "n_ctx": _via("context.n_ctx"),
    "n_batch": _via("context.n_batch"),
    "n_ubatch": _via("context.n_ubatch"),
    "n_threads": _via("context.n_threads"),
    "n_threads_batch": _via("context.n_threads_batch"),
    "rope_scaling_type": _via("context.rope_scaling_type"),
    "pooling_type": _via("context.pooling_type"),
    "attention_type": _via("context.attention_type"),
    "rope_freq_base": _via("context.rope_freq_base"),
    "rope_freq_scale": _via("context.rope_freq_scale"),
    "yarn_ext_factor": _via("context.yarn_ext_factor"),
    "yarn_attn_factor": _via("context.yarn_attn_factor"),
    "yarn_beta_fast": _via("context.yarn_beta_fast"),
    "yarn_beta_slow": _via("context.yarn_beta_slow"),
    "yarn_orig_ctx": _via("context.yarn_orig_ctx"),
    "logits_all": Entry("neutral", "which logits are kept, not the K/V of any cell"),
    "embedding": _via("context.embeddings"),
    "offload_kqv": _via("context.offload_kqv"),
    "flash_attn": _via("context.flash_attn_type"),
    "op_offload": _via("context.op_offload"),
    "swa_full": _via("context.swa_full"),
    "no_perf": _via("context.no_perf"),
    "last_n_tokens_size": Entry("neutral", "the repeat-penalty window of the sampler"),
    "lora_base": Entry("neutral", "stored but never used by llama-cpp-python 0.3.36"),
    "lora_scale": _via("lora", "the adapter's scale is part of the lora identity value"),
    "lora_path": _via("lora", "the adapter file's content digest is part of the lora value"),
    "numa": Entry("neutral", "memory placement of the weights, not their values"),
    "chat_format": Entry("neutral", _SAMPLING),
    "chat_handler": Entry("neutral", _SAMPLING),
    "draft_model": Entry("neutral", "proposes tokens; the main model computes every cached cell"),
    "tokenizer": Entry("neutral", _SAMPLING),
    "type_k": _via("context.type_k"),
    "type_v": _via("context.type_v"),
    "spm_infill": Entry("neutral", _SAMPLING),
    "verbose": Entry("neutral", "logging"),
    "kwargs": Entry("neutral", "llama_cpp.Llama ignores unknown keyword arguments"),
}

#: Fields of ``llama_context_params``.
CONTEXT_FIELDS: Mapping[str, Entry] = {
    "n_ctx": Entry(
        "longrope",
        "the per-sequence length (n_ctx_seq) picks LongRoPE's long or short factors; for other "
        "models a prefix's K/V does not depend on the context size",
    ),
    "n_batch": Entry("batch_split", "the batch split changes GPU and flash-attention kernels"),
    "n_ubatch": Entry("batch_split", "the micro-batch split changes GPU and flash-attention bits"),
    "n_seq_max": Entry(
        "neutral",
        "skippy sets it for resident slots; a sequence's cells do not depend on it "
        "(kv_unified, which does, is a typed field)",
    ),
    "n_rs_seq": Entry("neutral", "recurrent-state snapshots; recurrent models are not paged"),
    "n_outputs_max": Entry("batch_split", f"may change how a batch is split; {_CAUTION}"),
    "n_outputs_max_per_seq": Entry("batch_split", f"may change the batch split; {_CAUTION}"),
    "n_threads": Entry(
        "batch_split",
        f"CPU flash attention may split the KV range across threads; {_CAUTION}",
    ),
    "n_threads_batch": Entry("batch_split", f"as n_threads, for batches; {_CAUTION}"),
    "ctx_type": Entry("identity", "an MTP context computes other cells than a default one"),
    "rope_scaling_type": Entry("typed", "CacheIdentity.yarn"),
    "pooling_type": Entry("neutral", _NOT_CACHED),
    "attention_type": Entry("identity", "non-causal attention changes every later layer's K/V"),
    "flash_attn_type": Entry("typed", "CacheIdentity.flash_attn (and v_trans from the layout)"),
    "rope_freq_base": Entry("typed", "CacheIdentity.rope_freq_base"),
    "rope_freq_scale": Entry("typed", "CacheIdentity.rope_freq_scale"),
    "yarn_ext_factor": Entry("typed", "CacheIdentity.yarn"),
    "yarn_attn_factor": Entry("typed", "CacheIdentity.yarn"),
    "yarn_beta_fast": Entry("typed", "CacheIdentity.yarn"),
    "yarn_beta_slow": Entry("typed", "CacheIdentity.yarn"),
    "yarn_orig_ctx": Entry("typed", "CacheIdentity.yarn"),
    "defrag_thold": Entry("neutral", "deprecated and off; moves cells, never changes their bytes"),
    "cb_eval": Entry("neutral", "an observer callback"),
    "cb_eval_user_data": Entry("neutral", "an observer callback's data"),
    "type_k": Entry("typed", "CacheIdentity.type_k (and the layout digest)"),
    "type_v": Entry("typed", "CacheIdentity.type_v (and the layout digest)"),
    "abort_callback": Entry("neutral", "can stop a decode, never change its result"),
    "abort_callback_data": Entry("neutral", "the abort callback's data"),
    "embeddings": Entry("neutral", _NOT_CACHED),
    "offload_kqv": Entry("offload", "K/V and attention on the GPU or the CPU: other kernels"),
    "no_perf": Entry("neutral", "performance counters"),
    "op_offload": Entry("offload", "host-weight ops offloaded to the GPU: other kernels"),
    "swa_full": Entry("identity", "full-size SWA cache keeps other cells of SWA models"),
    "kv_unified": Entry("typed", "CacheIdentity.kv_unified"),
    "samplers": Entry("neutral", "backend samplers choose tokens, not K/V"),
    "n_samplers": Entry("neutral", "backend samplers choose tokens, not K/V"),
    "ctx_other": Entry("identity", f"a context sharing another's memory (MTP); {_CAUTION}"),
}

#: Fields of ``llama_model_params``.
MODEL_FIELDS: Mapping[str, Entry] = {
    "devices": Entry("offload", "which devices compute; the device names are recorded too"),
    "tensor_buft_overrides": Entry("identity", "moved or repacked weights take other kernels"),
    "n_gpu_layers": Entry("offload", "offloaded layers run GPU kernels"),
    "split_mode": Entry("offload", "how layers or rows are split across GPUs"),
    "main_gpu": Entry("offload", "the GPU that computes unsplit work"),
    "tensor_split": Entry("offload", "the share of each GPU"),
    "load_mode": Entry("neutral", "how the weights are read (mmap, mlock, direct I/O)"),
    "lazy_mode": Entry("neutral", "when the weights are read, not their values"),
    "progress_callback": Entry("neutral", "load progress"),
    "progress_callback_user_data": Entry("neutral", "load progress"),
    "kv_overrides": Entry("identity", "they change hyper-parameters after load"),
    "vocab_only": Entry("neutral", "a vocabulary-only model has no context to cache"),
    "check_tensors": Entry("neutral", "validation only"),
    "use_extra_bufts": Entry("identity", "repacked CPU weights take other kernels"),
    "no_host": Entry("offload", "bypassing the host buffer allows other weight buffers"),
    "no_alloc": Entry("neutral", "simulated allocation: such a model cannot decode"),
    "load_mtp": Entry("identity", f"extra MTP layers; {_CAUTION}"),
}

#: Bytes of a GGUF searched for LongRoPE factor tensors: their names sit in the header, which
#: comes before the tensor data.
_HEADER_SCAN = 256 << 20
_LONGROPE_TENSOR = b"rope_factors_long"


@dataclass(frozen=True)
class Conditions:
    """What decides whether a conditional entry is in the identity."""

    gpu: bool
    flash_attn: bool
    longrope: bool
    #: the CPU build's prefill of this model depends on the batch split (weights ggml repacks,
    #: a BLAS backend; ``probes.canonical_granule``), so the split is identity there too
    split_dependent: bool = False
    #: ``cross_backend`` is on: the backend component (the build's backend name, the offload
    #: settings and the device names) leaves the identity, and the batch split stays in it on
    #: every build, so the CPU, a partial and a full offload of one model name the same pages.
    cross_backend: bool = False

    def applies(self, rule: Rule) -> bool:
        """Whether an entry with ``rule`` belongs to the identity under these conditions."""
        if rule == "identity":
            return True
        if rule == "offload":
            return self.gpu and not self.cross_backend
        if rule == "batch_split":
            return self.gpu or self.flash_attn or self.split_dependent or self.cross_backend
        if rule == "longrope":
            return self.longrope
        return False


def select_params(values: Mapping[str, Any], conditions: Conditions) -> dict[str, Any]:
    """The identity ``params``: each table entry that applies, keyed ``context.X`` / ``model.X``.

    ``values`` holds every conditional or identity field's live value under that key, plus
    ``lora`` and (GPU builds) ``devices_names``; a key the table does not classify is an error,
    so a value cannot slip into or out of the identity unnoticed.
    """
    chosen: dict[str, Any] = {}
    for prefix, table in (("context", CONTEXT_FIELDS), ("model", MODEL_FIELDS)):
        for name, entry in table.items():
            key = f"{prefix}.{name}"
            if conditions.applies(entry.rule):
                if key not in values:
                    raise KeyError(f"no live value for identity field {key}")
                chosen[key] = values[key]
    chosen["lora"] = values["lora"]
    if conditions.gpu and not conditions.cross_backend:
        chosen["device_names"] = values["device_names"]
    unknown = set(values) - set(chosen) - _known_keys()
    if unknown:
        raise KeyError(f"unclassified identity values: {sorted(unknown)}")
    return chosen


def _known_keys() -> set[str]:
    keys = {"lora", "device_names"}
    keys |= {f"context.{n}" for n in CONTEXT_FIELDS}
    keys |= {f"model.{n}" for n in MODEL_FIELDS}
    return keys


_POINTERS: tuple[type, ...] = (
    ctypes.c_void_p,
    ctypes._Pointer,  # type: ignore[attr-defined]
    ctypes._CFuncPtr,  # type: ignore[attr-defined]
)


def _plain(value: Any, ctype: type) -> Any:
    """A ctypes field as a JSON value: a pointer becomes whether it is set (never its address)."""
    if issubclass(ctype, _POINTERS):
        return bool(ctypes.cast(value, ctypes.c_void_p).value) if value is not None else False
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def canonical_kv_overrides(overrides: Mapping[str, Any] | None) -> list[list[Any]] | None:
    """``kv_overrides`` as sorted ``[key, type, value]`` rows (``1``, ``1.0`` and ``True`` differ)."""
    if not overrides:
        return None
    return [[k, type(v).__name__, v] for k, v in sorted(overrides.items())]


def lora_value(path: str | None, scale: float, *, durable: bool) -> dict[str, Any] | None:
    """The adapter's content digest (per-process tag for L1 only) and scale, or ``None``."""
    if not path:
        return None
    digest = file_digest(path) if durable else process_digest()
    return {"digest": digest, "scale": float(scale)}


def has_longrope(model_path: str) -> bool:
    """Whether the GGUF carries LongRoPE factor tensors (names are in its header)."""
    try:
        with open(model_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(_LONGROPE_TENSOR, 0, _HEADER_SCAN) >= 0
    except (OSError, ValueError):
        return True  # unreadable: assume the length matters (a miss, never a wrong hit)


def live_values(llm: llama_cpp.Llama, *, durable: bool, gpu: bool) -> dict[str, Any]:
    """Every identity or conditional field's live value, keyed as :func:`select_params` wants."""
    values: dict[str, Any] = {}
    for prefix, params, table in (
        ("context", llm.context_params, CONTEXT_FIELDS),
        ("model", llm.model_params, MODEL_FIELDS),
    ):
        ctypes_of = dict(type(params)._fields_)
        for name, entry in table.items():
            if entry.rule not in ("typed", "neutral"):
                values[f"{prefix}.{name}"] = _plain(getattr(params, name), ctypes_of[name])
    # the context was re-created with one stream per resident slot: ask it, not the params
    values["context.n_ctx"] = int(llama_cpp.llama_n_ctx_seq(llm.ctx))
    values["model.tensor_split"] = [float(x) for x in (llm.tensor_split or [])]
    values["model.kv_overrides"] = canonical_kv_overrides(llm.kv_overrides)
    values["lora"] = lora_value(llm.lora_path, llm.lora_scale, durable=durable)
    if gpu:
        values["device_names"] = native.device_names()
    return values


def build_identity(
    llm: llama_cpp.Llama, settings: Settings, kv_layout: Any, *, split_dependent: bool = False
) -> CacheIdentity:
    """The cache identity of ``llm`` (a loaded ``Llama`` whose KV layout was probed).

    ``split_dependent``: the model's prefill depends on the batch split on this CPU build
    (see :class:`Conditions`), so ``n_batch`` and ``n_ubatch`` name its pages.

    The GGUF (and any LoRA adapter) is hashed only when L3 or the remote tier is on — L2 mirrors
    L3 and needs it too; L1 alone gets a per-process digest. The hash is memoized across processes and shows
    progress on stderr for files of 1 GiB or more.
    """
    model = llm._model.model
    # the remote tier outlives the process too: a per-process digest would never match there
    durable = settings.l3.mode != "off" or settings.remote.enabled
    backend = native.backend_name()
    gpu = backend != "CPU"
    p = llm.context_params
    flash = p.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    # within one process the context length is fixed, so only durable pages care about LongRoPE
    longrope = durable and has_longrope(llm.model_path)
    conditions = Conditions(
        gpu=gpu,
        flash_attn=flash,
        longrope=longrope,
        split_dependent=split_dependent,
        cross_backend=settings.cross_backend,
    )
    if settings.cross_backend:
        # loud on purpose: pages of another backend are not bit-exact here (issue 13 measures
        # how far they agree), so nobody should run with it on without knowing
        log.warning(
            "skippy-llama: cross_backend is ON: pages captured on other backends (CPU, CUDA, "
            "Vulkan, Metal; any offload) are restored on %s (n_gpu_layers=%s); outputs may "
            "differ from a cold prefill here. Turn it off (the default) for exact reuse.",
            backend,
            llm.model_params.n_gpu_layers,
        )
    params = select_params(live_values(llm, durable=durable, gpu=gpu), conditions)
    digest = file_digest(llm.model_path) if durable else process_digest()
    codec = codec_choice(settings, digest, backend, kv_layout) if durable else None
    geometry: dict[str, int | float | str] = {
        "n_layer": int(llama_cpp.llama_model_n_layer(model)),
        "n_embd": int(llama_cpp.llama_model_n_embd(model)),
        "n_head": int(llama_cpp.llama_model_n_head(model)),
        "n_head_kv": int(llama_cpp.llama_model_n_head_kv(model)),
        "n_vocab": int(llm.n_vocab()),
        "n_ctx_train": int(llama_cpp.llama_model_n_ctx_train(model)),
    }
    identity = CacheIdentity(
        model=ModelIdentity(
            digest=digest,
            architecture=str(llm.metadata.get("general.architecture", "unknown")),
            geometry=geometry,
            name=Path(llm.model_path).name,
        ),
        layout_digest=kv_layout.digest() if kv_layout is not None else "none",
        type_k=int(p.type_k),
        type_v=int(p.type_v),
        flash_attn=flash,
        v_trans=bool(kv_layout.v_trans) if kv_layout is not None else False,
        rope_freq_base=float(p.rope_freq_base),
        rope_freq_scale=float(p.rope_freq_scale),
        yarn=(
            float(p.yarn_ext_factor),
            float(p.yarn_attn_factor),
            float(p.yarn_beta_fast),
            float(p.yarn_beta_slow),
            float(p.yarn_orig_ctx),
            float(p.rope_scaling_type),
        ),
        n_swa=int(llama_cpp.llama_model_n_swa(model)),
        kv_unified=bool(p.kv_unified),
        backend="any" if settings.cross_backend else backend,
        namespace=settings.namespace,
        params=params,
        codec=codec.identity() if codec is not None else {},
    )
    select.register(identity.hex, codec)
    return identity


def codec_choice(
    settings: Settings, model_digest: str, backend: str, kv_layout: Any
) -> CacheGenParams | None:
    """The CacheGen parameters of this instance's cache identity, or None for an exact one.

    Asked for by ``l3.codec = "cachegen"`` (L3 stores CacheGen pages) or, with a remote tier,
    ``remote.codec = "cachegen"`` (pages travel to and from the server as CacheGen pages); either
    makes the identity a lossy one, distinct from the exact identity of the same model, so exact
    instances never read its pages on any tier. Granted only with a passing ``cachegen`` row in
    the roster for this model file, backend and K/V layout (``scripts/certify.py --cachegen``);
    otherwise the identity stays exact, logged once per model and layout (the L3 writer counts
    ``codec_unqualified``). The runtime never guesses parameters.

    Raises:
        ConfigError: a codec setting is cachegen but the ``cachegen`` extra is not installed.
    """
    wanted = [
        name
        for name, asked in (
            ("l3.codec", settings.l3.codec == "cachegen"),
            ("remote.codec", settings.remote.enabled and settings.remote.codec == "cachegen"),
        )
        if asked
    ]
    if not wanted:
        return None
    try:
        import zstandard  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"invalid setting {wanted[0]} = 'cachegen': the codec needs the cachegen extra "
            f"(pip install 'skippy-llama[cachegen]'); or set {wanted[0]} = 'native'"
        ) from None
    asked_by = " and ".join(wanted)
    layout = kv_layout.digest() if kv_layout is not None else "none"
    why = f"no cachegen row for model {model_digest}, backend {backend}, layout {layout}"
    try:
        roster = load_roster()
    except RosterError as exc:
        roster, why = None, f"the roster does not load: {exc}"
    row = roster.cachegen_row(model_digest, backend, layout) if roster is not None else None
    params = None
    if row is not None and row.params is not None:
        try:
            params = CacheGenParams.from_identity(dict(row.params))
        except ValueError as exc:
            why = f"the roster's cachegen row does not parse: {exc}"
    elif row is not None:
        why = f"its cachegen row failed qualification: {row.reason}"
    if params is None:
        select.warn_once(
            f"unqualified:{model_digest}:{backend}:{layout}",
            "skippy-llama: %s is cachegen, but this model and K/V layout are not qualified "
            "(%s); pages stay native",
            asked_by,
            why,
        )
        return None
    assert row is not None
    select.warn_once(
        f"cachegen:{model_digest}:{backend}:{layout}",
        "skippy-llama: CacheGen pages (%s, for %s): lossy, restores are not bit-identical to "
        "a cold prefill (qualified teacher-forced: next-token argmax agrees at %.2f%% of "
        "positions, mean KL %.4f nats, perplexity %+.2f%%, size %.3f of native)",
        params.describe(),
        asked_by,
        100 * float(row.measured.get("argmax_agree", 0.0)),
        float(row.measured.get("mean_kl", 0.0)),
        100 * float(row.measured.get("ppl_rise", 0.0)),
        float(row.measured.get("size_ratio", 0.0)),
    )
    return params
