"""A front end of the split (`loraserve front-end`): the service's HTTP in a process of its
own, with the models' process (`loraserve` with the same SPLIT_SOCKET) behind one Unix socket.

`/predict` and the Open Inference Protocol's infer are the HTTP door's own routes on a
RemoteService (api.http.split.remote), which checks this process's phase, the deadline and
the limits, and has the model side's core classify: a client that goes cancels its call
there. `/health` is this process's and, when it is there, the model side's. `/metrics` is
the model side's, with the request families (counted here, where every request arrives) and
this process's own process metrics. The ready probes are this process's while it drains, the
model side's otherwise. Every other request is answered by the model side's app, forwarded
whole.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Metric, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from api import __version__
from api.http.errors import install_error_handlers, response_for
from api.http.layers import install_middleware
from api.http.routes import oip, tei
from api.http.schemas import HealthResponse
from api.http.split.child import METRICS_FOLDER_VARIABLE
from api.http.split.remote import (
    ModelSideLink,
    ModelSideStalled,
    RemoteService,
    current_request_id,
)
from api.metrics import PREFIX, REQUEST_FAMILIES
from api.observability import tracing
from api.observability.request_id import HEADER
from api.service.contract import RETRY_AFTER_LOADING_SECONDS, Phase
from api.serving.errors import ServiceError, Unavailable
from api.serving.heap import ServingHeap
from api.settings import Settings

logger = logging.getLogger(__name__)

# Not passed on: the connection's own (the hop has its own), and the request id, which the
# front end's record decides and the model side then uses.
NOT_FORWARDED = frozenset({"host", "connection", "content-length", "transfer-encoding"})
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
# A model side that is there but has not answered its /health in this long fails the front
# end's /health: less than a liveness probe's timeout (the Kubernetes manifest's is 5 s).
MODEL_SIDE_HEALTH_SECONDS = 3.0
# The readiness probes (ours, and the Open Inference Protocol's), answered by this process's
# phase first.
READY_PATHS = ("/ready", "/v2/health/ready", "/v2/models/{name}/ready")
FORWARD_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
_REQUEST_ID = HEADER.lower()


def create_front_end_app(settings: Settings) -> FastAPI:
    """`/predict` (TEI's and the Inference API's), the Open Inference Protocol's infer,
    `/health`, the merged `/metrics`, and every other path forwarded to the model side on
    `settings.split_socket`."""
    if settings.split_socket is None:
        raise ValueError("a front end needs SPLIT_SOCKET: the model side's socket")
    link = ModelSideLink(settings.split_socket)
    service = RemoteService(settings, link)
    metrics = service.metrics
    own_metrics = CollectorRegistry()
    own_metrics.register(_Families(request_metrics(metrics.registry), REQUEST_FAMILIES))
    ProcessCollector(namespace=f"{PREFIX}_front_end", registry=own_metrics)

    # Its imports are the service's (torch's included): frozen as the service's start-up is,
    # or a full collection walks them all, a pause of a tenth of a second under load.
    heap = ServingHeap(settings.gc_gen0_threshold)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        heap.settle()
        service.phase = Phase.READY  # nothing to load: whether the models are is /ready's
        try:
            yield
        finally:
            service.begin_drain()
            await link.close()
            heap.release()

    # No docs of its own: /docs and /openapi.json are the model side's, every route listed.
    app = FastAPI(
        title="loraserve front end",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.service = service
    install_error_handlers(app)
    classifying = [tei.router, oip.infer_router]
    for router in classifying:
        app.include_router(router)

    async def health(request: Request) -> Response:
        # Alive: this process answers, and the model side too when it is there. One that is
        # there but does not answer (stopped, wedged) fails this probe, so the pod restarts;
        # one that is down or of another release does not: /ready says so, and restarting
        # this process would not help.
        try:
            await asyncio.wait_for(
                link.forward("GET", "/health", b"", [], b""), MODEL_SIDE_HEALTH_SECONDS
            )
        except (TimeoutError, ModelSideStalled) as exc:
            reason = "no answer" if isinstance(exc, TimeoutError) else exc.message
            message = f"the model side's /health: {reason} within {MODEL_SIDE_HEALTH_SECONDS:g} s"
            return response_for(Unavailable(message), request.url.path)
        except ServiceError:
            pass
        return JSONResponse(HealthResponse(status="ok").model_dump())

    app.add_api_route("/health", health, methods=["GET"], response_model=HealthResponse)

    async def merged_metrics(request: Request) -> Response:
        accept = request.headers.get("accept", "")
        encode, content_type = choose_encoder(accept)
        # Without the model side, the front end's own: its 503s are what is happening then.
        model_side = ""
        try:
            answer = await link.forward("GET", "/metrics", b"", [("accept", accept)], b"")
        except ServiceError as exc:
            logger.warning("/metrics without the model side's families: %s", exc.message)
        else:
            if answer.status == 200:
                model_side = without_families(answer.body.decode(), REQUEST_FAMILIES)
            else:
                logger.warning(
                    "/metrics without the model side's: its /metrics answered %d", answer.status
                )
        merged = model_side + encode(own_metrics).decode()
        return Response(merged, headers={"Content-Type": content_type})

    async def forward(request: Request) -> Response:
        # The model side's span of it continues the front end's trace, not the client's.
        trace = tracing.outgoing()
        dropped = NOT_FORWARDED | {_REQUEST_ID} | (TRACE_HEADERS if trace else frozenset())
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        headers = [(k, v) for k, v in headers if k.lower() not in dropped]
        headers += list(trace.items())
        scope = request.scope
        answer = await link.forward(
            request.method,
            scope["path"],
            scope["query_string"],
            [*headers, (_REQUEST_ID, current_request_id())],
            await request.body(),
        )
        response = Response(answer.body, answer.status)
        response.raw_headers = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in answer.headers
            if k.lower() != _REQUEST_ID
        ]
        return response

    async def ready(request: Request) -> Response:
        # This process's own phase first: a draining front end is not ready, whatever the
        # model side would say, so a balancer moves its traffic off before it stops.
        if not service.serving:
            refusal = Unavailable(
                f"front end is {service.phase.value}", RETRY_AFTER_LOADING_SECONDS
            )
            return response_for(refusal, request.url.path)
        return await forward(request)

    app.add_api_route("/metrics", merged_metrics, methods=["GET"], include_in_schema=False)
    for path in READY_PATHS:
        app.add_api_route(path, ready, methods=["GET"], include_in_schema=False)
    app.add_api_route("/{path:path}", forward, methods=FORWARD_METHODS, include_in_schema=False)
    install_middleware(app, service, classifying)
    return app


def request_metrics(own: CollectorRegistry) -> CollectorRegistry:
    """Where the request families are read: this process's `own` registry, or, where
    several front ends answer one port (FRONT_ENDS), every front end's, summed from the files
    in which each keeps its values (prometheus_client's multiprocess mode, which
    PROMETHEUS_MULTIPROC_DIR turns on as the process starts)."""
    if os.environ.get(METRICS_FOLDER_VARIABLE) is None:
        return own
    every_front_end = CollectorRegistry()
    MultiProcessCollector(every_front_end)  # type: ignore[no-untyped-call]
    return every_front_end


class _Families(Collector):
    """The families of `registry` named in `names`."""

    def __init__(self, registry: CollectorRegistry, names: frozenset[str]) -> None:
        self.registry = registry
        self.names = names

    def collect(self) -> Iterable[Metric]:
        return (family for family in self.registry.collect() if family.name in self.names)


def without_families(exposition: str, names: frozenset[str]) -> str:
    """A Prometheus exposition (text or OpenMetrics) less the families in `names` (a
    counter's `_total` and `_created` families included) and its `# EOF`."""
    return "".join(_lines_kept(exposition.splitlines(keepends=True), names))


def _lines_kept(lines: Iterable[str], names: frozenset[str]) -> Iterator[str]:
    dropping = False
    for line in lines:
        if line.startswith("# EOF"):
            continue
        if line.startswith(("# HELP ", "# TYPE ", "# UNIT ")):
            name = line.split(" ", 3)[2]
            dropping = name.removesuffix("_total").removesuffix("_created") in names
        if not dropping:
            yield line
