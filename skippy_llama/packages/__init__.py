"""Model packages: a GGUF bound to its publisher's Hugging Face metadata at one commit.

A package folder holds the GGUF file(s), ``metadata/`` with the publisher files
(``config.json``, ``generation_config.json``, tokenizer configs) and ``model-package.json``
recording ``repo_id``, the 40-hex ``revision``, the size and sha256 of every file, the GGUF
geometry and the validation verdict. Publisher metadata is used only when every geometry field
both sides state agrees with the GGUF; it then steers the live K/V cache dtype
(:func:`~skippy_llama.packages.kvdtype.resolve_kv_dtype`). Nothing here imports llama_cpp.
"""

from __future__ import annotations

from .create import CreateResult, create_package
from .kvdtype import KVDtypeResolution, resolve_kv_dtype
from .loader import LoadedPackage, load_package
from .manifest import MANIFEST_NAME, Manifest
from .publisher import PublisherMetadata
from .verify import VerificationReport, verify_package

__all__ = [
    "MANIFEST_NAME",
    "CreateResult",
    "KVDtypeResolution",
    "LoadedPackage",
    "Manifest",
    "PublisherMetadata",
    "VerificationReport",
    "create_package",
    "load_package",
    "resolve_kv_dtype",
    "verify_package",
]
