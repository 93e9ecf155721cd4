"""The outermost ASGI middleware: gives each request its id (echoed as `X-Request-ID` on
every answer, refusals by the other middlewares included), its record for the log lines it
writes, its span when tracing is on, and its access line."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.http.middleware.observe import RequestMetrics, route_label
from api.observability import tracing
from api.observability.logs import log_access
from api.observability.record import CURRENT, RequestRecord
from api.observability.request_id import HEADER, request_id_from
from api.service.contract import Classifier

_HEADER_KEY = HEADER.lower().encode("latin-1")
# Probes and scrapes, every few seconds from every kubelet and Prometheus: a trace each would
# bury the requests worth reading. They keep their id and access line.
UNTRACED = frozenset(
    {"/health", "/ready", "/metrics", "/v2/health/live", "/v2/health/ready", "/v2/models/ready"}
)


class RequestObserver:
    """The one outer ASGI layer (plain ASGI, not Starlette's BaseHTTPMiddleware, which costs a
    task and a stream per request): the request's id, record, span and access line, and its
    metrics (api.http.middleware.observe), with one wrapped `send` for all of them."""

    def __init__(self, app: ASGIApp, service: Classifier) -> None:
        self.app = app
        self.metrics = RequestMetrics(service)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        sent = next((value for key, value in headers if key == _HEADER_KEY), None)
        path = scope["path"]
        record = RequestRecord(request_id_from(sent), scope["method"], path, route_label(path))
        echoed = (_HEADER_KEY, record.request_id.encode("latin-1"))
        status = 500  # what the access line and metrics say of a request with no answer

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), echoed]
            await send(message)

        record_token = CURRENT.set(record)
        holds_drain = self.metrics.began()
        started = time.perf_counter()
        span = span_token = None
        if tracing.tracer is not None and record.route not in UNTRACED:
            span, span_token = tracing.start_request(f"{record.method} {record.route}", headers)
            context = span.get_span_context()
            if context.trace_flags.sampled:
                record.trace_id = tracing.trace_id_hex(context)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            self.metrics.ended(record.route, status, seconds, holds_drain, record.trace_id)
            record.status = status
            record.duration_ms = round(seconds * 1000, 3)
            log_access(record)
            if span is not None:
                tracing.end_request(span, span_token, record)
            CURRENT.reset(record_token)
