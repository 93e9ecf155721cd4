"""Following one request on the real server: its id on every answer, its JSON log lines, and
its trace exported over OTLP/HTTP to a real receiver; never a text of it in any log line."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.observability import tracing
from api.observability.logs import ACCESS_LOGGER, log_access
from api.observability.record import RequestRecord
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan, run_otlp_receiver
from tests.support.server_process import ServerProcess, run_server
from tests.support.tiny_models import LABELS, TinyModel, write_models_file
from tests.support.trace_context import traceparent

HEX32 = re.compile(r"[0-9a-f]{32}")
MAX_TEXT_CHARS = 200
SERVICE = "loraserve-under-test"


@dataclass
class Traced:
    """The server, and the receiver its spans go to."""

    server: ServerProcess
    receiver: OtlpReceiver


@pytest.fixture(scope="module")
def traced(tiny_bert: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    """Two tiny models (a cascade whose every text goes on to the second), JSON logs,
    traces to the receiver. One request queued at a time, each waiting 0.2 s for a batch:
    a second one sent meanwhile is refused (429) at once."""
    folder = tmp_path_factory.mktemp("traced")
    entries: list[dict[str, object]] = [
        {
            "name": name,
            "base": str(tiny_bert.base),
            "labels": LABELS,
            "max_length": 32,
            "adapters": [{"name": adapter, "path": str(tiny_bert.adapters[adapter])}],
        }
        for name, adapter in (("tiny", "spam"), ("second", "promo"))
    ]
    with run_otlp_receiver() as receiver:
        env = {
            "MODELS_FILE": str(write_models_file(folder / "models.yaml", entries)),
            "DISK_CACHE_DIR": str(folder / "cache"),
            "CASCADE_THRESHOLD": "1.0",
            "MAX_QUEUE_SIZE": "1",
            "MAX_BATCH_WAIT_SECONDS": "0.2",
            "REFUSAL_DELAY_SECONDS": "0",
            "MAX_TEXT_CHARS": str(MAX_TEXT_CHARS),
            "MAX_BODY_BYTES": "4096",
            "LOG_FORMAT": "json",
            "LOG_LEVEL": "debug",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_SERVICE_NAME": SERVICE,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        with run_server(env, folder) as server:
            server.wait_ready()
            yield Traced(server, receiver)


def log_lines(server: ServerProcess) -> list[dict[str, object]]:
    """Every line the process wrote (stdout and stderr), each parsed as a JSON object."""
    lines = []
    for line in server.log().splitlines():
        parsed = json.loads(line)  # fails the test on any line that is not JSON
        assert isinstance(parsed, dict), line
        lines.append(parsed)
    return lines


def access_line(server: ServerProcess, request_id: str) -> dict[str, object]:
    """The access line of the request with this id, once written (after its answer)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in log_lines(server):
            if line.get("logger") == "loraserve.access" and line.get("request_id") == request_id:
                return line
        time.sleep(0.02)
    raise AssertionError(f"no access line for {request_id}")


