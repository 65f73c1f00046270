"""Signed handoff bundles: one cached prefix moved between machines that share no server.

``bundle`` is the file format, signed with ed25519 and checked against a trust list (pure: bytes
in, bytes out); ``l3`` exports a prefix from an L3 store into a bundle and imports one into
another. Needs the ``remote`` extra (``cryptography``).
"""

from .bundle import Bundle, BundlePage, BundleRefused, generate_keypair, load_trust, read_bundle
from .l3 import export_prefix, import_bundle

__all__ = [
    "Bundle",
    "BundlePage",
    "BundleRefused",
    "export_prefix",
    "generate_keypair",
    "import_bundle",
    "load_trust",
    "read_bundle",
]
