"""The batch's trace, in process, its spans kept by the SDK's in-memory exporter: a batch that
serves only unsampled requests exports nothing, not even a trace of its own; one that serves a
sampled request is in that request's trace and linked from every sampled request it serves."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased

from api.models.spec import load_models_file
from api.observability import tracing
from tests.support.in_process import serving
from tests.support.tiny_models import simulated_entry, write_models_file
from tests.support.trace_context import traceparent

# The SDK's default (no OTEL_TRACES_SAMPLER), and a ratio of 0 for traces the service starts:
# either way a client's sampling decision is the request's.
SAMPLERS: dict[str, Sampler] = {
    "parentbased_always_on": ParentBased(ALWAYS_ON),
    "parentbased_traceidratio_0": ParentBased(TraceIdRatioBased(0.0)),
}
REQUESTS = 4  # sent together: one batch serves them all


@pytest.fixture(params=list(SAMPLERS))
def exporter(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[InMemorySpanExporter]:
    """Tracing on, every span ended kept at once."""
    kept = InMemorySpanExporter()
    provider = TracerProvider(sampler=SAMPLERS[request.param])
    provider.add_span_processor(SimpleSpanProcessor(kept))
    monkeypatch.setattr(tracing, "tracer", provider.get_tracer("loraserve"))
    yield kept
    provider.shutdown()


@pytest.fixture
def client(exporter: InMemorySpanExporter, tmp_path: Path) -> Iterator[TestClient]:
    """A simulated model, no cache: every text goes to a batch, which waits for the others."""
    (spec,) = load_models_file(write_models_file(tmp_path / "models.yaml", [simulated_entry()]))
    with serving(
        [spec],
        tmp_path / "cache",
        lru_cache_entries=0,
        disk_cache_max_bytes=0,
        max_batch_wait_seconds=0.3,
        admission_control=False,
    ) as client:
        yield client


def post_together(client: TestClient, sampled: list[bool]) -> list[str]:
    """One text a request, the requests sent at once; their trace ids."""
    trace_ids = [uuid.uuid4().hex for _ in sampled]

    def post(index: int) -> int:
        headers = {"traceparent": traceparent(trace_ids[index], sampled[index])}
        body = {"inputs": f"text {index} {trace_ids[index]}"}
        return client.post("/predict", json=body, headers=headers).status_code

    with ThreadPoolExecutor(max_workers=len(sampled)) as pool:
        assert list(pool.map(post, range(len(sampled)))) == [200] * len(sampled)
    return trace_ids


def trace_id_of(span: ReadableSpan) -> str:
    assert span.context is not None
    return trace.format_trace_id(span.context.trace_id)


def test_a_batch_of_unsampled_requests_exports_no_span_at_all(
    client: TestClient, exporter: InMemorySpanExporter
) -> None:
    post_together(client, [False] * REQUESTS)
    assert [span.name for span in exporter.get_finished_spans()] == []


def test_a_batch_with_a_sampled_request_is_in_its_trace_and_linked_from_it(
    client: TestClient, exporter: InMemorySpanExporter
) -> None:
    sampled = [True, False, True, False]
    trace_ids = post_together(client, sampled)
    spans = exporter.get_finished_spans()
    wanted = {trace_id for trace_id, on in zip(trace_ids, sampled, strict=True) if on}
    # Only the sampled requests' traces: no unsampled request's, and none of a batch's own.
    assert {trace_id_of(span) for span in spans} == wanted
    requests = {trace_id_of(s): s for s in spans if s.name == "POST /predict"}
    assert set(requests) == wanted
    (batch,) = [span for span in spans if span.name == "batch"]
    assert batch.attributes is not None and batch.attributes["batch.requests"] == len(wanted)
    linked = {(link.context.trace_id, link.context.span_id) for link in batch.links}
    from_requests = set()
    for request in requests.values():
        assert request.context is not None
        from_requests.add((request.context.trace_id, request.context.span_id))
    assert linked == from_requests
    assert batch.parent is not None and (batch.parent.trace_id, batch.parent.span_id) in linked
    (forward,) = [span for span in spans if span.name == "forward"]
    assert batch.context is not None and forward.parent is not None
    assert forward.parent.span_id == batch.context.span_id
