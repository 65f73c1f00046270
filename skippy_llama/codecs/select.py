"""Which codec pages of a cache identity are stored with: chosen once, when the identity is built.

The identity builder (``runtime/identity_params.py``) decides, from ``l3.codec``,
``remote.codec`` and the roster's ``cachegen`` row for the model, K/V layout and backend, whether
an identity is a lossy one, puts the codec and its parameters into the identity, and registers
the choice here under the identity's hex; the L3 writer looks it up by the record's identity and
codes with it where its own ``l3.codec`` is cachegen (the remote tier is handed the parameters
when it is built). So the codec follows from the identity (one identity, one codec): a page key
names exact bytes or bytes of one lossy codec's values, never both; under a lossy identity a tier
may still store its pages losslessly (the values already went through the codec somewhere).

An identity with no registered choice (a tier used on its own, a process that built no identity)
stores native pages.
"""

from __future__ import annotations

import logging
import threading

from .cachegen import CacheGenParams

log = logging.getLogger("skippy_llama")

_LOCK = threading.Lock()
_CHOICES: dict[str, CacheGenParams] = {}
_WARNED: set[str] = set()


def register(identity_hex: str, params: CacheGenParams | None) -> None:
    """Store pages of ``identity_hex`` with CacheGen ``params`` (None: native)."""
    with _LOCK:
        if params is None:
            _CHOICES.pop(identity_hex, None)
        else:
            _CHOICES[identity_hex] = params


def cachegen_params(identity_hex: str) -> CacheGenParams | None:
    """The CacheGen parameters pages of ``identity_hex`` are stored with (None: native)."""
    with _LOCK:
        return _CHOICES.get(identity_hex)


def warn_once(key: str, message: str, *args: object) -> bool:
    """Log ``message`` at warning level the first time ``key`` is seen in this process."""
    with _LOCK:
        if key in _WARNED:
            return False
        _WARNED.add(key)
    log.warning(message, *args)
    return True