def test_request_ids_are_kept_when_sane_made_up_otherwise_and_on_every_answer(
    traced: Traced,
) -> None:
    url = traced.server.url

    def predict(request_id: str | bytes | None, **body: object) -> httpx.Response:
        headers = {} if request_id is None else {"X-Request-ID": request_id}
        return httpx.post(f"{url}/predict", json=body, headers=headers, timeout=30)

    kept = "client-7:42.abc_DEF"
    assert predict(kept, inputs="hello there").headers["X-Request-ID"] == kept
    made = [predict(None, inputs="hello").headers["X-Request-ID"] for _ in range(2)]
    assert all(HEX32.fullmatch(made_up) for made_up in made) and made[0] != made[1]
    for insane in ("x" * 129, "has space", "semi;colon", "é-accent".encode(), "tab\tin", "a/b", ""):
        replaced = predict(insane, inputs="hello").headers["X-Request-ID"]
        assert HEX32.fullmatch(replaced), (insane, replaced)
    assert HEX32.fullmatch(predict("a" * 128 + "b", inputs="x").headers["X-Request-ID"])
    assert predict("a" * 128, inputs="x").headers["X-Request-ID"] == "a" * 128

    # Refusals: by the lifecycle (422, 404), the body limit (413), the queue (429), and the
    # Open Inference Protocol's routes, in their own error shape.
    assert predict("bad-1", inputs=5).headers["X-Request-ID"] == "bad-1"
    assert predict("unknown-1", inputs="x", model="nope").headers["X-Request-ID"] == "unknown-1"
    too_big = predict("big-1", inputs="x" * 5000)
    assert too_big.status_code == 413 and too_big.headers["X-Request-ID"] == "big-1"
    oip = httpx.post(
        f"{url}/v2/models/nope/infer",
        json={"inputs": [{"name": "input-0", "shape": [1], "datatype": "BYTES", "data": ["x"]}]},
        headers={"X-Request-ID": "oip-404"},
    )
    assert oip.status_code == 404 and "error" in oip.json()
    assert oip.headers["X-Request-ID"] == "oip-404"
    oip_bad = httpx.post(
        f"{url}/v2/models/tiny/infer", content=b"{not json", headers={"X-Request-ID": "oip-422"}
    )
    assert oip_bad.status_code == 422 and oip_bad.headers["X-Request-ID"] == "oip-422"

    ids = [f"crowd-{n}" for n in range(4)]
    with ThreadPoolExecutor(max_workers=len(ids)) as pool:
        crowd = list(pool.map(lambda i: predict(i, inputs=f"text {i}", cache=False), ids))
    assert {r.status_code for r in crowd} == {200, 429}, [r.status_code for r in crowd]
    assert [r.headers["X-Request-ID"] for r in crowd] == ids
    refused = next(r for r in crowd if r.status_code == 429)
    assert access_line(traced.server, refused.headers["X-Request-ID"])["status"] == 429


def test_every_line_is_a_json_object_and_the_access_line_carries_the_request(
    traced: Traced,
) -> None:
    response = httpx.post(
        f"{traced.server.url}/predict",
        json={"inputs": ["one text", "another text"], "adapter": None, "model": "tiny"},
        headers={"X-Request-ID": "json-line-1"},
    )
    assert response.status_code == 200
    line = access_line(traced.server, "json-line-1")
    assert line["level"] == "INFO" and line["message"] == "POST /predict 200"
    assert line["route"] == "/predict" and line["status"] == 200
    assert line["model"] == "tiny" and line["adapter"] == "spam" and line["texts"] == 2
    cache = line["cache"]
    assert isinstance(cache, dict) and sum(cache.values()) == 2
    assert set(cache) == {"lru", "disk", "model"}
    assert isinstance(line["duration_ms"], float) and line["duration_ms"] > 0
    lines = log_lines(traced.server)
    for parsed in lines:
        assert {"time", "level", "logger", "message"} <= set(parsed), parsed
    loggers = {str(parsed["logger"]) for parsed in lines}
    # uvicorn's own lines come through the same handler, as JSON.
    assert {"uvicorn.error", "loraserve.access", "api.service.core"} <= loggers, loggers


