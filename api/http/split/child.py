"""The split with one command (SPLIT_FRONT_END): `loraserve` runs the model side and starts
`loraserve front-end` as a child process on the clients' HOST and PORT, stops it first (its
requests in flight need the models to finish), and stops itself if the child dies."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# Past DRAIN_SECONDS, what the front end has for its own shutdown before it is killed.
STOP_GRACE_SECONDS = 5.0
# The pid of the process that started a front end as its child (the model side): the front
# end asks the kernel for a SIGTERM when that process ends, however it ends.
PARENT_PID_VARIABLE = "LORASERVE_SPLIT_PARENT_PID"
PR_SET_PDEATHSIG = 1  # prctl(2)


class FrontEndExited(RuntimeError):
    """The front end stopped while the service was serving: clients cannot reach it."""


class FrontEndProcess:
    """`loraserve front-end` on `socket_path`, its output this process's own."""

    def __init__(self, socket_path: Path, drain_seconds: float) -> None:
        self.socket_path = socket_path
        self.drain_seconds = drain_seconds
        self.process: subprocess.Popen[bytes] | None = None
        self.kill_at: float | None = None  # set once it has been told to stop

    @property
    def stopping(self) -> bool:
        return self.kill_at is not None

    def start(self) -> None:
        env = {
            **os.environ,
            "SPLIT_SOCKET": str(self.socket_path),
            "SPLIT_FRONT_END": "false",
            PARENT_PID_VARIABLE: str(os.getpid()),
        }
        self.process = subprocess.Popen([sys.executable, "-m", "api.cli", "front-end"], env=env)
        logger.info("front end started (pid %d)", self.process.pid)

    def exit_code(self) -> int | None:
        """None while it runs."""
        assert self.process is not None
        return self.process.poll()

    def kill_if_overdue(self) -> None:
        """Kills it once it has overrun the time it was given to stop."""
        overdue = self.kill_at is not None and time.monotonic() > self.kill_at
        if overdue and self.exit_code() is None:
            waited = self.drain_seconds + STOP_GRACE_SECONDS
            logger.warning("front end still running %g s after SIGTERM: killed", waited)
            self.kill_now()

    def stop(self) -> None:
        """SIGTERM: the front end drains (at most DRAIN_SECONDS), then exits."""
        if self.process is not None and self.process.poll() is None and self.kill_at is None:
            self.kill_at = time.monotonic() + self.drain_seconds + STOP_GRACE_SECONDS
            self.process.send_signal(signal.SIGTERM)

    def kill_now(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    def close(self) -> None:
        """Stopped, whatever it is doing, once this process is done."""
        if self.process is None or self.process.poll() is not None:
            return
        self.stop()
        try:
            self.process.wait(timeout=self.drain_seconds + STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def die_with_parent() -> bool:
    """In a front end started by `FrontEndProcess`: a SIGTERM from the kernel once the parent
    ends, even by SIGKILL, so no front end outlives its models (Linux's PR_SET_PDEATHSIG; the
    parent's main thread started it and lives as long as the parent). False when the parent
    has already gone: the caller stops at once."""
    parent = os.environ.get(PARENT_PID_VARIABLE)
    if parent is None:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        logger.warning("no parent-death signal: %s", os.strerror(ctypes.get_errno()))
    return os.getppid() == int(parent)  # checked after: a parent gone before it is seen here
