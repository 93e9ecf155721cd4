"""The split as the service runs it, for tests: a model side and its front end, two real
processes on one socket."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tests.support.server_process import ServerProcess, children_of, run_server
from tests.support.tiny_models import simulated_entry, write_models_file

FRONT_END = ("front-end",)


@contextmanager
def split(folder: Path, env: dict[str, str]) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """The model side, then its front end, both ready; the front end's /ready is the model
    side's, forwarded."""
    socket = {"SPLIT_SOCKET": str(folder / "model.sock"), **env}
    with run_server(socket, folder) as model_side:
        model_side.wait_ready()
        with run_server(socket, folder, FRONT_END) as front_end:
            front_end.wait_ready()
            yield model_side, front_end


@contextmanager
def split_replicas(folders: list[Path], env: dict[str, str]) -> Iterator[list[ServerProcess]]:
    """One `loraserve` with SPLIT_FRONT_END=true in each of `folders`, as a container runs
    it: the model side, its front end a child on the replica's port (the URL's); all started
    at once, then all ready. Afterwards each is stopped (SIGTERM, then SIGKILL) and its front
    end is gone, however the test ended."""
    with ExitStack() as stack:
        front_ends = [set[int]() for _ in folders]
        replicas = [
            stack.enter_context(_split_replica(folder, env, pids))
            for folder, pids in zip(folders, front_ends, strict=True)
        ]
        for replica, pids in zip(replicas, front_ends, strict=True):
            replica.wait_ready()
            pids.update(children_of(replica.process.pid))  # its front end answered: it runs
        yield replicas


@contextmanager
def _split_replica(
    folder: Path, env: dict[str, str], front_ends: set[int]
) -> Iterator[ServerProcess]:
    """A started replica; afterwards it and `front_ends` (its front end's pid, once known)
    are gone."""
    folder.mkdir(parents=True, exist_ok=True)
    with run_server({**env, "SPLIT_FRONT_END": "true"}, folder) as replica:
        try:
            yield replica
        finally:
            if replica.process.poll() is None:
                front_ends.update(children_of(replica.process.pid))
                try:
                    replica.stop(timeout=30)
                except subprocess.TimeoutExpired:
                    replica.process.kill()
                    replica.process.wait(timeout=10)
            for pid in front_ends:
                _end_front_end(pid)


def _end_front_end(pid: int) -> None:
    """A front end whose parent has gone ends on its own (its parent-death signal); one
    still there after 10 s is killed."""
    deadline = time.monotonic() + 10
    while _front_end_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _front_end_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _front_end_alive(pid: int) -> bool:
    """`pid` is still a front end (not another process since given the number) and not a
    zombie."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"api.cli" in command and b"front-end" in command and state != "Z"


def simulated_split_env(folder: Path, seconds_per_batch: float) -> dict[str, str]:
    cost = {"seconds_per_batch": seconds_per_batch, "seconds_per_token": 0.0}
    entry = simulated_entry(simulated=cost)
    return {
        "MODELS_FILE": str(write_models_file(folder / "models.yaml", [entry])),
        "DISK_CACHE_DIR": str(folder / "cache"),
        "ADMISSION_CONTROL": "false",
    }
