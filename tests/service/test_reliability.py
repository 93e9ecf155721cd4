"""RELIABILITY.md's answers, shown on the real server process on loopback.

Each row, on the real process (the in-process checks are in test_app, test_cache,
test_batching, test_loader and test_auth; rows fully shown there are not repeated here):

- not loaded yet / draining → 503 + Retry-After: test_503_while_loading_then_sigterm_...
- queue full → 429 + Retry-After, nothing half-done: test_full_queue_answers_429_...
- past its deadline → 504, dropped unrun: test_request_past_its_deadline_...
- invalid UTF-8 / lone surrogates → 400/422: test_bad_unicode_is_a_client_error
- body over the limit, also chunked → 413: test_chunked_body_over_the_limit_...
- client disconnects while queued → not run: test_client_that_disconnects_...
- SIGTERM under load → drain, exit 0 in time: test_503_while_loading_then_sigterm_...,
  test_drain_time_bounds_the_shutdown
- damaged checkpoints → start-up fails naming model, file, reason: test_damaged_checkpoint_...
- a fatal device error → /ready 503, exit non-zero: test_a_fatal_device_error_...
- cache faults → answered from the model, counted: test_disk_cache_faults_...

"Not run" is read from the server's own accounting: `loraserve_batch_size_sum` counts every
text a forward pass ran, `loraserve_batch_dropped_total` every text dropped unrun.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import diskcache
import httpx
import pytest
from safetensors.torch import load_file, save_file

from api.http.classifying import WATCH_AFTER_SECONDS
from tests.support.in_process import SETTING_NAMES, wait_for
from tests.support.load_client import metric
from tests.support.server_process import ServerProcess, run_server
from tests.support.tiny_models import (
    TinyModel,
    embedded_encoder_file,
    faulty_bert,
    tiny_models_file,
)

# ~120 tokens each: a request of 32 of them keeps the embedded model busy for a while.
LONG = "urgent call now to claim your free prize winner txt stop to end " * 8
HEAVY_ROWS = 32
_sent = itertools.count()

# --- helpers ---


def heavy() -> dict[str, object]:
    """32 long texts no other request carries (identical texts in flight run only once)."""
    request = next(_sent)
    return {"inputs": [f"{request} {LONG} {i}" for i in range(HEAVY_ROWS)], "cache": False}


def heavy_requests(
    server: ServerProcess, count: int, pool: ThreadPoolExecutor
) -> list[Future[httpx.Response]]:
    return [
        pool.submit(httpx.post, f"{server.url}/predict", json=heavy(), timeout=120)
        for _ in range(count)
    ]


def rows_run(server: ServerProcess) -> float:
    """Texts that went through a forward pass (batch sizes summed)."""
    return metric(server.url, "loraserve_batch_size_sum")


def rows_dropped(server: ServerProcess, reason: str | None = None) -> float:
    labels = {} if reason is None else {"reason": reason}
    return metric(server.url, "loraserve_batch_dropped_total", **labels)


def wait_in_flight(server: ServerProcess, requests: int) -> None:
    """Until the server is handling at least `requests` requests besides the scrape that
    asks: they are in (a fixed sleep is not enough where a loaded host starts the client
    threads late)."""
    wait_for(
        lambda: metric(server.url, "loraserve_requests_in_flight") >= requests + 1,
        30,
        f"{requests} requests in flight",
    )


def wait_all_accounted(server: ServerProcess, submitted: int) -> None:
    """Until each text submitted has been run or dropped: the queue has emptied."""
    wait_for(
        lambda: rows_run(server) + rows_dropped(server) >= submitted,
        30,
        f"{submitted} texts run or dropped",
    )


@contextmanager
def clean_environment() -> Iterator[None]:
    """No service settings from the caller's environment (for servers that outlive a test)."""
    with pytest.MonkeyPatch.context() as patch:
        for key in list(os.environ):
            if key in SETTING_NAMES or key.endswith("_ADAPTER_DIR"):
                patch.delenv(key)
        yield


def raw_http(url: str, head: str, body: Iterable[bytes] = (), wait: float = 10.0) -> int:
    """Sends a request byte for byte on a fresh socket; the answer's status code.

    The server may answer and close before the body is all sent (a 413 does): the rest is
    then not sent, and the answer is read all the same.
    """
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=wait) as sock:
        try:
            sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
            for chunk in body:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        while b"\r\n" not in answer:
            data = sock.recv(4096)
            assert data, f"connection closed without an answer: {answer!r}"
            answer += data
    return int(answer.split(b" ", 2)[1])


