"""Faults on the real server process: shutdown under load, disconnects, deadlines, full queues."""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess, run_server

# ~120 tokens each: a request of 32 of them keeps the embedded model busy for a while.
LONG = "urgent call now to claim your free prize winner txt stop to end " * 8
_sent = itertools.count()


def heavy() -> dict[str, object]:
    """32 long texts no other request carries (identical texts in flight run only once)."""
    request = next(_sent)
    return {"inputs": [f"{request} {LONG} {i}" for i in range(32)], "cache": False}


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include the given ones."""
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def embedded(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    env = {"DISK_CACHE_MAX_BYTES": "0", "LRU_CACHE_ENTRIES": "0", **getattr(request, "param", {})}
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        yield server


def heavy_requests(
    server: ServerProcess, count: int, pool: ThreadPoolExecutor
) -> list[Future[httpx.Response]]:
    return [
        pool.submit(httpx.post, f"{server.url}/predict", json=heavy(), timeout=60)
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    "embedded", [{"DRAIN_SECONDS": "20", "REQUEST_TIMEOUT_SECONDS": "30"}], indirect=True
)
def test_sigterm_under_load_drains_accepted_requests_and_exits_0(
    embedded: ServerProcess,
) -> None:
    with ThreadPoolExecutor(max_workers=6) as pool:
        accepted = heavy_requests(embedded, 6, pool)
        time.sleep(0.5)  # all six are in, most still queued behind one batch at a time
        signalled = time.monotonic()
        embedded.process.send_signal(signal.SIGTERM)
        ready = httpx.get(f"{embedded.url}/ready", timeout=5)
        refused = httpx.post(f"{embedded.url}/predict", json={"inputs": "hi"}, timeout=5)
        statuses = [future.result().status_code for future in accepted]
    code = embedded.process.wait(timeout=30)
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert statuses == [200] * 6
    assert code == 0
    assert time.monotonic() - signalled < 20 + 5


@pytest.mark.parametrize("embedded", [{"DRAIN_SECONDS": "1"}], indirect=True)
def test_drain_time_bounds_the_shutdown(embedded: ServerProcess) -> None:
    with ThreadPoolExecutor(max_workers=40) as pool:
        pending = heavy_requests(embedded, 40, pool)  # far more work than one second
        time.sleep(0.5)
        signalled = time.monotonic()
        embedded.process.send_signal(signal.SIGTERM)
        code = embedded.process.wait(timeout=30)
        elapsed = time.monotonic() - signalled
        for future in pending:
            future.exception()  # those cut off fail on the client; none may hang
    assert code == 0
    assert elapsed < 1 + 5


def test_client_that_disconnects_while_queued_is_not_computed_for(
    embedded: ServerProcess,
) -> None:
    with ThreadPoolExecutor(max_workers=6) as pool:
        busy = heavy_requests(embedded, 6, pool)
        time.sleep(0.3)
        gone = {"inputs": ["a text nobody will wait for"], "cache": False}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{embedded.url}/predict", json=gone, timeout=0.2)
        assert all(future.result().status_code == 200 for future in busy)
    deadline = time.monotonic() + 10
    while metric(embedded, "loraserve_batch_dropped_total", reason="cancelled") < 1:
        assert time.monotonic() < deadline, "the abandoned text was computed"
        time.sleep(0.1)
    assert metric(embedded, "loraserve_predictions_total") == 6 * 32


@pytest.mark.parametrize("embedded", [{"REQUEST_TIMEOUT_SECONDS": "0.3"}], indirect=True)
def test_request_past_its_deadline_gets_504_and_is_not_run(embedded: ServerProcess) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        busy = heavy_requests(embedded, 8, pool)
        time.sleep(0.2)
        late = httpx.post(
            f"{embedded.url}/predict", json={"inputs": "late text", "cache": False}, timeout=10
        )
        for future in busy:
            future.result()
    assert late.status_code == 504
    assert late.json()["error"]["code"] == "deadline_exceeded"
    assert metric(embedded, "loraserve_rejections_total", reason="deadline") >= 1


@pytest.mark.parametrize("embedded", [{"MAX_QUEUE_SIZE": "2"}], indirect=True)
def test_full_queue_answers_429_with_retry_after(embedded: ServerProcess) -> None:
    with ThreadPoolExecutor(max_workers=10) as pool:
        responses = [future.result() for future in heavy_requests(embedded, 10, pool)]
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    for response in responses:
        if response.status_code == 429:
            assert response.headers["Retry-After"] == "1"
            assert response.json()["error"]["code"] == "overloaded"
    # Nothing half-done: after the burst, the service answers normally.
    assert httpx.post(f"{embedded.url}/predict", json={"inputs": "hi"}).status_code == 200
