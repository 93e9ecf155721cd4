"""The model side of the split: the service process answers its front ends on SPLIT_SOCKET.

A front end's classifying request arrives as a call, which goes through the lifecycle's own
`classify` (which model, the cache tiers, tokenizing, admission, the batcher, the device) and
comes back as the scores, or as the refusal its HTTP error is made from. Every other request
(`/models`, `/ready`, the adapter routes, `/metrics`, the Open Inference Protocol's) arrives
whole and is answered by this process's own app, as if it had come over HTTP. The front end
has already checked the client's limits, key and body; the socket is the operator's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import httpx
from starlette.types import ASGIApp

from api.http import lifecycle
from api.http.errors import ServiceError
from api.http.split.wire import BrokenMessage, framed, read_message, to_bytes, to_text
from api.http.state import ServiceState
from api.observability import tracing
from api.observability.record import CURRENT, RequestRecord
from api.serving.per_turn import PerTurn

logger = logging.getLogger(__name__)

CLASSIFY_ROUTE = "/predict"  # the route a call's log lines name: the front end's own differ


class ModelSide:
    """Listens on `path` for front ends, answering each call as one-process serving would."""

    def __init__(self, app: ASGIApp, state: ServiceState, path: Path) -> None:
        self.state = state
        self.path = path
        # raise_app_exceptions off: a route's failure is the 500 the app writes, as over HTTP.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self.forwarder = httpx.AsyncClient(transport=transport, base_url="http://model-side")
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, str(self.path))
        logger.info("answering front ends on %s", self.path)

    async def close(self) -> None:
        """Stops listening and drops the front ends' connections (their calls with them)."""
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        await self.forwarder.aclose()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = asyncio.current_task()
        assert connection is not None
        self.connections.add(connection)
        replies: PerTurn[list[Any]] = PerTurn(lambda turn: _send(writer, turn))
        running: dict[int, asyncio.Task[None]] = {}
        try:
            while True:
                for call in await read_message(reader):
                    self._take(call, running, replies)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if isinstance(exc, BrokenMessage):
                logger.error("a front end sent %s; its connection is closed", exc)
        finally:
            # The front end has gone: its calls have no client left to answer.
            for task in running.values():
                task.cancel()
            writer.close()
            self.connections.discard(connection)

    def _take(
        self, call: Any, running: dict[int, asyncio.Task[None]], replies: PerTurn[list[Any]]
    ) -> None:
        if not (isinstance(call, list) and len(call) >= 2 and isinstance(call[1], int)):
            raise BrokenMessage(f"a call that is not [kind, number, ...]: {call!r:.200}")
        kind, number = call[0], call[1]
        if kind == "cancel":
            task = running.get(number)
            if task is not None:
                task.cancel()
            return
        if kind == "classify":
            work = self._classify(number, call[2:], replies)
        elif kind == "forward":
            work = self._forward(number, call[2:], replies)
        else:
            raise BrokenMessage(f"a call of unknown kind {kind!r:.50}")
        task = asyncio.create_task(work)
        running[number] = task
        task.add_done_callback(lambda _: running.pop(number, None))

    async def _classify(self, number: int, call: list[Any], replies: PerTurn[list[Any]]) -> None:
        request_id, model, adapter, texts, truncate, use_cache, seconds_left, trace = call
        deadline = time.monotonic() + seconds_left
        # Its log lines carry the front end's id for the request.
        CURRENT.set(RequestRecord(request_id, "POST", CLASSIFY_ROUTE, CLASSIFY_ROUTE))
        state = self.state
        holds_drain = state.hold_drain()  # as for requests: the drain waits for the call
        try:
            lifecycle.check_serving(state)
            cache = state.cache if use_cache else None
            with tracing.continued("classify", trace):
                done = await lifecycle.classify(
                    None, state, model, adapter, texts, truncate, cache, deadline
                )
        except ServiceError as exc:
            replies.add([number, "refused", type(exc).__name__, exc.message, exc.headers])
            return
        except Exception as exc:  # what one process answers with a 500
            logger.exception("a front end's call failed")
            replies.add([number, "failed", f"{type(exc).__name__}: {exc}"])
            return
        finally:
            state.release_drain(holds_drain)
        result = done.result
        scores = [[s.probabilities, s.logits] for s in result.scores]
        answered = [number, "done", scores, result.tiers, done.answered_by, done.labels]
        replies.add([*answered, done.adapter, done.cascade, list(done.cache_tiers)])

    async def _forward(self, number: int, call: list[Any], replies: PerTurn[list[Any]]) -> None:
        method, path, query, headers, body = call
        url = httpx.URL(path=path, query=to_bytes(query))
        try:
            response = await self.forwarder.request(
                method, url, headers=[tuple(pair) for pair in headers], content=to_bytes(body)
            )
        except Exception as exc:
            logger.exception("a forwarded request failed")
            replies.add([number, "failed", f"{type(exc).__name__}: {exc}"])
            return
        answer_headers = [[to_text(k), to_text(v)] for k, v in response.headers.raw]
        answer_body = to_text(response.content)
        replies.add([number, "forwarded", response.status_code, answer_headers, answer_body])


def _send(writer: asyncio.StreamWriter, replies: list[list[Any]]) -> None:
    if not writer.is_closing():
        writer.write(framed(replies))