def chunked(body: bytes, size: int) -> Iterator[bytes]:
    """`body` in Transfer-Encoding: chunked pieces, without the closing chunk."""
    for start in range(0, len(body), size):
        piece = body[start : start + size]
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"


# --- fixtures ---


@pytest.fixture
def embedded(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """The embedded encoder (big enough to keep busy), caches off, ready. Admission by time
    is off: these tests queue more work than the latency target allows, on purpose, to see
    what queued requests meet (deadlines, disconnects, a full queue)."""
    env = {
        "ADMISSION_CONTROL": "false",
        "MODELS_FILE": str(embedded_encoder_file(tmp_path)),
        "DISK_CACHE_MAX_BYTES": "0",
        "LRU_CACHE_ENTRIES": "0",
        "DISK_CACHE_DIR": str(tmp_path / "cache"),
        **getattr(request, "param", {}),
    }
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        yield server


MAX_BODY_BYTES = 2048


@pytest.fixture(scope="module")
def tiny_server(
    tiny_bert: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A tiny model with a 2 KiB body limit, shared by the module's quick input checks."""
    folder = tmp_path_factory.mktemp("tiny-server")
    env = {
        "MODELS_FILE": str(tiny_models_file(folder, tiny_bert, adapters=("spam",))),
        "MAX_BODY_BYTES": str(MAX_BODY_BYTES),
        "DISK_CACHE_MAX_BYTES": "0",
    }
    with ExitStack() as stack:
        with clean_environment():
            server = stack.enter_context(run_server(env, folder))
        server.wait_ready()
        yield server


def answers_until_ready(server: ServerProcess) -> list[tuple[int, int]]:
    """/predict and /ready from the moment the port opens until /predict answers 200.

    Before that, each /predict must be 503 + Retry-After, and /ready too while loading.
    Returns the (/predict, /ready) statuses seen.
    """
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            predict = httpx.post(f"{server.url}/predict", json={"inputs": "hi"}, timeout=10)
            ready = httpx.get(f"{server.url}/ready", timeout=10)
        except httpx.TransportError:  # the port is not open yet
            time.sleep(0.01)
            continue
        seen.append((predict.status_code, ready.status_code))
        if predict.status_code == 200:
            break
        assert predict.status_code == 503, predict.text
        assert predict.json()["error"]["code"] == "unavailable"
        assert predict.headers["Retry-After"]
        if ready.status_code == 503:  # it may have turned 200 since /predict answered
            assert ready.json()["status"] == "loading" and ready.headers["Retry-After"]
    return seen


# --- bad input on the wire ---


BAD_UNICODE = {
    "invalid UTF-8 byte": b'{"inputs": "\xff\xfe"}',
    "invalid continuation byte": b'{"inputs": ["ok", "\xc3\x28"]}',
    "overlong encoding": b'{"inputs": "\xc0\xaf"}',
    "UTF-8 encoded surrogate": b'{"inputs": "\xed\xa0\x80"}',
    "escaped lone surrogate": b'{"inputs": "\\ud800"}',
    "escaped lone low surrogate in a list": b'{"inputs": ["ok", "\\udfff"]}',
    "lone surrogate in the model name": b'{"inputs": "x", "model": "\\ud800"}',
    "lone surrogate as an unknown key": b'{"inputs": "x", "\\udc00": 1}',
    "invalid UTF-8 in a key": b'{"\xff": 1}',
}


@pytest.mark.parametrize("body", list(BAD_UNICODE.values()), ids=list(BAD_UNICODE))
def test_bad_unicode_is_a_client_error(tiny_server: ServerProcess, body: bytes) -> None:
    response = httpx.post(
        f"{tiny_server.url}/predict",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code in (400, 422), response.text
    assert response.json()["error"]["code"] in ("bad_request", "http_400", "invalid_input")
    assert len(response.content) < 500


def test_valid_surrogate_pair_and_nul_are_served(tiny_server: ServerProcess) -> None:
    """The control: escaped characters that are valid Unicode are answered."""
    response = httpx.post(
        f"{tiny_server.url}/predict",
        content=b'{"inputs": ["\\ud83d\\ude00 win", "a\\u0000b"]}',
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 200, response.text


CHUNKED_HEAD = """POST /predict HTTP/1.1
Host: loopback
Content-Type: application/json
Transfer-Encoding: chunked
"""


def test_chunked_body_over_the_limit_is_413_without_waiting_for_its_end(
    tiny_server: ServerProcess,
) -> None:
    big = b'{"inputs": "' + b"a" * (2 * MAX_BODY_BYTES) + b'"}'
    # No closing chunk: an answer that waited for the end of the body would never come.
    assert raw_http(tiny_server.url, CHUNKED_HEAD, chunked(big, 256)) == 413
    declared = f"POST /predict HTTP/1.1\nHost: loopback\nContent-Length: {len(big)}\n"
    assert raw_http(tiny_server.url, declared, [big]) == 413
    # The control: a chunked body under the limit is read whole and answered.
    small = b'{"inputs": "win a free prize"}'
    assert raw_http(tiny_server.url, CHUNKED_HEAD, [*chunked(small, 8), b"0\r\n\r\n"]) == 200
    assert metric(tiny_server.url, "loraserve_rejections_total", reason="too_large") == 2


# --- the queue: disconnects, deadlines, a full queue ---


@pytest.mark.parametrize("embedded", [{"REQUEST_TIMEOUT_SECONDS": "120"}], indirect=True)
# Gone before its disconnect is watched for, and after: either way, dropped unrun.
@pytest.mark.parametrize("gives_up_after", [WATCH_AFTER_SECONDS / 2, WATCH_AFTER_SECONDS * 2])
def test_client_that_disconnects_while_queued_is_not_computed_for(
    embedded: ServerProcess, gives_up_after: float
) -> None:
    with ThreadPoolExecutor(max_workers=6) as pool:
        busy = heavy_requests(embedded, 6, pool)
        time.sleep(0.3)
        # As long as the heavy texts: a short one would fit in a gap of a batch of them
        # (packed batches fill up to MAX_BATCH_TOKENS) and run before it could be abandoned.
        gone = {"inputs": [f"a text nobody will wait for {LONG}"], "cache": False}
        with pytest.raises(httpx.ReadTimeout):  # httpx then closes the connection
            httpx.post(f"{embedded.url}/predict", json=gone, timeout=gives_up_after)
        assert [f.result().status_code for f in busy] == [200] * 6
    submitted = 6 * HEAVY_ROWS + 1
    wait_all_accounted(embedded, submitted)
    assert rows_dropped(embedded, "cancelled") == 1, "the abandoned text was not dropped"
    assert rows_run(embedded) == submitted - 1, "the abandoned text was computed"


BLOCKER_ROWS = 256
DEADLINE = {
    "REQUEST_TIMEOUT_SECONDS": "0.5",
    # One request of 256 long texts in one batch: the model is busy for seconds.
    "MAX_TEXTS_PER_REQUEST": str(BLOCKER_ROWS),
    "MAX_BATCH_SIZE": str(BLOCKER_ROWS),
    "MAX_BATCH_TOKENS": str(BLOCKER_ROWS * 128),
}


@pytest.mark.parametrize("embedded", [DEADLINE], indirect=True)
def test_request_past_its_deadline_gets_504_and_is_not_run(embedded: ServerProcess) -> None:
    blocker = {"inputs": [f"{i} {LONG}" for i in range(BLOCKER_ROWS)], "cache": False}
    with ThreadPoolExecutor(max_workers=1) as pool:
        busy = pool.submit(httpx.post, f"{embedded.url}/predict", json=blocker, timeout=120)
        time.sleep(1.0)  # its batch has started, and runs for seconds more
        started = time.monotonic()
        late = httpx.post(
            f"{embedded.url}/predict", json={"inputs": "late text", "cache": False}, timeout=30
        )
        waited = time.monotonic() - started
        assert busy.result().status_code == 504  # its rows run all the same: they had begun
    assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded"
    assert waited < 0.5 + 1.0, f"the 504 came after {waited:.2f} s, not at the deadline"
    wait_all_accounted(embedded, BLOCKER_ROWS + 1)
    assert rows_dropped(embedded) == 1, "the late text was not dropped"
    assert rows_run(embedded) == BLOCKER_ROWS, "the late text was computed"
    assert metric(embedded.url, "loraserve_rejections_total", reason="deadline") == 2


REFUSAL_DELAY = 0.5


@pytest.mark.parametrize(
    "embedded",
    [{"MAX_QUEUE_SIZE": "2", "REFUSAL_DELAY_SECONDS": str(REFUSAL_DELAY)}],
    indirect=True,
)
def test_full_queue_answers_429_with_retry_after_and_leaves_nothing_half_done(
    embedded: ServerProcess,
) -> None:
    with ThreadPoolExecutor(max_workers=10) as pool:
        responses = [future.result() for future in heavy_requests(embedded, 10, pool)]
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429}, statuses
    for response in responses:
        if response.status_code == 429:
            assert response.headers["Retry-After"] == "1"
            assert response.json()["error"]["code"] == "overloaded"
            # Held, so that a client retrying at once cannot spin the server on refusals.
            assert response.elapsed.total_seconds() >= REFUSAL_DELAY, response.elapsed
    # Nothing half-done: exactly the accepted requests' texts ran; none of a refused one.
    accepted = statuses.count(200) * HEAVY_ROWS
    wait_all_accounted(embedded, accepted)
    assert rows_run(embedded) == accepted and rows_dropped(embedded) == 0
    assert metric(embedded.url, "loraserve_queue_depth") == 0
    assert httpx.post(f"{embedded.url}/predict", json={"inputs": "hi"}).status_code == 200


# --- shutdown ---


def test_503_while_loading_then_sigterm_under_load_drains_and_exits_0(tmp_path: Path) -> None:
    """The whole life: loading (503), ready, SIGTERM under load (503 at once, accepted
    requests finish, new ones refused), exit 0 within DRAIN_SECONDS, port closed."""
    env = {
        "ADMISSION_CONTROL": "false",  # every request under load is queued, then drained
        "DISK_CACHE_MAX_BYTES": "0",
        "LRU_CACHE_ENTRIES": "0",
        "DRAIN_SECONDS": "20",
        "REQUEST_TIMEOUT_SECONDS": "30",
    }
    with run_server(env, tmp_path) as server:
        seen = answers_until_ready(server)
        assert any(predict == 503 for predict, _ in seen), f"no loading phase seen: {seen}"
        assert seen[-1] == (200, 200), seen

        with ThreadPoolExecutor(max_workers=6) as pool:
            accepted = heavy_requests(server, 6, pool)
            wait_in_flight(server, 6)  # most still queued behind one batch at a time
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            ready = httpx.get(f"{server.url}/ready", timeout=5)
            ready_after = time.monotonic() - signalled
            refused = httpx.post(f"{server.url}/predict", json={"inputs": "hi"}, timeout=5)
            statuses = [future.result().status_code for future in accepted]
        code = server.process.wait(timeout=30)
        elapsed = time.monotonic() - signalled
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert ready.headers["Retry-After"]
        assert ready_after < 1.0, f"/ready took {ready_after:.2f} s to turn 503"
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert statuses == [200] * 6
        assert code == 0
        assert elapsed < 20 + 5
        assert "drained in" in server.log()  # every accepted request answered, not timed out
        with pytest.raises(httpx.ConnectError):  # once it has gone, nothing listens
            httpx.get(f"{server.url}/health", timeout=5)


@pytest.mark.parametrize("embedded", [{"DRAIN_SECONDS": "1"}], indirect=True)
def test_drain_time_bounds_the_shutdown(embedded: ServerProcess) -> None:
    with ThreadPoolExecutor(max_workers=40) as pool:
        pending = heavy_requests(embedded, 40, pool)  # far more work than one second
        wait_in_flight(embedded, 40)
        signalled = time.monotonic()
        embedded.process.send_signal(signal.SIGTERM)
        code = embedded.process.wait(timeout=30)
        elapsed = time.monotonic() - signalled
        responses = [future.result() for future in pending]  # none may hang or be cut off
    assert code == 0
    assert elapsed < 1 + 5
    log = embedded.log()
    assert "accepted requests unanswered" in log
    # Those the drain could not wait for are answered 503 with Retry-After, not cancelled
    # by the server's shutdown mid-wait (a 500 and a traceback in the log).
    statuses = Counter(response.status_code for response in responses)
    assert set(statuses) <= {200, 503} and statuses[503] > 0, statuses
    for response in responses:
        if response.status_code == 503:
            assert response.headers["Retry-After"] == "1"
            assert "DRAIN_SECONDS (1 s) ran out" in response.json()["error"]["message"]
    assert "Exception in ASGI application" not in log


# --- damaged checkpoints ---


@dataclass(frozen=True)
class Damage:
    """A way to damage a copy of the tiny model, and what start-up must then say."""

    name: str
    damage: Callable[[TinyModel, TinyModel, Path], TinyModel]
    file: str
    reason: str


def _copy_adapter(tiny: TinyModel, folder: Path) -> tuple[TinyModel, Path]:
    adapter = shutil.copytree(tiny.adapters["spam"], folder / "adapter")
    return TinyModel(base=tiny.base, adapters={"spam": adapter}), adapter


def corrupt_base_header(tiny: TinyModel, _: TinyModel, folder: Path) -> TinyModel:
    base = shutil.copytree(tiny.base, folder / "base")
    with (base / "model.safetensors").open("r+b") as weights:
        weights.seek(8)  # the JSON header, just past its length
        weights.write(b"\xff" * 16)
    return TinyModel(base=base, adapters=tiny.adapters)


def truncate_adapter(tiny: TinyModel, _: TinyModel, folder: Path) -> TinyModel:
    damaged, adapter = _copy_adapter(tiny, folder)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-500])
    return damaged


def break_adapter_config(tiny: TinyModel, _: TinyModel, folder: Path) -> TinyModel:
    damaged, adapter = _copy_adapter(tiny, folder)
    (adapter / "adapter_config.json").write_text("{not json", encoding="utf-8")
    return damaged


def adapter_of_another_base(tiny: TinyModel, other: TinyModel, _: Path) -> TinyModel:
    return TinyModel(base=tiny.base, adapters={"spam": other.adapters["spam"]})


def rename_adapter_keys(tiny: TinyModel, _: TinyModel, folder: Path) -> TinyModel:
    damaged, adapter = _copy_adapter(tiny, folder)
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({f"{key}.renamed": value for key, value in tensors.items()}, weights)
    return damaged


DAMAGES = (
    Damage("corrupt base header", corrupt_base_header, "model.safetensors", "corrupt"),
    Damage("truncated adapter", truncate_adapter, "adapter_model.safetensors", "truncated"),
    Damage("bad adapter config", break_adapter_config, "adapter_config.json", "bad adapter"),
    Damage(
        "adapter for another base",
        adapter_of_another_base,
        "adapter_model.safetensors",
        "does not fit",
    ),
    Damage(
        "adapter keys match nothing",
        rename_adapter_keys,
        "adapter_model.safetensors",
        "match nothing",
    ),
)


def test_damaged_checkpoint_fails_start_up_naming_model_file_and_reason(
    tiny_bert: TinyModel, tiny_llama: TinyModel, tmp_path: Path
) -> None:
    """Each damage in its own server process, all started at once (start-up is the cost)."""
    with ExitStack() as stack:
        servers: dict[str, ServerProcess] = {}
        for case in DAMAGES:
            folder = tmp_path / case.name.replace(" ", "-")
            folder.mkdir()
            damaged = case.damage(tiny_bert, tiny_llama, folder)
            models = tiny_models_file(folder, damaged, adapters=("spam",))
            servers[case.name] = stack.enter_context(
                run_server({"MODELS_FILE": str(models), "DISK_CACHE_MAX_BYTES": "0"}, folder)
            )
        failures = []
        for case in DAMAGES:
            server = servers[case.name]
            code = server.process.wait(timeout=120)
            log = server.log()
            said = [line for line in log.splitlines() if "start-up failed" in line]
            if not (
                code == 1
                and said
                and all(part in said[-1] for part in ("model 'tiny'", case.file, case.reason))
                and "ready:" not in log
            ):
                failures.append(f"{case.name}: exit {code}, said {said[-1:]}")
    assert not failures, "\n".join(failures)


# --- a fatal device error ---


def test_a_fatal_device_error_turns_ready_503_and_exits_non_zero(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    """A sticky CUDA error (a device-side assert, raised here by a test-only model code for
    one text: a CPU cannot fail so) fails its batch, turns /ready 503 with the reason, refuses
    new requests, and the process exits 3 once the requests in flight are done, for its
    supervisor to restart it."""
    faulty = faulty_bert(tiny_bert, tmp_path, "offer")
    models = tiny_models_file(tmp_path, faulty, adapters=("spam",), trust_remote_code=True)
    env = {
        "MODELS_FILE": str(models),
        "DISK_CACHE_MAX_BYTES": "0",
        "LRU_CACHE_ENTRIES": "0",
        "HF_HOME": str(tmp_path / "hf"),  # where transformers copies the model code
        "DRAIN_SECONDS": "60",  # the exit below must come from the drain's end, not its limit
    }
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        url = server.url

        def predict(text: str) -> httpx.Response:
            return httpx.post(f"{url}/predict", json={"inputs": text}, timeout=10)

        assert predict("win a free prize").status_code == 200
        parts = urlsplit(url)
        # A request in flight (its body not all sent) holds the drain open, so that what the
        # service says between the error and its exit can be read.
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as held:
            held.sendall(CHUNKED_HEAD.replace("\n", "\r\n").encode() + b'\r\n5\r\n{"inp\r\n')
            wait_for(
                lambda: metric(url, "loraserve_requests_in_flight") >= 2,  # it and /metrics
                10,
                "the held request in flight",
            )
            failed = predict("offer offer offer now")
            time.sleep(0.5)  # uvicorn would have closed its port by now, had it not drained
            ready = httpx.get(f"{url}/ready", timeout=5)
            refused = predict("win a free prize")
            assert server.process.poll() is None, "gone before the request in flight ended"
        released = time.monotonic()
        code = server.process.wait(timeout=30)
        exited_after = time.monotonic() - released
        log = server.log()
    assert failed.status_code == 503, failed.text
    assert failed.json()["error"]["code"] == "inference_failed"
    assert "device-side assert" in failed.json()["error"]["message"]
    body = ready.json()
    assert ready.status_code == 503 and ready.headers["Retry-After"]
    assert body["status"] == "failed"
    assert "model 'tiny'" in body["error"] and "device-side assert" in body["error"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
    assert code == 3, log
    assert exited_after < 10, f"exited {exited_after:.1f} s after the last request ended"
    assert "stopped by a fatal device error: model 'tiny'" in log


# --- cache faults ---


@contextmanager
def small_disk(folder: Path) -> Iterator[bool]:
    """`folder` as a 1 MiB tmpfs where this process may mount one (root); True if mounted."""
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)]
    mounted = subprocess.run(mount, capture_output=True, check=False).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


@contextmanager
def disk_full(folder: Path, mounted: bool, pid: int) -> Iterator[str]:
    """The cache disk is full while inside: the tmpfs filled up, or, where none could be
    mounted, the server's file-size limit (RLIMIT_FSIZE) set to 0, so each write fails."""
    if mounted:
        filler = folder / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            for _ in range(1024):  # 1 MiB at most
                os.write(fd, b"\0" * 4096)
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        try:
            yield "tmpfs filled up"
        finally:
            filler.unlink()
    else:
        limits = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (0, limits[1]))
        try:
            yield "RLIMIT_FSIZE 0"
        finally:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, limits)


