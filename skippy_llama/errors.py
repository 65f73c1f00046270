"""The one exception tree of skippy-llama.

Every error the package raises on purpose derives from :class:`SkippyError`, so a caller can
catch the whole family in one ``except``. Cache-data problems (corrupt pages, layout drift) are
raised below the orchestrator and turned into misses there; configuration problems reach the
user at start-up with a message that names the setting.

The tree::

    SkippyError
    ├── ConfigError (ValueError)            a setting, named, with a valid example
    ├── StateFormatError (ValueError)       a sequence-state blob or page is malformed
    │   ├── LayoutMismatchError             ... or does not match the live KV layout
    │   └── UnknownCodecError               ... or names a codec this build does not read
    ├── TierError                           a cache tier failed; the orchestrator fails open
    │   ├── StoreDataError                  an L3 record on disk is damaged or foreign
    │   │   ├── ManifestError               ... a manifest (damaged, foreign or other version)
    │   │   └── UntrustedRowError           ... a row L3 did not write (pickle, foreign file)
    │   ├── TransientReadError              a value exists but cannot be read now
    │   └── UntrustedDirectoryError         the L3 directory is not private to this user
    ├── PackageError (ValueError)           a model package is malformed or tampered with
    ├── ModelNotFoundError (FileNotFoundError)
    ├── RosterError (ValueError)            the patch queue or roster is inconsistent
    └── BatchError                          a batch cannot go on (every Ray worker is gone)
"""

from __future__ import annotations


class SkippyError(Exception):
    """Base class of every error raised by skippy-llama."""


class ConfigError(SkippyError, ValueError):
    """An invalid setting: names the field, the value, and an example of a valid one."""


class StateFormatError(SkippyError, ValueError):
    """A llama.cpp sequence-state blob or a stored page is malformed or inconsistent."""


class LayoutMismatchError(StateFormatError):
    """A page or assembled blob does not match the live context's KV layout."""


class UnknownCodecError(StateFormatError):
    """A stored page names a codec this build does not read (written by another version)."""


class TierError(SkippyError):
    """A cache tier failed (I/O, corruption, lock contention); the orchestrator fails open."""


class StoreDataError(TierError):
    """An L3 record on disk (page metadata, manifest, child index, pin) is damaged, foreign, or of
    a version this build does not read: the store quarantines it and counts a miss."""


class ManifestError(StoreDataError):
    """An L3 manifest that does not parse, contradicts itself, is stored under another prefix's
    key, or has a version this build does not read (``version`` when it has one). The store
    quarantines it (its pages become orphans) and ``kv-cache`` commands skip it."""

    def __init__(self, message: str, *, version: object = None) -> None:
        super().__init__(message)
        self.version = version


class UntrustedRowError(StoreDataError):
    """An L3 store row skippy did not write: a pickled or text key or value, or a file name
    diskcache would not generate. It is dropped and counted, never unpickled or followed."""


class TransientReadError(TierError):
    """A stored value could not be read for a reason other than its absence (EIO, EMFILE,
    EACCES …): a fault and a miss, never a reason to delete anything."""


class UntrustedDirectoryError(TierError):
    """The L3 directory is a symlink, belongs to another user, or others may write it."""


class PackageError(SkippyError, ValueError):
    """A model package is missing, malformed, tampered with, or inconsistent."""


class ModelNotFoundError(SkippyError, FileNotFoundError):
    """The requested GGUF model is not available; the message says how to get it."""


class RosterError(SkippyError, ValueError):
    """The patch queue or the split-certified roster is missing, malformed or inconsistent."""


class BatchError(SkippyError):
    """A batch cannot go on: every Ray worker died (or none could load the model) and none can
    be started in its place. Finished items are in OUT; rerunning resumes."""
