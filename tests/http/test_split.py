"""The front-end/model split, as the service runs it: `loraserve` with SPLIT_SOCKET (the model
side) and `loraserve front-end` on the same socket, two real processes.

Answers through the front end are transformers + peft's own; a run-time adapter loaded
through the front end serves there; refusals, request ids and metrics come through as one
process gives them; a client that goes has its call dropped on the model side; a model side
that dies answers 503 at once, and a new one on the same socket is picked up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import httpx
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from api.http.middleware.direct import DirectRoutes
from api.http.routes.common import OwnBodyRoute
from api.http.split import child
from api.http.split.child import FrontEndProcess
from api.http.split.front_end import create_front_end_app, without_families
from api.metrics import REQUEST_FAMILIES
from tests.support.in_process import make_settings
from tests.support.load_client import exposition_sum
from tests.support.otlp_receiver import ReceivedSpan, run_otlp_receiver
from tests.support.runtime_adapter_client import (
    ADMIN,
    ADMIN_KEY,
    TEXTS,
    TOLERANCE,
    answer_of,
    reference,
    runtime_adapters,
)
from tests.support.server_process import ServerProcess, children_of, run_server
from tests.support.split import FRONT_END, simulated_split_env, split
from tests.support.tiny_models import (
    LABELS,
    TinyModel,
    build_adapter,
    tiny_models_file,
)

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def oip_body(text: str) -> dict[str, object]:
    """An Open Inference Protocol infer request of one text."""
    return {"inputs": [{"name": "input-0", "shape": [1], "datatype": "BYTES", "data": [text]}]}


@pytest.fixture(scope="module")
def tiny_split(
    tiny_bert: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """The tiny BERT with its adapter `spam`, run-time adapters allowed, caches off."""
    folder = tmp_path_factory.mktemp("split")
    models = tiny_models_file(folder, tiny_bert, adapters=("spam",), runtime_adapters=True)
    env = {
        "MODELS_FILE": str(models),
        "DISK_CACHE_DIR": str(folder / "cache"),
        "LRU_CACHE_ENTRIES": "0",
        "DISK_CACHE_MAX_BYTES": "0",
        "ADMIN_API_KEY": ADMIN_KEY,
        "ADAPTER_ROOTS": str(folder),
        "LOG_FORMAT": "json",
        # These tests check answers and routes, not load: on a busy machine the first
        # requests' cost is unknown and one could be refused 429 (admission by time).
        "ADMISSION_CONTROL": "false",
    }
    with split(folder, env) as pair:
        yield pair


def test_answers_through_the_front_end_are_the_models_own(
    tiny_split: tuple[ServerProcess, ServerProcess], tiny_bert: TinyModel
) -> None:
    _, front_end = tiny_split
    expected = reference(tiny_bert.base, tiny_bert.adapters["spam"], TEXTS)
    with httpx.Client(base_url=front_end.url, timeout=30) as client:
        # Together, so that the front end's turns carry many calls in one message.
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(lambda t: client.post("/predict", json={"inputs": t}), TEXTS))
        batch = client.post("/predict", json={"inputs": TEXTS[:5], "raw_scores": False})
    for text, response in zip(TEXTS, answers, strict=True):
        assert response.status_code == 200, response.text
        assert response.headers["x-model"] == "tiny" and response.headers["x-adapter"] == "spam"
        found = answer_of(response)
        assert all(abs(a - b) <= TOLERANCE for a, b in zip(found, expected[text], strict=True))
    assert batch.status_code == 200 and len(batch.json()) == 5
    for text, ranked in zip(TEXTS[:5], batch.json(), strict=True):
        scores = {entry["label"]: entry["score"] for entry in ranked}
        found = tuple(scores[label] for label in LABELS)
        assert all(abs(a - b) <= TOLERANCE for a, b in zip(found, expected[text], strict=True))


def test_a_runtime_adapter_loaded_through_the_front_end_serves_through_it(
    tiny_split: tuple[ServerProcess, ServerProcess], tiny_bert: TinyModel
) -> None:
    model_side, front_end = tiny_split
    folder = build_adapter(tiny_bert.base, model_side.log_path.parent / "v1", ["query"], seed=21)
    expected = reference(tiny_bert.base, folder, TEXTS[:3])
    with httpx.Client(base_url=front_end.url, timeout=30) as client:
        body = {"lora_name": "v1", "lora_path": str(folder)}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 401  # no key
        loaded = client.post("/v1/load_lora_adapter", json=body, headers=ADMIN)
        assert loaded.status_code == 200, loaded.text
        assert "v1" in runtime_adapters(client)
        for text in TEXTS[:3]:
            response = client.post("/predict", json={"inputs": text, "adapter": "v1"})
            assert response.headers["x-adapter"] == "v1"
            found = answer_of(response)
            assert all(abs(a - b) <= TOLERANCE for a, b in zip(found, expected[text], strict=True))
        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "v1"}, headers=ADMIN)
        assert unloaded.status_code == 200
        gone = client.post("/predict", json={"inputs": TEXTS[0], "adapter": "v1"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


def test_refusals_and_other_routes_come_through_as_one_process_gives_them(
    tiny_split: tuple[ServerProcess, ServerProcess],
) -> None:
    model_side, front_end = tiny_split
    asked = [
        ("POST", "/predict", {"inputs": "hello", "model": "nobody"}),  # the model side's 404
        ("POST", "/predict", {"inputs": "hello", "adapter": "nobody"}),
        ("POST", "/predict", {"inputs": "x" * 100_000}),  # past MAX_TEXT_CHARS: 422
        ("POST", "/predict", {"inputs": []}),
        ("GET", "/predict", None),  # 405
        ("GET", "/nowhere", None),
        ("GET", "/info", None),
        ("GET", "/v2/models/tiny", None),  # the Open Inference Protocol's metadata
        ("GET", "/openapi.json", None),
        # Its infer, which the front end answers itself: an answer, the model side's 404, the
        # route's own refusals.
        ("POST", "/v2/models/tiny/infer", {**oip_body("hi"), "id": "same on both"}),
        ("POST", "/v2/models/nobody/infer", oip_body("hi")),
        ("POST", "/v2/models/tiny/infer", {**oip_body("hi"), "outputs": [{"name": "x"}]}),
        ("POST", "/v2/models/tiny/infer", {"inputs": "not a list"}),
    ]
    for method, path, body in asked:
        direct = httpx.request(method, f"{model_side.url}{path}", json=body, timeout=30)
        through = httpx.request(method, f"{front_end.url}{path}", json=body, timeout=30)
        assert (through.status_code, through.json()) == (direct.status_code, direct.json()), path
        assert through.headers["content-type"] == direct.headers["content-type"]


def test_the_request_id_is_the_front_ends_on_both_sides(
    tiny_split: tuple[ServerProcess, ServerProcess],
) -> None:
    model_side, front_end = tiny_split
    sent = {"X-Request-ID": "split-request-7"}
    models = httpx.get(f"{front_end.url}/models", headers=sent, timeout=30)
    assert models.headers.get_list("x-request-id") == ["split-request-7"]
    predicted = httpx.post(
        f"{front_end.url}/predict", json={"inputs": "hi"}, headers=sent, timeout=30
    )
    assert predicted.headers.get_list("x-request-id") == ["split-request-7"]
    lines = [json.loads(line) for line in model_side.log().splitlines() if line.startswith("{")]
    seen = [line for line in lines if line.get("request_id") == "split-request-7"]
    assert any(line.get("path") == "/models" for line in seen), "no access line for /models"


def test_metrics_count_each_request_once_and_hold_the_model_sides(
    tiny_split: tuple[ServerProcess, ServerProcess],
) -> None:
    model_side, front_end = tiny_split
    before = httpx.get(f"{front_end.url}/metrics", timeout=30).text
    for text in TEXTS[:4]:
        httpx.post(f"{front_end.url}/predict", json={"inputs": text}, timeout=30)
    after = httpx.get(f"{front_end.url}/metrics", timeout=30).text
    name, labels = "loraserve_requests_total", {"route": "/predict", "status": "200"}
    assert exposition_sum(after, name, **labels) - exposition_sum(before, name, **labels) == 4
    predictions = "loraserve_predictions_total"
    assert exposition_sum(after, predictions) - exposition_sum(before, predictions) == 4
    assert exposition_sum(after, "loraserve_batch_size_count", model="tiny") > 0
    assert exposition_sum(after, "loraserve_front_end_process_cpu_seconds_total") > 0
    assert exposition_sum(after, "process_cpu_seconds_total") > 0  # the model side's
    names = [family.name for family in text_string_to_metric_families(after)]
    assert len(names) == len(set(names)), "a family twice"
    # The exemplars' format, as Prometheus asks for it: one family each, one # EOF, at the end.
    scraped = httpx.get(f"{front_end.url}/metrics", headers={"Accept": OPENMETRICS}, timeout=30)
    assert scraped.headers["content-type"].startswith("application/openmetrics-text")
    families = [family.name for family in openmetrics_families(scraped.text)]
    assert len(families) == len(set(families)) and "loraserve_requests" in families
    assert scraped.text.count("# EOF") == 1 and scraped.text.endswith("# EOF\n")
    # The model side's own /metrics still counts its own requests (none of the front end's).
    own = httpx.get(f"{model_side.url}/metrics", timeout=30).text
    assert exposition_sum(own, name, **labels) == 0


def test_without_families_drops_whole_families_in_both_formats() -> None:
    text = (
        "# HELP a_total A\n# TYPE a_total counter\na_total 1.0\n"
        "# HELP a_created A\n# TYPE a_created gauge\na_created 5.0\n"
        "# HELP b B\n# TYPE b gauge\nb 2.0\n"
    )
    assert without_families(text, frozenset({"a"})) == "# HELP b B\n# TYPE b gauge\nb 2.0\n"
    openmetrics = "# HELP a A\n# TYPE a counter\na_total 1.0\na_created 5.0\n# EOF\n"
    assert without_families(openmetrics, frozenset({"a"})) == ""
    assert without_families(openmetrics, frozenset({"b"})) == openmetrics.removesuffix("# EOF\n")
    assert "loraserve_requests" in REQUEST_FAMILIES


@pytest.mark.parametrize(
    ("path", "body"),
    [("/predict", lambda text: {"inputs": text}), ("/v2/models/sim/infer", oip_body)],
    ids=["predict", "oip"],
)
def test_a_client_that_goes_has_its_call_dropped_on_the_model_side(
    tmp_path: Path, path: str, body: Callable[[str], dict[str, object]]
) -> None:
    env = {**simulated_split_env(tmp_path, 1.0), "MAX_BATCH_SIZE": "1"}
    with split(tmp_path, env) as (_, front_end):
        url, metrics = f"{front_end.url}{path}", f"{front_end.url}/metrics"
        batches = "loraserve_batch_size_count"
        batches_before = exposition_sum(httpx.get(metrics, timeout=10).text, batches)
        with ThreadPoolExecutor(max_workers=1) as pool:
            busy = pool.submit(httpx.post, url, json=body("first"), timeout=30)
            time.sleep(0.3)  # its batch runs for a second; the next text queues behind it
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url, json=body("nobody waits for this"), timeout=0.3)
            assert busy.result().status_code == 200
        deadline = time.monotonic() + 10
        dropped = 0.0
        while time.monotonic() < deadline and dropped == 0:
            text = httpx.get(metrics, timeout=10).text
            dropped = exposition_sum(text, "loraserve_batch_dropped_total", reason="cancelled")
            time.sleep(0.1)
        assert dropped == 1
        assert exposition_sum(text, batches) - batches_before == 1  # "first" alone ran


def test_a_model_side_that_dies_is_answered_503_and_a_new_one_is_picked_up(
    tmp_path: Path,
) -> None:
    env = simulated_split_env(tmp_path, 2.0)
    socket = {"SPLIT_SOCKET": str(tmp_path / "model.sock"), **env}
    with split(tmp_path, env) as (model_side, front_end):
        url = f"{front_end.url}/predict"
        with ThreadPoolExecutor(max_workers=1) as pool:
            waiting = pool.submit(httpx.post, url, json={"inputs": "in flight"}, timeout=30)
            time.sleep(0.5)  # queued on the model side, its batch running for two seconds
            model_side.process.send_signal(signal.SIGKILL)
            started = time.monotonic()
            lost = waiting.result()
        assert lost.status_code == 503 and lost.headers["retry-after"] == "1"
        assert time.monotonic() - started < 1.0, "the lost call was not answered at once"
        refused = httpx.post(url, json={"inputs": "next"}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
        assert httpx.get(f"{front_end.url}/ready", timeout=30).status_code == 503
        assert httpx.get(f"{front_end.url}/health", timeout=30).status_code == 200
        # Its metrics still come, its own: the 503s it answered meanwhile are counted.
        alone = httpx.get(f"{front_end.url}/metrics", timeout=30)
        assert alone.status_code == 200
        assert exposition_sum(alone.text, "loraserve_rejections_total", reason="unavailable") >= 2
        assert exposition_sum(alone.text, "loraserve_batch_size_count") == 0  # no model side's
        with run_server(socket, tmp_path) as new_model_side:
            new_model_side.wait_ready()
            front_end.wait_ready()
            again = httpx.post(url, json={"inputs": "next"}, timeout=30)
            assert again.status_code == 200 and again.headers["x-model"] == "sim"


def test_a_front_end_without_split_socket_refuses_to_start(tmp_path: Path) -> None:
    with run_server({}, tmp_path, FRONT_END) as front_end:
        assert front_end.process.wait(timeout=60) == 2
    assert "SPLIT_SOCKET is not set" in front_end.log()


def test_a_trace_runs_from_the_front_end_into_the_model_side(tmp_path: Path) -> None:
    env = {**simulated_split_env(tmp_path, 0.0), "LRU_CACHE_ENTRIES": "0"}
    with run_otlp_receiver() as receiver:
        tracing = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
        socket = {"SPLIT_SOCKET": str(tmp_path / "model.sock"), **env, **tracing}
        with run_server({**socket, "OTEL_SERVICE_NAME": "model-side"}, tmp_path) as model_side:
            model_side.wait_ready()
            front = {**socket, "OTEL_SERVICE_NAME": "front-end"}
            with run_server(front, tmp_path, FRONT_END) as front_end:
                front_end.wait_ready()
                body = {"inputs": "a text to trace", "cache": False}
                assert httpx.post(f"{front_end.url}/predict", json=body).status_code == 200
                assert httpx.get(f"{front_end.url}/models").status_code == 200

                # Each process exports its spans on its own schedule: the front end's
                # request spans end after the model side's answers, so they can come later.
                def arrived(spans: list[ReceivedSpan]) -> bool:
                    names = {(span.service, span.name) for span in spans}
                    wanted = {
                        ("model-side", "classify"),
                        ("model-side", "GET /models"),
                        ("model-side", "forward"),
                        ("front-end", "POST /predict"),
                        ("front-end", "GET /models"),
                    }
                    return wanted <= names

                spans = receiver.wait_for(arrived)
    by_name = {(span.service, span.name): span for span in spans}
    predict = by_name[("front-end", "POST /predict")]
    classify = by_name[("model-side", "classify")]
    assert (classify.trace_id, classify.parent_span_id) == (predict.trace_id, predict.span_id)
    # The model side's own stages are in the request's trace, under its classify.
    tokenize = by_name[("model-side", "tokenize")]
    assert (tokenize.trace_id, tokenize.parent_span_id) == (predict.trace_id, classify.span_id)
    forwarded = by_name[("front-end", "GET /models")]
    answered = by_name[("model-side", "GET /models")]
    assert (answered.trace_id, answered.parent_span_id) == (forwarded.trace_id, forwarded.span_id)


def test_the_front_end_answers_predict_directly(tmp_path: Path) -> None:
    app = create_front_end_app(make_settings(split_socket=tmp_path / "model.sock"))
    (declared,) = [m for m in app.user_middleware if cast(object, m.cls) is DirectRoutes]
    routes = cast(list[OwnBodyRoute], declared.kwargs["routes"])
    assert sorted(route.path for route in routes) == ["/", "/predict"]


def test_one_command_runs_the_split_and_drains_the_front_end_first(tmp_path: Path) -> None:
    env = {**simulated_split_env(tmp_path, 1.0), "SPLIT_FRONT_END": "true"}
    with run_server(env, tmp_path) as service:
        service.wait_ready()
        (child,) = children_of(service.process.pid)
        assert "front-end" in Path(f"/proc/{child}/cmdline").read_text()
        url = f"{service.url}/predict"
        metrics = httpx.get(f"{service.url}/metrics", timeout=10).text
        assert exposition_sum(metrics, "loraserve_front_end_process_cpu_seconds_total") > 0
        assert exposition_sum(metrics, "loraserve_ready") == 1  # the model side's
        with ThreadPoolExecutor(max_workers=1) as pool:
            in_flight = pool.submit(httpx.post, url, json={"inputs": "in flight"}, timeout=30)
            time.sleep(0.3)  # its batch runs for a second
            assert service.stop(timeout=60) == 0
            answered = in_flight.result()
        assert answered.status_code == 200 and answered.headers["x-model"] == "sim"
        assert not Path(f"/proc/{child}").exists()


def test_one_command_stops_when_its_front_end_dies(tmp_path: Path) -> None:
    env = {**simulated_split_env(tmp_path, 0.0), "SPLIT_FRONT_END": "true"}
    with run_server(env, tmp_path) as service:
        service.wait_ready()
        (child,) = children_of(service.process.pid)
        os.kill(child, signal.SIGKILL)
        assert service.process.wait(timeout=60) == 4
    assert "the front end exited with -9" in service.log()


def test_a_front_end_that_overruns_its_stop_is_killed_when_the_tick_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(child, "STOP_GRACE_SECONDS", 0.5)
    front_end = FrontEndProcess(tmp_path / "model.sock", drain_seconds=0.0)
    ignores_sigterm = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " print('ready', flush=True); time.sleep(60)"
    )
    process = subprocess.Popen([sys.executable, "-c", ignores_sigterm], stdout=subprocess.PIPE)
    front_end.process = process
    try:
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        front_end.stop()
        front_end.kill_if_overdue()  # within the time it was given: left to drain
        time.sleep(0.8)
        assert front_end.exit_code() is None
        time.sleep(0.2)
        assert process.poll() is None  # asking how it is kills nothing
        front_end.kill_if_overdue()
        assert process.wait(timeout=10) == -signal.SIGKILL
    finally:
        process.kill()
        process.wait()


def connections_on_port(pid: int, port: int) -> int:
    """How many established TCP connections process `pid` holds on local `port`, from the
    kernel's tables (/proc/<pid>/fd's socket inodes, /proc/net/tcp's rows)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = str(fd.readlink())
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    count = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        established = fields[3] == "01"
        if established and local_port == port and fields[9] in inodes:
            count += 1
    return count