def test_disk_cache_faults_are_answered_from_the_model_and_counted(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    models = tiny_models_file(tmp_path, tiny_bert, adapters=("spam",))
    with small_disk(tmp_path / "disk") as mounted:
        cache_dir = tmp_path / "disk" / "cache"
        env = {
            "MODELS_FILE": str(models),
            "LRU_CACHE_ENTRIES": "0",
            "DISK_CACHE_DIR": str(cache_dir),
            "DISK_CACHE_ADMISSION": "every",  # a text's first answer on disk, or its fault
        }
        with run_server(env, tmp_path) as server:
            server.wait_ready()

            def predict(text: str) -> httpx.Response:
                response = httpx.post(f"{server.url}/predict", json={"inputs": text}, timeout=10)
                assert response.status_code == 200, response.text
                return response

            def errors(op: str) -> float:
                return metric(server.url, "loraserve_cache_errors_total", tier="disk", op=op)

            def cached(text: str) -> bool:
                return predict(text).headers["X-Cache"] == "lru=0,disk=1,model=0"

            # A corrupt entry (written by another process while the server runs, without the
            # HMAC every value carries).
            first = predict("win a free prize now")
            wait_for(lambda: cached("win a free prize now"), 10, "the disk tier answers")
            with diskcache.Cache(str(cache_dir)) as raw:
                for key in list(raw):
                    raw.set(key, "{not json")
            again = predict("win a free prize now")
            assert again.headers["X-Cache"] == "lru=0,disk=0,model=1"
            assert again.json() == first.json()
            assert errors("read") == 0  # a value that is not an answer is no fault: rejected
            rejected = metric(
                server.url, "loraserve_cache_rejected_total", tier="disk", reason="mac"
            )
            assert rejected == 1

            # A full disk: every answer still comes from the model; the failed writes count.
            with disk_full(tmp_path / "disk", mounted, server.process.pid) as how:
                texts = [f"are we still meeting for lunch {i}" for i in range(5)]
                for text in texts:
                    predict(text)
                wait_for(lambda: errors("write") >= len(texts), 10, f"failed writes ({how})")
                assert not any(cached(text) for text in texts)

            # Space again: writes succeed again.
            predict("see you later")
            wait_for(lambda: cached("see you later"), 10, "the disk tier recovers")
            print(json.dumps({"full_disk": how, "write_errors": errors("write")}))
