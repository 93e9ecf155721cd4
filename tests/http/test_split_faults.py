"""The split under faults: the socket is one model side's own (a second is refused at its
start, a model side removes only its own socket), it is 0600 and answers only its own user,
a draining front end is not ready, and a front end dies with the process that started it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from api.http.split.messages import PROTOCOL_VERSION, Hello, framed
from api.http.split.model_side import ModelSide
from api.http.split.socket_claim import SocketClaim, SocketInUse
from api.service.core import Service
from tests.support.in_process import make_settings, spec_for
from tests.support.server_process import children_of, run_server
from tests.support.split import simulated_split_env, split
from tests.support.tiny_models import TinyModel


def steady_load(url: str, stop: threading.Event, statuses: list[int]) -> threading.Thread:
    """A client posting one text after another to `url` until `stop`, each status kept."""

    def run() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                statuses.append(client.post(url, json={"inputs": "hello there"}).status_code)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_second_model_side_on_a_live_socket_exits_naming_it_and_the_first_serves_on(
    tmp_path: Path,
) -> None:
    env = simulated_split_env(tmp_path, 0.0)
    socket_path = tmp_path / "model.sock"
    with split(tmp_path, env) as (model_side, front_end):
        inode = socket_path.stat().st_ino
        stop, statuses = threading.Event(), list[int]()
        load = steady_load(f"{front_end.url}/predict", stop, statuses)
        try:
            second_folder = tmp_path / "second"
            second_folder.mkdir()
            with run_server({"SPLIT_SOCKET": str(socket_path), **env}, second_folder) as second:
                assert second.process.wait(timeout=120) == 2
            answered_then = len(statuses)
            while len(statuses) < answered_then + 20 and load.is_alive():
                time.sleep(0.05)
        finally:
            stop.set()
            load.join(timeout=60)
        log = second.log()
        assert f"SPLIT_SOCKET {socket_path} is held by process {model_side.process.pid}" in log
        assert statuses and set(statuses) == {200}, statuses
        assert socket_path.stat().st_ino == inode
        with httpx.Client(base_url=front_end.url, timeout=30) as client:
            assert client.post("/predict", json={"inputs": "after"}).status_code == 200


def test_a_claim_removes_only_the_socket_it_bound(tmp_path: Path) -> None:
    path = tmp_path / "model.sock"
    claim = SocketClaim(path)
    listening = claim.bind()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(SocketInUse, match=f"held by process {os.getpid()}"):
        SocketClaim(path)
    # Someone else's socket now lies at the path (the operator's, a process with no claim).
    path.unlink()
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(path))
    try:
        claim.release()
        assert path.exists(), "a claim removed a socket it had not bound"
        SocketClaim(path).release()  # the lock went with the claim
    finally:
        listening.close()
        other.close()


def test_a_stale_socket_left_by_a_process_that_died_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "model.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: as after a SIGKILL
    claim = SocketClaim(path)
    listening = claim.bind()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
    finally:
        listening.close()
        claim.release()
    assert not path.exists()


async def test_a_front_end_of_another_user_is_refused_and_logged_once(
    tiny_bert: TinyModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """This process's peer is itself: a model side that runs as another user (its uid set so)
    must close the connection before reading a message, and say so once."""
    path = tmp_path / "model.sock"
    service = Service(make_settings(), [spec_for(tiny_bert)])  # not started: nothing loads
    model_side = ModelSide(FastAPI(), service, path)
    model_side.uid = os.getuid() + 1
    await model_side.start()
    try:
        with caplog.at_level(logging.ERROR):
            for _ in range(2):
                reader, writer = await asyncio.open_unix_connection(str(path))
                writer.write(framed([Hello(PROTOCOL_VERSION)]))
                # Closed unanswered: at its end, or reset with the Hello unread.
                with contextlib.suppress(ConnectionResetError):
                    assert await asyncio.wait_for(reader.read(), timeout=10) == b""
                writer.close()
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1
        assert f"front end of user {os.getuid()} refused" in refusals[0].getMessage()
    finally:
        await model_side.close()
    assert not path.exists()


def test_a_draining_front_end_answers_503_on_ready_on_a_kept_alive_connection(
    tmp_path: Path,
) -> None:
    env = {**simulated_split_env(tmp_path, 1.5), "DRAIN_SECONDS": "10"}
    with split(tmp_path, env) as (_, front_end):
        with httpx.Client(base_url=front_end.url, timeout=30) as probe:
            assert probe.get("/ready").status_code == 200  # the connection is open now
            statuses: list[int] = []
            in_flight = threading.Thread(
                target=lambda: statuses.append(
                    httpx.post(
                        f"{front_end.url}/predict", json={"inputs": "x"}, timeout=30
                    ).status_code
                )
            )
            in_flight.start()
            time.sleep(0.4)  # its batch runs for 1.5 s
            front_end.process.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            ready = probe.get("/ready")
            oip_ready = probe.get("/v2/health/ready")
            in_flight.join(timeout=30)
        assert ready.status_code == 503 and ready.headers["retry-after"] == "5"
        assert ready.json()["error"]["message"] == "front end is draining"
        assert oip_ready.status_code == 503 and oip_ready.json() == {
            "error": "front end is draining"
        }
        assert statuses == [200]
        assert front_end.process.wait(timeout=30) == 0


def test_the_front_end_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    env = {**simulated_split_env(tmp_path, 0.0), "SPLIT_FRONT_END": "true"}
    with run_server(env, tmp_path) as service:
        service.wait_ready()
        (child,) = children_of(service.process.pid)
        service.process.send_signal(signal.SIGKILL)
        service.process.wait(timeout=30)
        port = int(service.url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and listening(port):
            time.sleep(0.1)
        assert not listening(port), "the front end's port is open 5 s after its parent died"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
            time.sleep(0.1)
        assert not Path(f"/proc/{child}").exists() or zombie(child)


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def zombie(pid: int) -> bool:
    """Exited, not yet reaped (its parent, init here, reaps it in its own time)."""
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
