"""The split with one command (SPLIT_FRONT_END): `loraserve` runs the model side and starts
FRONT_ENDS `loraserve front-end` processes as its children on the clients' HOST and PORT,
stops them first (their requests in flight need the models to finish), and stops itself if
one dies.

The port is bound here, before any child starts: one listening socket a front end, all in
one SO_REUSEPORT group, so the kernel spreads the clients' connections evenly over the front
ends (one socket shared by all would let whichever woke first accept a burst of connections
alone). A port another process holds fails the start at once, whether or not that process
asked for SO_REUSEPORT, since this process first binds it without.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
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
# The listening socket a front end started here inherits, by its file descriptor.
LISTEN_FD_VARIABLE = "LORASERVE_LISTEN_FD"
# prometheus_client's own: with several front ends, each keeps its metrics' values in files in
# this folder, and any one of them answers /metrics with every front end's requests.
METRICS_FOLDER_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
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

    def start(self, listening: socket.socket, metrics_folder: Path | None) -> None:
        """Started on `listening` (HOST:PORT, bound here), keeping its metrics' values in
        `metrics_folder` where several front ends answer together."""
        env = {
            **os.environ,
            "SPLIT_SOCKET": str(self.socket_path),
            "SPLIT_FRONT_END": "false",
            "FRONT_ENDS": "1",
            PARENT_PID_VARIABLE: str(os.getpid()),
            LISTEN_FD_VARIABLE: str(listening.fileno()),
        }
        env.pop(METRICS_FOLDER_VARIABLE, None)
        if metrics_folder is not None:
            env[METRICS_FOLDER_VARIABLE] = str(metrics_folder)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "front-end"], env=env, pass_fds=[listening.fileno()]
        )
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


class FrontEnds:
    """`count` front ends on `socket_path`, answering HOST:PORT together. The port is bound
    at construction (OSError where it cannot be); `start` hands it to the front ends."""

    def __init__(
        self,
        socket_path: Path,
        drain_seconds: float,
        address: tuple[str, int],
        count: int,
        metrics_folder: Path,
    ) -> None:
        self.processes = [FrontEndProcess(socket_path, drain_seconds) for _ in range(count)]
        self.listening = listen_together(address, count)
        self.metrics_folder = metrics_folder if count > 1 else None

    @property
    def stopping(self) -> bool:
        return any(front_end.stopping for front_end in self.processes)

    def start(self) -> None:
        """Every front end, each on its socket; this process then closes its own copies, so
        that the port closes once the front ends have gone."""
        if self.metrics_folder is not None:
            self.metrics_folder.mkdir(mode=0o700)
        for front_end, listening in zip(self.processes, self.listening, strict=True):
            front_end.start(listening, self.metrics_folder)
        for listening in self.listening:
            listening.close()

    def exited(self) -> int | None:
        """The exit code of a front end that has stopped; None while every one runs."""
        for front_end in self.processes:
            code = front_end.exit_code()
            if code is not None:
                return code
        return None

    def all_exited(self) -> bool:
        return all(front_end.exit_code() is not None for front_end in self.processes)

    def kill_if_overdue(self) -> None:
        for front_end in self.processes:
            front_end.kill_if_overdue()

    def stop(self) -> None:
        """SIGTERM to each: they drain together."""
        for front_end in self.processes:
            front_end.stop()

    def kill_now(self) -> None:
        for front_end in self.processes:
            front_end.kill_now()

    def close(self) -> None:
        """Every one stopped, whatever it is doing, once this process is done."""
        for listening in self.listening:
            listening.close()  # where the front ends never started
        self.stop()
        for front_end in self.processes:
            front_end.close()


def listen_together(address: tuple[str, int], count: int) -> list[socket.socket]:
    """`count` sockets listening on `address` in one SO_REUSEPORT group, after a bind
    without SO_REUSEPORT has found the port free: a port held by anyone else, even by a
    group of this user's that would let these join it, raises OSError."""
    host = address[0]
    # As uvicorn binds HOST: a name (localhost) is taken as IPv4, an IPv6 address as IPv6.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            listening = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(listening)
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            listening.bind(address)
            listening.listen(socket.SOMAXCONN)
    except OSError:
        for listening in sockets:
            listening.close()
        raise
    return sockets


def inherited_listening_socket() -> socket.socket | None:
    """In a front end started by `FrontEnds`: the socket it answers HOST:PORT on."""
    fd = os.environ.get(LISTEN_FD_VARIABLE)
    return None if fd is None else socket.socket(fileno=int(fd))


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
