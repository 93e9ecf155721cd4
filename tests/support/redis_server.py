"""A real `redis-server` (Debian's package) on a loopback port, for the shared cache tier."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from tests.support.server_process import free_port

INSTALL = "apt-get install -y redis-server  (`make test` does it)"


@dataclass
class RedisServer:
    """One redis-server with no persistence; it can be stopped, frozen and started again on
    the same port, as an outage looks to the service."""

    folder: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain client for the test's own reads (bytes values)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(f"redis-server is not installed; install it with: {INSTALL}")
        log = (self.folder / f"redis-{self.port}.log").open("ab")
        self.process = subprocess.Popen(
            [
                binary,
                *("--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", str(self.folder)),
                *("--loglevel", "warning"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                assert self.process.poll() is None, "redis-server exited at start"
                assert time.monotonic() < deadline, "redis-server not answering after 10 s"
                time.sleep(0.02)

    def kill(self) -> None:
        """Stops it at once, as a crash does: every connection drops, the data is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def freeze(self) -> None:
        """SIGSTOP: it holds its connections and answers nothing, as a stuck server does."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