def spans_of(trace_id: str, spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    by_name: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        if span.trace_id == trace_id:
            by_name.setdefault(span.name, []).append(span)
    return by_name


STAGES = {
    "POST /predict",
    "cache lookup",
    "tokenize",
    "admission",
    "queue wait",
    "batch",
    "forward",
    "cascade second stage",
}


def test_a_traceparent_is_continued_through_every_stage_and_exported(traced: Traced) -> None:
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    texts = [f"trace me {trace_id[:8]}", f"and me {trace_id[8:16]}"]
    response = httpx.post(
        f"{traced.server.url}/predict",
        json={"inputs": texts, "model": "cascade"},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "X-Request-ID": "traced-1"},
    )
    assert response.status_code == 200
    spans = traced.receiver.wait_for(lambda got: set(spans_of(trace_id, got)) >= STAGES)
    stages = spans_of(trace_id, spans)
    (request,) = stages["POST /predict"]
    assert request.parent_span_id == parent_id and request.service == SERVICE
    attributes = request.attributes
    assert attributes["loraserve.request_id"] == "traced-1"
    assert attributes["http.response.status_code"] == 200 and attributes["loraserve.texts"] == 2
    assert attributes["loraserve.model"] == "cascade"
    assert attributes["loraserve.cache.model"] == 2  # both answered by a model (the second)

    (second_stage,) = stages["cascade second stage"]
    assert second_stage.parent_span_id == request.span_id
    # Each stage asks both local tiers: the first model's texts, then the second's.
    tiers = sorted(str(span.attributes["cache.tier"]) for span in stages["cache lookup"])
    assert tiers == ["disk", "disk", "lru", "lru"]
    # Two batches: the first model's under the request, the second's under its stage; each
    # linked from the span that queued it, which got its wait, linked back.
    batches = {span.parent_span_id: span for span in stages["batch"]}
    assert set(batches) == {request.span_id, second_stage.span_id}
    for queued_by, batch in batches.items():
        assert batch.links == [(trace_id, queued_by)]
        assert (
            batch.attributes["batch.size"] == 2 and int(str(batch.attributes["batch.tokens"])) > 2
        )
        adapter = "spam" if queued_by == request.span_id else "promo"
        assert batch.attributes["batch.adapters"] == [f"{adapter}=2"]
        (wait,) = [span for span in stages["queue wait"] if span.parent_span_id == queued_by]
        assert wait.links == [(trace_id, batch.span_id)]
        (forward,) = [span for span in stages["forward"] if span.parent_span_id == batch.span_id]
        assert forward.attributes["batch.size"] == 2
    parents = {span.parent_span_id for span in stages["tokenize"] + stages["admission"]}
    assert parents == {request.span_id, second_stage.span_id}

    # The latency histogram's exemplar carries the trace id, where OpenMetrics is asked for.
    openmetrics = httpx.get(
        f"{traced.server.url}/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0"},
    )
    assert openmetrics.headers["Content-Type"].startswith("application/openmetrics-text")
    exemplars = [
        line
        for line in openmetrics.text.splitlines()
        if line.startswith("loraserve_request_duration_seconds_bucket")
        and 'route="/predict"' in line
        and f'trace_id="{trace_id}"' in line
    ]
    assert exemplars, "no exemplar carries the trace id"
    classic = httpx.get(f"{traced.server.url}/metrics")
    assert classic.headers["Content-Type"].startswith("text/plain")
    assert "trace_id=" not in classic.text


def spans_after_a_traced_request(traced: Traced) -> list[ReceivedSpan]:
    """Every span received once those of a sampled request sent now are in: spans go out in
    the order they end, so those of any request before it are in too."""
    trace_id = uuid.uuid4().hex
    assert httpx.post(
        f"{traced.server.url}/predict",
        json={"inputs": f"a traced request {trace_id}"},
        headers={"traceparent": traceparent(trace_id)},
    ).is_success
    return traced.receiver.wait_for(lambda got: "batch" in spans_of(trace_id, got))


def test_an_unsampled_traceparent_exports_nothing(traced: Traced) -> None:
    unsampled = uuid.uuid4().hex
    assert httpx.post(
        f"{traced.server.url}/predict",
        json={"inputs": f"sampling {unsampled}"},
        headers={"traceparent": traceparent(unsampled, sampled=False)},
    ).is_success
    assert spans_of(unsampled, spans_after_a_traced_request(traced)) == {}


def test_probes_and_scrapes_keep_their_id_but_start_no_trace(traced: Traced) -> None:
    probe_trace = uuid.uuid4().hex
    for path in ("/ready", "/health", "/metrics", "/v2/health/ready"):
        probe = httpx.get(
            f"{traced.server.url}{path}",
            headers={"traceparent": traceparent(probe_trace)},
        )
        assert probe.status_code == 200 and HEX32.fullmatch(probe.headers["X-Request-ID"])
    assert spans_of(probe_trace, spans_after_a_traced_request(traced)) == {}


SHAPES = ("predict", "list", "not_a_string", "too_long", "lone_surrogate", "oip", "oip_int")


