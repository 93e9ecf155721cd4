"""A front end of the split (`loraserve front-end`): the service's HTTP in a process of its
own, with the models' process (`loraserve` with the same SPLIT_SOCKET) behind one Unix socket.

`/predict` runs here through the lifecycle every route shares (is the service serving, the
deadline, the limits, the disconnect watch), with `classify` done by the model side; `/health`
is this process's own; `/metrics` is the model side's, with the request families (counted
here, where every request arrives) and this process's own process metrics. Every other
request is answered by the model side's app, forwarded whole.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry, Metric, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from api import __version__
from api.http import errors
from api.http.app import install_middleware
from api.http.errors import DeadlineExceeded, ServiceError, Unavailable, install_error_handlers
from api.http.lifecycle import Call, Done
from api.http.routes import status, tei
from api.http.routes.common import state_of
from api.http.schemas import HealthResponse
from api.http.split.wire import BrokenMessage, framed, read_message, to_bytes, to_text
from api.http.state import Phase, ServiceState
from api.metrics import PREFIX, REQUEST_FAMILIES, Metrics
from api.models.predictor import Scores
from api.models.registry import Registry
from api.observability import record, tracing
from api.observability.record import CURRENT
from api.observability.request_id import HEADER, new_request_id
from api.serving.classify import Classified
from api.serving.heap import ServingHeap
from api.serving.per_turn import PerTurn
from api.settings import Settings

logger = logging.getLogger(__name__)

RETRY_SOON = {"Retry-After": "1"}
# A call's answer is awaited this long past its request's deadline, by which the model side
# answers 504 itself: what is missing then is the model side (stuck, or its socket).
HOP_GRACE_SECONDS = 1.0
# A forwarded request's wait: the model side's other routes answer at once, or load an
# adapter (seconds); past this the model side is taken to be stuck (504).
FORWARD_TIMEOUT_SECONDS = 60.0
# Not passed on: the connection's own (the hop has its own), and the request id, which the
# front end's record decides and the model side then uses.
NOT_FORWARDED = frozenset({"host", "connection", "content-length", "transfer-encoding"})
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
FORWARD_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
_REQUEST_ID = HEADER.lower()


class ModelSideLink:
    """The front end's one connection to the model side, opened on first use and again after
    a loss. A turn's calls go out as one message; a reader task settles each call's future
    from the replies. A call whose request is cancelled (its client went) is cancelled on the
    model side too; a lost connection answers every call waiting on it with a 503."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.numbers = itertools.count()
        self.waiting: dict[int, asyncio.Future[list[Any]]] = {}
        self.writer: asyncio.StreamWriter | None = None
        self.reading: asyncio.Task[None] | None = None
        self.connecting = asyncio.Lock()
        self.calls: PerTurn[list[Any]] = PerTurn(self._send)

    async def classify(self, call: Call, deadline: float) -> Done:
        """`call` scored by the model side, by `deadline` (its refusals raised as here)."""
        sent = [_request_id(), call.model, call.adapter, call.texts, call.truncate, call.use_cache]
        # Seconds left, not the deadline itself: the two processes need not share a clock.
        seconds_left = deadline - time.monotonic()
        trace = tracing.outgoing()
        reply = await self._ask(
            "classify", [*sent, seconds_left, trace], deadline + HOP_GRACE_SECONDS
        )
        scores, tiers, answered_by, labels, adapter, cascade, cache_tiers = reply
        result = Classified([Scores(tuple(p), tuple(raw)) for p, raw in scores], tiers)
        done = Done(result, answered_by, labels, adapter, cascade, cache_tiers)
        record.note_call(call.model or answered_by[0], adapter, len(call.texts))
        record.note_cache(tiers, cache_tiers)
        return done

    async def forward(
        self, method: str, path: str, query: bytes, headers: list[list[str]], body: bytes
    ) -> tuple[int, list[list[str]], bytes]:
        """A whole request answered by the model side's app: status, headers, body."""
        sent = [method, path, to_text(query), headers, to_text(body)]
        give_up_at = time.monotonic() + FORWARD_TIMEOUT_SECONDS
        status_code, answer_headers, answer_body = await self._ask("forward", sent, give_up_at)
        return status_code, answer_headers, to_bytes(answer_body)

    async def close(self) -> None:
        if self.reading is not None:
            self.reading.cancel()
            await asyncio.gather(self.reading, return_exceptions=True)

    async def _ask(self, kind: str, call: list[Any], give_up_at: float) -> list[Any]:
        if self.writer is None:
            await self._connect()
        loop = asyncio.get_running_loop()
        number = next(self.numbers)
        reply: asyncio.Future[list[Any]] = loop.create_future()
        self.waiting[number] = reply
        self.calls.add([kind, number, *call])
        timer = loop.call_later(max(0.0, give_up_at - time.monotonic()), self._expire, number)
        try:
            found = await reply
        except (asyncio.CancelledError, DeadlineExceeded):
            # No answer came and none is awaited now (its client went, or its time ran out):
            # the model side drops the call's texts from its queue.
            self.waiting.pop(number, None)
            if self.writer is not None:
                self.calls.add(["cancel", number])
            raise
        finally:
            timer.cancel()
        outcome = found[1]
        if outcome == "refused":
            raise _refusal(found[2], found[3], found[4])
        if outcome == "failed":
            raise RuntimeError(f"the model side failed: {found[2]}")
        return found[2:]

    def _expire(self, number: int) -> None:
        reply = self.waiting.pop(number, None)
        if reply is not None and not reply.done():
            reply.set_exception(DeadlineExceeded("the model side did not answer in time"))

    async def _connect(self) -> None:
        async with self.connecting:  # the first calls all wait for the one connection
            if self.writer is not None:
                return
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.path))
            except OSError as exc:
                raise Unavailable(f"the model side is not reachable: {exc}", RETRY_SOON) from None
            self.writer = writer
            self.reading = asyncio.get_running_loop().create_task(self._read(reader, writer))
            logger.info("connected to the model side on %s", self.path)

    def _send(self, calls: list[list[Any]]) -> None:
        # A writer gone since the calls were added: the loss has failed their futures already.
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(framed(calls))

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reason = None  # cancelled: this front end is stopping
        try:
            while True:
                for reply in await read_message(reader):
                    waiting = self.waiting.pop(reply[0], None)
                    if waiting is not None and not waiting.done():
                        waiting.set_result(reply)
        except asyncio.IncompleteReadError:
            reason = "the model side closed the connection"
        except (ConnectionError, BrokenMessage, LookupError, TypeError) as exc:
            reason = f"the connection to the model side broke: {exc}"
        finally:
            self._lost(writer, reason)

    def _lost(self, writer: asyncio.StreamWriter, reason: str | None) -> None:
        """Every call waiting on `writer`'s connection answered 503; the next reconnects.
        `reason`: why the connection was lost; None when this front end closed it."""
        if self.writer is writer:
            self.writer = None
        writer.close()
        waiting, self.waiting = self.waiting, {}
        if reason is None:
            reason = "this front end is stopping"
        else:
            logger.error("%s; the %d calls waiting answered 503", reason, len(waiting))
        for reply in waiting.values():
            if not reply.done():
                reply.set_exception(Unavailable(f"{reason}; try again", RETRY_SOON))


