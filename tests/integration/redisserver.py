"""A real ``redis-server`` (or ``valkey-server``) on a free loopback port and a Unix socket in a
temporary directory, for the remote tier's tests: started once per test session, stopped after.

Without the binary the tests skip, except under CI (``CI`` set), where they fail: CI installs
Debian's ``redis-server`` (``.ci/run``) and must run them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

#: How long a starting server may take to answer PING (a start-up wait, not an assertion).
START_TIMEOUT_S = 30.0


def server_binary() -> str:
    """The server binary; skips (fails under CI) when none is installed."""
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    message = "no redis-server or valkey-server on PATH (apt-get install redis-server)"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and {message}")
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One server process: ``url`` (TCP), ``unix_url`` (socket); kill, pause, restart it."""

    def __init__(self, directory: Path) -> None:
        self.binary = server_binary()
        self.directory = directory
        self.port = free_port()
        self.socket = directory / "redis.sock"
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.unix_url = f"unix://{self.socket}?db=0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = directory / "redis.log"

    def start(self) -> RedisServer:
        argv = [
            self.binary, "--bind", "127.0.0.1", "--port", str(self.port),
            "--unixsocket", str(self.socket), "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--dir", str(self.directory),
            "--protected-mode", "yes", "--logfile", str(self.log),
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = self.client()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited: {self.log.read_text(errors='replace')}")
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()
        return self

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10)

    def kill(self) -> None:
        """SIGKILL, as a crashed or unplugged server (its data is gone: no persistence)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing answers (timeouts)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Kill and start again: the server comes back empty."""
        self.kill()
        self.start()

    def reset(self) -> None:
        """Empty, unbounded, default eviction policy (between tests)."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            self.start()
        client = self.client()
        client.flushall()
        client.config_set("maxmemory", "0")
        client.config_set("maxmemory-policy", "noeviction")
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