def test_several_front_ends_share_one_port_and_count_every_request_together(
    tmp_path: Path,
) -> None:
    """FRONT_ENDS=2: two front ends, the clients' connections spread over both by the kernel,
    and /metrics, whichever answers it, counts the requests of both."""
    env = {**simulated_split_env(tmp_path, 0.0), "SPLIT_FRONT_END": "true", "FRONT_ENDS": "2"}
    with run_server(env, tmp_path) as service:
        service.wait_ready()
        front_ends = children_of(service.process.pid)
        assert len(front_ends) == 2
        port = int(service.url.rsplit(":", 1)[1])
        clients = [httpx.Client(base_url=service.url, timeout=30) for _ in range(16)]
        try:
            for number, client in enumerate(clients):
                answered = client.post("/predict", json={"inputs": f"text {number}"})
                assert answered.status_code == 200 and answered.headers["x-model"] == "sim"
            # Each client keeps its connection: 2 ** -15 is the chance one front end has all.
            held = [connections_on_port(pid, port) for pid in front_ends]
            assert sum(held) == 16 and min(held) > 0
        finally:
            for client in clients:
                client.close()
        answered_200 = {"route": "/predict", "status": "200"}
        for _ in range(4):  # on new connections: either front end answers, with both's count
            metrics = httpx.get(f"{service.url}/metrics", timeout=10).text
            assert exposition_sum(metrics, "loraserve_requests_total", **answered_200) == 16
            assert exposition_sum(metrics, "loraserve_ready") == 1  # the model side's
        assert service.stop(timeout=60) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in front_ends)


def test_one_command_does_not_start_on_a_port_another_process_holds(tmp_path: Path) -> None:
    """Even a holder that let others join its port (SO_REUSEPORT, this user's) is not joined:
    its clients would reach a service that is not this one."""
    env = {**simulated_split_env(tmp_path, 0.0), "SPLIT_FRONT_END": "true", "FRONT_ENDS": "2"}
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        env["PORT"] = str(holder.getsockname()[1])
        with run_server(env, tmp_path) as service:
            assert service.process.wait(timeout=60) == 2
    assert "cannot listen on 127.0.0.1" in service.log()
    assert "Address already in use" in service.log()
