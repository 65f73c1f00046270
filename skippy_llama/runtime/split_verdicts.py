"""The split probe's verdicts (``probes.split_invariant``), kept so a model is probed once.

The probe decodes a few short batches at load: 0.4 s for SmolLM2 on two cores, seconds for a
7B model on the CPU. Its answer depends only on the model file, the llama.cpp build, the CPU and
the context settings that choose kernels, so verdicts are kept in this process and in
``~/.cache/skippy-llama/split-verdicts.json`` under a key digesting all of those: the model and
each of llama-cpp-python's libraries by the stamp the digest memo trusts (device, inode, size,
mtime, ctime; a reinstalled build or a rewritten model is probed again), the CPU by its model
name and feature flags (a home directory shared between machines). The file is this user's own
cache, trusted as the digest memo beside it is; an entry that is not a boolean is ignored and
the model probed again.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Iterable
from pathlib import Path

import llama_cpp
import xxhash

from ..identity import file_stamp, read_memo, user_cache_dir, write_memo

_verdicts: dict[str, bool] = {}


def _memo_path() -> Path:
    return user_cache_dir() / "split-verdicts.json"


@functools.cache  # the CPU and the loaded library do not change within a process
def _cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(sorted({line for line in text.splitlines() if line.startswith(keys)}))


@functools.cache
def _build() -> str:
    lib = Path(llama_cpp.__file__).parent / "lib"
    files = sorted(p for p in lib.iterdir() if p.is_file()) if lib.is_dir() else []
    return "\n".join(f"{p.name} {file_stamp(p)}" for p in files)


def verdict_key(model_path: str, settings: Iterable[object]) -> str:
    """The key of a verdict: the model file, the build, the CPU and ``settings`` (the context
    fields that choose kernels)."""
    model = Path(model_path).resolve()
    parts = [str(model), file_stamp(model), _build(), _cpu(), *map(str, settings)]
    return xxhash.xxh3_128_hexdigest("\0".join(parts).encode())


def lookup(key: str) -> bool | None:
    """The verdict kept under ``key``, or None when the model must be probed."""
    if key in _verdicts:
        return _verdicts[key]
    value = read_memo(_memo_path()).get(key)
    if not isinstance(value, bool):
        return None
    _verdicts[key] = value
    return value


def remember(key: str, verdict: bool) -> None:
    """Keep a verdict in this process and in the user's cache (best effort)."""
    _verdicts[key] = verdict
    write_memo(_memo_path(), key, verdict)