def request_body(shape: str, text: str) -> tuple[str, bytes]:
    """The path and JSON body of one request of `shape` carrying `text`."""
    if shape == "predict":
        body: object = {"inputs": text}
    elif shape == "list":
        body = {"inputs": [text, text + " again"], "model": "cascade"}
    elif shape == "not_a_string":
        body = {"inputs": [text, 5]}
    elif shape == "too_long":
        body = {"inputs": [text + "x" * MAX_TEXT_CHARS]}
    elif shape == "lone_surrogate":  # no UTF-8 can carry it: the JSON escape can
        raw = json.dumps({"inputs": text + "\ud800"}, ensure_ascii=True)
        return "/predict", raw.encode()
    else:
        datatype = "BYTES" if shape == "oip" else "INT64"
        tensor = {"name": "input-0", "shape": [1], "datatype": datatype, "data": [text]}
        return "/v2/models/tiny/infer", json.dumps({"inputs": [tensor]}).encode()
    return "/predict", json.dumps(body).encode()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.sampled_from(SHAPES),
    before=st.text(max_size=40),
    after=st.text(max_size=40),
)
def test_no_text_of_a_request_appears_in_any_log_line(
    traced: Traced, shape: str, before: str, after: str
) -> None:
    # A marker no log could hold by chance, inside whatever text hypothesis makes up.
    marker = f"m{uuid.uuid4().hex[:20]}"
    path, body = request_body(shape, f"{before}{marker}{after}")
    request_id = f"no-text-{marker[1:9]}"
    response = httpx.post(
        traced.server.url + path,
        content=body,
        headers={"Content-Type": "application/json", "X-Request-ID": request_id},
        timeout=30,
    )
    assert response.status_code in (200, 400, 422), response.text
    access_line(traced.server, request_id)  # every line this request wrote is in by now
    log = traced.server.log()
    assert marker not in log and marker[1:] not in log


def test_a_trace_protocol_it_cannot_export_stops_the_start_naming_it(tmp_path: Path) -> None:
    env = {
        "LOG_FORMAT": "json",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    with run_server(env, tmp_path) as server:
        assert server.process.wait(timeout=120) == 2
        [said] = [line for line in log_lines(server) if line["level"] == "CRITICAL"]
        assert "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'" in str(said["message"])


def test_invalid_settings_are_told_in_a_json_line_too(tmp_path: Path) -> None:
    with run_server({"LOG_FORMAT": "json", "MAX_TEXTS_PER_REQUEST": "many"}, tmp_path) as server:
        assert server.process.wait(timeout=60) == 2
        [said] = log_lines(server)
        assert said["level"] == "CRITICAL" and "MAX_TEXTS_PER_REQUEST" in str(said["message"])


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_tracing_is_on_only_where_an_exporter_is_configured(
    environ: dict[str, str], on: bool
) -> None:
    assert tracing.wanted(environ) is on


def test_an_exporter_it_does_not_have_is_refused() -> None:
    with pytest.raises(tracing.TracingConfigError, match="zipkin"):
        tracing.wanted({"OTEL_TRACES_EXPORTER": "zipkin"})


GLOBAL_PROVIDER_SCRIPT = """
import time

from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from api.http.app import create_app
from api.settings import Settings

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)  # as opentelemetry-instrument does
app = create_app(Settings(_env_file=None, disk_cache_max_bytes=0))
with TestClient(app) as client:
    while client.get("/ready").status_code != 200:
        time.sleep(0.02)
    answers = [client.get("/health"), client.post("/predict", json={"inputs": "win a prize"})]
print([a.status_code for a in answers], [s.name for s in exporter.get_finished_spans()])
"""


def test_fastapis_own_telemetry_adds_nothing_where_a_global_provider_is_set() -> None:
    # A process-wide provider cannot be unset: the app runs in a process of its own. FastAPI
    # would otherwise add spans of its own ("GET /health", ...) beside the service's.
    ran = subprocess.run(
        [sys.executable, "-c", GLOBAL_PROVIDER_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert ran.stdout.strip().splitlines()[-1] == "[200, 200] []"


def test_a_path_cannot_forge_a_line_of_the_text_access_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`%0A` in a request's path decodes to a line break: the text log escapes it, so a client
    cannot write a line of its own choosing into the operator's log."""
    forged = "/predict\n2026-12-01 00:00:00 INFO loraserve.access POST /v1/load_lora_adapter 200"
    record = RequestRecord("id", "GET", forged, "other")
    record.status = 404
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        log_access(record)
    (line,) = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert "\n" not in line
    assert line == f"GET {forged.replace(chr(10), chr(92) + 'x0a')} 404"
