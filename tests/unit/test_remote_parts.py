"""The remote tier's pure parts: value frames (what verifies and why not), key names, the
circuit breaker's states on an injected clock. The tier against a real server:
``tests/integration/test_remote_tier.py``."""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("redis") is None and not os.environ.get("CI"):
    pytest.skip("the remote extra (redis) is not installed", allow_module_level=True)

from skippy_llama.tiers.l3.auth import Signer
from skippy_llama.tiers.remote import codec
from skippy_llama.tiers.remote.breaker import Breaker
from skippy_llama.tiers.remote.keys import MANIFEST, PAGE, Keys, secret_id

SIGNER = Signer(b"s" * 32)
NAME = b"skippy:00ff:abc:p:" + b"11" * 16


def test_a_frame_round_trips_and_binds_its_key_kind_and_secret() -> None:
    value = codec.pack(SIGNER, NAME, codec.KIND_PAGE, 128, b"SKPG body")
    frame = codec.unpack(SIGNER, NAME, codec.KIND_PAGE, value)
    assert (frame.n_tokens, bytes(frame.body)) == (128, b"SKPG body")
    with pytest.raises(codec.FrameError, match="unauthenticated"):
        codec.unpack(SIGNER, NAME.replace(b"11", b"22", 1), codec.KIND_PAGE, value)
    with pytest.raises(codec.FrameError, match="unauthenticated"):
        codec.unpack(Signer(b"t" * 32), NAME, codec.KIND_PAGE, value)
    with pytest.raises(codec.FrameError, match="foreign"):
        codec.unpack(SIGNER, NAME, codec.KIND_MANIFEST, value)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda v: v[:-1], "truncated"),
        (lambda v: v[: codec.HEADER_BYTES - 1], "truncated"),
        (lambda v: b"", "truncated"),
        (lambda v: v + b"x", "foreign"),
        (lambda v: v[:-1] + b"X", "digest"),
        (lambda v: b"XXXX" + v[4:], "foreign"),
        (lambda v: v[:4] + b"\x09" + v[5:], "foreign"),  # another version
        # the n_tokens field changed: the digest (of the body) holds, the tag does not
        (lambda v: v[:6] + b"\x00\x01\x00\x00" + v[10:], "unauthenticated"),
    ],
)
def test_damage_is_named(damage: object, reason: str) -> None:
    value = codec.pack(SIGNER, NAME, codec.KIND_PAGE, 128, b"SKPG" + bytes(100))
    with pytest.raises(codec.FrameError) as info:
        codec.unpack(SIGNER, NAME, codec.KIND_PAGE, damage(value))  # type: ignore[operator]
    assert info.value.reason == reason


def test_key_names_parse_back_and_patterns_cover_one_identity() -> None:
    keys = Keys("team-a", secret_id(SIGNER))
    ident, key = "ab" * 16, bytes(range(16))
    page = keys.page(ident, key)
    assert keys.parse(page) == (ident, keys.secret, PAGE, key)
    assert keys.parse(keys.manifest(ident, key)) == (ident, keys.secret, MANIFEST, key)
    assert keys.pattern(ident) == f"team-a:{ident}:*".encode()
    assert keys.pattern(None, MANIFEST, mine=True) == f"team-a:*:{keys.secret}:m:*".encode()
    assert keys.parse(b"team-b:" + page[7:]) is None  # another namespace
    assert keys.parse(page + b"00") is None
    with pytest.raises(ValueError, match="not lowercase hex"):
        keys.page("AB*", key)
    assert secret_id(SIGNER) != secret_id(Signer(b"t" * 32))
    assert len(keys.secret) == 12 and b"s" * 32 not in page


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_n_failures_probes_once_and_backs_off_longer() -> None:
    clock = Clock()
    breaker = Breaker(3, 10.0, clock=clock, wall=clock)
    assert breaker.allow()
    assert not breaker.failure("timeout") and not breaker.failure("timeout")
    breaker.success()  # a success resets the count
    assert not breaker.failure("timeout") and not breaker.failure("timeout")
    assert breaker.failure("connection")  # the third in a row opens it
    status = breaker.status()
    assert (
        status.state == "open" and status.open_until == 10.0 and status.last_reason == "connection"
    )
    assert not breaker.allow()
    clock.now = 10.0
    assert breaker.status().state == "half_open"
    assert breaker.allow()  # one probe …
    assert not breaker.allow()  # … at a time
    assert breaker.failure("connection")  # the probe failed: open again, for 20 s
    assert breaker.status().open_until == 30.0
    clock.now = 30.0
    assert breaker.allow()
    breaker.success()
    assert breaker.status().state == "closed" and breaker.allow()
    # the back-off stops doubling at 8x
    for _ in range(6):
        for _ in range(3):
            breaker.failure("timeout")
        clock.now = breaker.status().open_until or 0.0
        breaker.allow()
    breaker.failure("timeout")
    assert (breaker.status().open_until or 0.0) - clock.now == 80.0
