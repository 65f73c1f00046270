"""The remote tier: KV pages shared by several machines through a Redis-protocol server.

``keys`` (where values live), ``codec`` (authenticated frames; never pickle), ``breaker`` (the
circuit breaker), ``client`` (the connection and what its failures mean), ``store``
(``RemoteStore``, the server's client: match, fetch, push, status), ``tier`` (``RemoteTier``,
the store under the page-tier protocol for one cache identity) and ``admin`` (server status,
clear, prune). Importing this package needs the ``remote`` extra
(``pip install skippy-llama[remote]``).
"""

from .store import PushResult, RemoteStore
from .tier import RemoteTier

__all__ = ["PushResult", "RemoteStore", "RemoteTier"]
