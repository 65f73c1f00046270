"""A real ``skippy-llama serve`` (or ``python -m llama_cpp.server``) process on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

THREADS = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """Start a server command, wait until ``/v1/models`` answers, stop it with SIGINT."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        log: Path,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log
        self.api_key = api_key
        self._log = log.open("wb")
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=environ)

    @classmethod
    def skippy(
        cls, model: Path, log: Path, *flags: str, api_key: str | None = None
    ) -> ServerProcess:
        port = free_port()
        argv = [sys.executable, "-m", "skippy_llama.cli.main", "serve", "--model", str(model)]
        argv += ["--port", str(port), "--threads", str(THREADS), "--log-level", "warning"]
        if api_key:
            argv += ["--api-key", api_key]
        return cls([*argv, *flags], port, log, api_key)

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                req = urllib.request.Request(self.base + "/v1/models", headers=headers)
                with urllib.request.urlopen(req, timeout=5):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 60.0) -> int:
        """SIGINT (uvicorn's graceful shutdown, which runs the app's lifespan exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
