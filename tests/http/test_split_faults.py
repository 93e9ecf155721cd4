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
import msgspec
import pytest
from fastapi import FastAPI

from api.batch.local import started_service
from api.http.split.front_end import MODEL_SIDE_HEALTH_SECONDS
from api.http.split.messages import (
    LENGTH,
    PROTOCOL_VERSION,
    Classify,
    Hello,
    Refused,
    framed,
    read_hello,
    read_replies,
)
from api.http.split.model_side import ModelSide
from api.http.split.remote import ModelSideLink
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


async def test_a_forward_the_front_end_cancels_stops_in_the_model_sides_app(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    """The model side's app answers a forwarded request through an in-process transport that
    tells it of no disconnect before the answer: the front end's Cancel alone stops it."""
    started, cancelled = asyncio.Event(), asyncio.Event()
    app = FastAPI()

    @app.post("/slow")
    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    path = tmp_path / "model.sock"
    service = Service(make_settings(), [spec_for(tiny_bert)])  # not started: nothing loads
    model_side = ModelSide(app, service, path)
    await model_side.start()
    link = ModelSideLink(path)
    try:
        call = asyncio.create_task(link.forward("POST", "/slow", b"", [], b""))
        await asyncio.wait_for(started.wait(), timeout=10)
        call.cancel()
        await asyncio.wait_for(cancelled.wait(), timeout=10)
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        await link.close()
        await model_side.close()


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


async def test_an_unreadable_call_is_refused_at_once_and_the_connection_serves_on(
    tiny_bert: TinyModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A call of another shape (a release apart) gets its refusal by number at once, logged
    once without its texts; a well-formed call on the same connection is still answered."""
    path = tmp_path / "model.sock"
    service = Service(make_settings(), [spec_for(tiny_bert)])  # not started: loading
    model_side = ModelSide(FastAPI(), service, path)
    await model_side.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(framed([Hello(PROTOCOL_VERSION)]))
        assert await read_hello(reader) == Hello(PROTOCOL_VERSION)
        secret = "a text nobody should see in a log"
        odd = ["classify", 7, "request-id", None, None, [secret], True]  # fields missing
        well_formed = Classify(8, "request-id", None, None, [secret], True, True, 5.0, {})
        with caplog.at_level(logging.ERROR):
            writer.write(frame_raw([odd, [*odd[:2], "x"], well_formed]))
            by_number: dict[int, object] = {}
            while not {7, 8} <= by_number.keys():  # the two may come in turns of their own
                for reply in await asyncio.wait_for(read_replies(reader), timeout=10):
                    by_number[reply.number] = reply
        assert isinstance(by_number[7], Refused) and by_number[7].code == "internal_error"
        assert "could not read the call" in by_number[7].message
        # Well formed, refused only because the service is still loading.
        assert isinstance(by_number[8], Refused) and by_number[8].code == "unavailable"
        logged = [r.getMessage() for r in caplog.records if "cannot read" in r.getMessage()]
        assert len(logged) == 1 and secret not in logged[0]
        writer.close()
    finally:
        await model_side.close()


async def test_a_front_end_of_another_protocol_version_is_told_and_let_go(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    path = tmp_path / "model.sock"
    service = Service(make_settings(), [spec_for(tiny_bert)])
    model_side = ModelSide(FastAPI(), service, path)
    await model_side.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(framed([Hello(PROTOCOL_VERSION + 1)]))
        assert await asyncio.wait_for(read_hello(reader), timeout=10) == Hello(PROTOCOL_VERSION)
        assert await asyncio.wait_for(reader.read(), timeout=10) == b""  # then closed
        writer.close()
    finally:
        await model_side.close()


def test_a_model_side_of_another_protocol_version_is_a_503_at_once(tmp_path: Path) -> None:
    """A front end meeting a model side of another release (as in a rolling update of
    separate containers) answers 503 naming both versions at once, never a 504 later."""
    path = tmp_path / "model.sock"
    ready = threading.Event()
    stop = threading.Event()

    def other_release() -> None:
        async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_hello(reader)
            writer.write(framed([Hello(PROTOCOL_VERSION + 1)]))
            await writer.drain()

        async def serve() -> None:
            server = await asyncio.start_unix_server(greet, str(path))
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            server.close()

        asyncio.run(serve())

    peer = threading.Thread(target=other_release)
    peer.start()
    try:
        assert ready.wait(10)
        env = {**simulated_split_env(tmp_path, 0.0), "SPLIT_SOCKET": str(path)}
        with run_server(env, tmp_path, ("front-end",)) as front_end:
            front_end.wait_ready(probe="/health")
            started = time.monotonic()
            answer = httpx.post(f"{front_end.url}/predict", json={"inputs": "x"}, timeout=30)
            assert time.monotonic() - started < 2
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        message = answer.json()["error"]["message"]
        assert f"version {PROTOCOL_VERSION + 1}, this front end {PROTOCOL_VERSION}" in message
    finally:
        stop.set()
        peer.join(timeout=10)


def test_a_model_side_that_stops_reading_costs_a_bounded_buffer_and_recovers(
    tmp_path: Path,
) -> None:
    """SIGSTOP: the model side reads nothing. The front end writes calls until its buffer
    passes the bound, then refuses new ones 503 at once; SIGCONT and it serves again."""
    env = {**simulated_split_env(tmp_path, 0.0), "MAX_TEXT_CHARS": "20000"}
    texts = ["x" * 20_000] * 32  # ~640 KB a call
    with split(tmp_path, env) as (model_side, front_end):
        url = f"{front_end.url}/predict"
        body = {"inputs": texts, "cache": False}
        short = {"X-Request-Timeout": "1"}
        assert httpx.post(url, json=body, timeout=30).status_code == 200
        model_side.process.send_signal(signal.SIGSTOP)
        try:
            refused = None
            with httpx.Client(timeout=30) as client:
                for _ in range(40):  # 25 MB in all, past the kernel's buffer and the bound
                    answer = client.post(url, json=body, headers=short)
                    if answer.status_code == 503:
                        refused = answer
                        break
                    assert answer.status_code == 504, answer.text
            assert refused is not None, "the front end buffered every call"
            assert "not reading its calls" in refused.json()["error"]["message"]
        finally:
            model_side.process.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        status = 0
        while time.monotonic() < deadline and status != 200:
            status = httpx.post(url, json={"inputs": "after"}, timeout=30).status_code
            time.sleep(0.2)
        assert status == 200


def frame_raw(items: list[object]) -> bytes:
    """A message of any items at all, framed as the split frames its own."""
    body = msgspec.msgpack.encode(items)
    return LENGTH.pack(len(body)) + body


def test_a_wedged_model_side_fails_the_front_ends_health_within_its_bound(
    tmp_path: Path,
) -> None:
    """SIGSTOP: the model side is there but answers nothing. The front end's /health, the
    pod's liveness, fails within MODEL_SIDE_HEALTH_SECONDS; it passes again on SIGCONT."""
    env = simulated_split_env(tmp_path, 0.0)
    with split(tmp_path, env) as (model_side, front_end):
        health = f"{front_end.url}/health"
        assert httpx.get(health, timeout=30).status_code == 200
        model_side.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            wedged = httpx.get(health, timeout=30)
            waited = time.monotonic() - started
        finally:
            model_side.process.send_signal(signal.SIGCONT)
        assert wedged.status_code == 503, wedged.text
        assert "the model side's /health: no answer within 3 s" in wedged.json()["error"]["message"]
        assert MODEL_SIDE_HEALTH_SECONDS <= waited < MODEL_SIDE_HEALTH_SECONDS + 2
        assert httpx.get(health, timeout=30).status_code == 200


async def test_calls_over_the_socket_meet_the_limits_http_requests_meet(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    """Whoever opens the socket skips the front end's checks: the core checks the limits
    itself, so a call of too many texts, or of a text too long, is refused as over HTTP."""
    path = tmp_path / "model.sock"
    settings = make_settings(max_texts_per_request=4, max_text_chars=50)
    async with started_service(settings, [spec_for(tiny_bert)]) as service:
        model_side = ModelSide(FastAPI(), service, path)
        await model_side.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
            writer.write(framed([Hello(PROTOCOL_VERSION)]))
            await read_hello(reader)
            calls = [
                Classify(1, "id", None, None, ["one text"] * 5, True, True, 5.0, {}),
                Classify(2, "id", None, None, ["x" * 51], True, True, 5.0, {}),
                Classify(3, "id", None, None, ["one text"], True, True, 5.0, {}),
            ]
            writer.write(framed(calls))
            by_number: dict[int, object] = {}
            while len(by_number) < len(calls):
                for reply in await asyncio.wait_for(read_replies(reader), timeout=30):
                    by_number[reply.number] = reply
            writer.close()
        finally:
            await model_side.close()
    assert by_number[1] == Refused(1, "invalid_input", "5 texts in one request; at most 4", None)
    assert by_number[2] == Refused(
        2, "invalid_input", "inputs[0] has 51 characters; at most 50", None
    )
    assert not isinstance(by_number[3], Refused)
