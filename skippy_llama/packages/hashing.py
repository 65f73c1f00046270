"""sha256 of package files, computed while copying so a multi-GB GGUF is read once."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Final

_CHUNK: Final = 8 << 20


def sha256_file(path: Path) -> tuple[int, str]:
    """``(size, sha256 hex)`` of a file."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def copy_hashing(src: Path, dst: Path) -> tuple[int, str]:
    """Copy ``src`` to ``dst`` and return ``(size, sha256)`` of the bytes written."""
    h = hashlib.sha256()
    size = 0
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return size, h.hexdigest()
