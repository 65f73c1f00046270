"""The remote tier: KV pages shared by several machines through a Redis-protocol server.

``keys`` (where values live), ``codec`` (authenticated frames; never pickle), ``breaker`` (the
circuit breaker), ``client`` (the connection and what its failures mean), ``tier``
(``RemoteTier``: match, fetch, push, status) and ``admin`` (server status, clear, prune).
Importing this package needs the ``remote`` extra (``pip install skippy-llama[remote]``).
"""

from .tier import PushResult, RemoteTier

__all__ = ["PushResult", "RemoteTier"]