def _request_id() -> str:
    """The current request's id (its record's), which the model side logs it under."""
    current = CURRENT.get()
    return new_request_id() if current is None else current.request_id


def _refusal(name: str, message: str, headers: dict[str, str]) -> ServiceError:
    """The model side's refusal as the error it is there (ServiceError for a name not known)."""
    kind = getattr(errors, name, None)
    if not (isinstance(kind, type) and issubclass(kind, ServiceError)):
        kind = ServiceError
    return kind(message, headers)


# --- the front end's app --------------------------------------------------------------------


def create_front_end_app(settings: Settings) -> FastAPI:
    """`/predict` (TEI's and the Inference API's), `/health`, the merged `/metrics`, and every
    other path forwarded to the model side on `settings.split_socket`."""
    if settings.split_socket is None:
        raise ValueError("a front end needs SPLIT_SOCKET: the model side's socket")
    metrics = Metrics(settings.latency_target_seconds)
    state = ServiceState(settings=settings, registry=Registry([], settings), metrics=metrics)
    link = ModelSideLink(settings.split_socket)
    state.model_side = link
    own_metrics = CollectorRegistry()
    own_metrics.register(_Families(metrics.registry, REQUEST_FAMILIES))
    ProcessCollector(namespace=f"{PREFIX}_front_end", registry=own_metrics)

    # Its imports are the service's (torch's included): frozen as the service's start-up is,
    # or a full collection walks them all, a pause of a tenth of a second under load.
    heap = ServingHeap(settings.gc_gen0_threshold)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        heap.settle()
        state.phase = Phase.READY  # nothing to load: whether the models are is /ready's
        try:
            yield
        finally:
            state.phase = Phase.DRAINING
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
    app.state.service = state
    install_error_handlers(app)
    app.include_router(tei.router)
    app.add_api_route("/health", status.health, methods=["GET"], response_model=HealthResponse)

    async def merged_metrics(request: Request) -> Response:
        accept = request.headers.get("accept", "")
        encode, content_type = choose_encoder(accept)
        # Without the model side, the front end's own: its 503s are what is happening then.
        model_side = ""
        try:
            code, _, body = await link.forward("GET", "/metrics", b"", [["accept", accept]], b"")
        except ServiceError as exc:
            logger.warning("/metrics without the model side's families: %s", exc.message)
        else:
            if code == 200:
                model_side = without_families(body.decode(), REQUEST_FAMILIES)
            else:
                logger.warning("/metrics without the model side's: its /metrics answered %d", code)
        merged = model_side + encode(own_metrics).decode()
        return Response(merged, headers={"Content-Type": content_type})

    async def forward(request: Request) -> Response:
        # The model side's span of it continues the front end's trace, not the client's.
        trace = tracing.outgoing()
        dropped = NOT_FORWARDED | {_REQUEST_ID} | (TRACE_HEADERS if trace else frozenset())
        headers = [[to_text(k), to_text(v)] for k, v in request.headers.raw]
        headers = [[k, v] for k, v in headers if k.lower() not in dropped]
        headers += [[k, v] for k, v in trace.items()]
        scope = request.scope
        code, answer_headers, body = await state_of(request).model_side.forward(  # type: ignore[union-attr]
            request.method,
            scope["path"],
            scope["query_string"],
            [*headers, [_REQUEST_ID, _request_id()]],
            await request.body(),
        )
        response = Response(body, code)
        response.raw_headers = [
            (to_bytes(k), to_bytes(v)) for k, v in answer_headers if k.lower() != _REQUEST_ID
        ]
        return response

    app.add_api_route("/metrics", merged_metrics, methods=["GET"], include_in_schema=False)
    app.add_api_route("/{path:path}", forward, methods=FORWARD_METHODS, include_in_schema=False)
    install_middleware(app, state, [tei.router])
    return app


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
