"""A real OTLP/HTTP trace receiver on loopback: what the service's exporter sends, decoded
with OpenTelemetry's own protobuf classes."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span: ids as hex, attributes as plain values, links as (trace, span)."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, object]
    links: list[tuple[str, str]]
    service: str


@dataclass
class OtlpReceiver:
    """The spans received so far, and every path and content type that was posted."""

    url: str
    spans: list[ReceivedSpan] = field(default_factory=list)
    posts: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_for(
        self, found: Callable[[list[ReceivedSpan]], bool], timeout: float = 20.0
    ) -> list[ReceivedSpan]:
        """The spans received once `found` holds for them; AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                spans = list(self.spans)
            if found(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"not received within {timeout} s: {[s.name for s in spans]}")


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind is not None else None


def _decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        service=str(resource.get("service.name")),
                    )
                )
    return spans


@contextmanager
def run_otlp_receiver() -> Iterator[OtlpReceiver]:
    """Serves OTLP/HTTP (protobuf) on a free loopback port until the block ends."""
    receiver: OtlpReceiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            with receiver.lock:
                receiver.posts.append((self.path, self.headers.get("Content-Type", "")))
                if self.path == TRACES_PATH:
                    receiver.spans.extend(_decode(body))
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if self.path == TRACES_PATH else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            pass  # the test reads what was received, not a log

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = OtlpReceiver(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
