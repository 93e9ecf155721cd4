"""Runs the real `loraserve` server process on a loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> list[int]:
    """The processes a process started, from the kernel's own list."""
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def free_port() -> int:
    """A port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ServerProcess:
    """A started server: its URL and process."""

    url: str
    process: subprocess.Popen[str]
    log_path: Path

    def log(self) -> str:
        """Everything the process has written so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, timeout: float = 300.0, probe: str = "/ready") -> list[int]:
        """Polls `probe` (/ready) until 200; returns every status seen on the way.

        The first start of the embedded default on a machine also converts the LLM's GGUF.
        """
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited {self.process.returncode}:\n{self.log()}")
            try:
                status = httpx.get(f"{self.url}{probe}", timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            seen.append(status)
            if status == 200:
                return seen
            time.sleep(0.05)
        raise TimeoutError(f"not ready after {timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)


@contextmanager
def run_server(
    env: dict[str, str], log_dir: Path, command: Sequence[str] = ()
) -> Iterator[ServerProcess]:
    """Starts `python -m api.cli` (with `command`, e.g. `front-end`) with the given settings;
    always stops it afterwards.

    A test's own models (MODELS_FILE) are pre-quantized into its folder; the embedded
    default's into the user's model cache, where its GGUF conversion is kept between runs.
    """
    port = free_port()
    own_models = {"MODEL_CACHE_DIR": str(log_dir / "model-cache")} if "MODELS_FILE" in env else {}
    full_env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port), **own_models, **env}
    log_path = log_dir / f"server-{port}.log"
    with log_path.open("w", encoding="utf-8") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "api.cli", *command],
            cwd=log_dir,
            env={**full_env, "PYTHONPATH": str(REPO_ROOT)},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
