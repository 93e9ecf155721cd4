"""OpenTelemetry traces, configured by the standard `OTEL_*` variables, exported over
OTLP/HTTP; off when no exporter is configured.

Off costs nothing: no provider, no tracer, no span objects and no context work. Every hook
asks `tracer` (None when off) or calls `span`, which then hands back one shared do-nothing
context manager.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Tracer
from opentelemetry.util.types import AnyValue

from api.observability.record import RequestRecord

SERVICE_NAME = "loraserve"
# The protocols the exporter speaks: OTLP/HTTP with protobuf bodies.
SUPPORTED_PROTOCOLS = frozenset({"http/protobuf"})
NO_SPAN: AbstractContextManager[None] = nullcontext()

# The service's tracer once `configure` turned tracing on; None: off.
tracer: Tracer | None = None
_provider: Any = None  # the SDK's TracerProvider, for the flush at shutdown


class TracingConfigError(ValueError):
    """`OTEL_*` variables that ask for what this service cannot export."""


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the environment configures a trace exporter: an OTLP endpoint, or
    `OTEL_TRACES_EXPORTER=otlp`; never with `OTEL_SDK_DISABLED=true` or
    `OTEL_TRACES_EXPORTER=none`."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if exporter not in ("", "otlp"):
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={exporter!r}: only 'otlp' or 'none'")
    endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return exporter == "otlp" or any(environ.get(name) for name in endpoints)


def configure(environ: Mapping[str, str] = os.environ) -> bool:
    """Turns tracing on when the environment configures an exporter; returns whether it did.

    The SDK reads the rest itself: the endpoint, headers and timeout of the exporter,
    `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER(_ARG)`,
    `OTEL_PROPAGATORS` (W3C `traceparent` by default) and the batch processor's limits.
    """
    global tracer, _provider
    if not wanted(environ):
        return False
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = environ.get(name, "").strip()
        if protocol:
            if protocol not in SUPPORTED_PROTOCOLS:
                raise TracingConfigError(f"{name}={protocol!r}: only 'http/protobuf'")
            break
    # Imported here: with tracing off the SDK and the exporter are never loaded.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from api import __version__

    # Given here, service.name would win over OTEL_SERVICE_NAME: the SDK's `unknown_service`
    # placeholder is what it replaces.
    resource = Resource.create({"service.version": __version__})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    _provider = TracerProvider(resource=resource)
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    tracer = _provider.get_tracer("loraserve", __version__)
    return True


def shutdown() -> None:
    """Exports the spans still buffered, then turns tracing off."""
    global tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    tracer, _provider = None, None


def span(name: str) -> AbstractContextManager[Span | None]:
    """A child span of the current one, current while the block runs (an exception ends it
    in error); with tracing off, or no span current, one shared do-nothing block that yields
    None.

    A stage never starts a trace: with no span current it runs outside every request's
    trace (a batch that serves no sampled request has no span), and a span started there
    would be a root that the sampler keeps, a stray trace of its own."""
    if tracer is None or not trace.get_current_span().get_span_context().is_valid:
        return NO_SPAN
    return tracer.start_as_current_span(name)


def outgoing() -> dict[str, str]:
    """The current trace context as W3C headers (`traceparent`, `tracestate`), for work that
    another process continues (the split's model side); empty with tracing off."""
    carrier: dict[str, str] = {}
    if tracer is not None:
        propagate.inject(carrier)
    return carrier


def continued(name: str, carrier: Mapping[str, str]) -> AbstractContextManager[Span | None]:
    """A span continuing the trace `carrier` holds (`outgoing` in another process), current
    while the block runs; with tracing off, or no trace to continue, the do-nothing block."""
    if tracer is None or not carrier:
        return NO_SPAN
    parent = propagate.extract(carrier)
    return tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER)


def start_request(name: str, headers: Sequence[tuple[bytes, bytes]]) -> tuple[Span, object]:
    """The server span of one HTTP request, made current; it continues the client's trace
    when its headers carry one (W3C `traceparent`). Returns the span and the token that
    `end_request` detaches."""
    assert tracer is not None
    carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in headers}
    parent = propagate.extract(carrier)
    request_span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER)
    token = otel_context.attach(trace.set_span_in_context(request_span, parent))
    return request_span, token


def end_request(request_span: Span, token: object, record: RequestRecord) -> None:
    """Ends the request's span with what its record says (5xx: an error) and detaches it."""
    status = record.status or 500
    attributes: dict[str, str | int | float] = {
        "http.request.method": record.method,
        "url.path": record.path,
        "http.route": record.route,
        "http.response.status_code": status,
        "loraserve.request_id": record.request_id,
    }
    for name in ("model", "adapter", "texts"):
        if (value := getattr(record, name)) is not None:
            attributes[f"loraserve.{name}"] = value
    for tier, count in record.cache.items():
        attributes[f"loraserve.cache.{tier}"] = count
    request_span.set_attributes(attributes)
    if status >= 500:
        request_span.set_status(trace.StatusCode.ERROR)
    request_span.end()
    otel_context.detach(token)  # type: ignore[arg-type]


def current_span_context() -> SpanContext | None:
    """The current span's context when it is sampled (for links and exemplars), else None."""
    if tracer is None:
        return None
    found = trace.get_current_span().get_span_context()
    return found if found.is_valid and found.trace_flags.sampled else None


def trace_id_hex(span_context: SpanContext) -> str:
    """The 32 hex digits of a trace id, as tracing back ends show it."""
    return trace.format_trace_id(span_context.trace_id)


@contextmanager
def batch(
    requests: Sequence[tuple[SpanContext, float]],
    rows: int,
    tokens: int,
    adapters: Sequence[str | None],
) -> Iterator[None]:
    """The span of one batch, current while it runs, in the trace of the first request it
    serves and linked from every sampled request; each of them gets its `queue wait` span
    (from its submission, `(span context, time.monotonic())`, to the batch's start) linked to
    the batch. Without a sampled request, no span, and none of its stages (`span`) either."""
    if tracer is None or not requests:
        yield
        return
    parent = trace.set_span_in_context(trace.NonRecordingSpan(requests[0][0]))
    mix: dict[str, int] = {}
    for adapter in adapters:
        mix[adapter or "none"] = mix.get(adapter or "none", 0) + 1
    attributes: dict[str, AnyValue] = {
        "batch.size": rows,
        "batch.tokens": tokens,
        "batch.requests": len(requests),
        "batch.adapters": [f"{name}={count}" for name, count in sorted(mix.items())],
    }
    links = [Link(request) for request, _ in requests]
    with tracer.start_as_current_span(
        "batch", context=parent, links=links, attributes=attributes
    ) as batch_span:
        started_ns, started = time.time_ns(), time.monotonic()
        batch_link = [Link(batch_span.get_span_context())]
        for request, submitted in requests:
            waited_ns = int((started - submitted) * 1e9)
            wait = tracer.start_span(
                "queue wait",
                context=trace.set_span_in_context(trace.NonRecordingSpan(request)),
                links=batch_link,
                start_time=started_ns - waited_ns,
            )
            wait.end(end_time=started_ns)
        yield
