"""The model side of the split: a socket door on the service core, answering its front ends
on SPLIT_SOCKET.

A front end's classifying request arrives as a Classify call, answered by the core's own
`classify` (which model, the cache tiers, tokenizing, admission, the batcher, the device),
and goes back as the scores or as the core's refusal, by its code. Every other request
(`/models`, `/ready`, the adapter routes, `/metrics`, the Open Inference Protocol's metadata
and probes) arrives whole and is answered by this process's own app, as if it had come over
HTTP; a call the front end cancels cancels the app's handling of it. The front end has
already checked the client's key and body; the socket is the operator's.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import httpx
from starlette.types import ASGIApp

from api.http.split.messages import (
    MAX_BUFFERED_BYTES,
    PROTOCOL_VERSION,
    Answered,
    BrokenMessage,
    Call,
    Cancel,
    Classify,
    Failed,
    Forward,
    Forwarded,
    Hello,
    Refused,
    Reply,
    Unreadable,
    framed,
    framed_replies,
    read_calls,
    read_hello,
)
from api.http.split.socket_claim import SocketClaim, peer_uid
from api.observability import tracing
from api.observability.record import CURRENT, RequestRecord
from api.service.contract import ClassifyRequest
from api.service.core import Service
from api.serving.errors import ServiceError
from api.serving.per_turn import PerTurn

logger = logging.getLogger(__name__)

CLASSIFY_ROUTE = "/predict"  # the route a call's log lines name: the front end's own differ


class ModelSide:
    """Listens on `path` for front ends, answering each call as one-process serving would:
    classifying with `service`, anything else with `app`. The socket is this process's from
    construction (SocketInUse if another live one holds it) until `close`; only front ends
    of this process's own user are answered."""

    def __init__(self, app: ASGIApp, service: Service, path: Path) -> None:
        self.service = service
        self.path = path
        self.claim = SocketClaim(path)
        self.uid = os.getuid()
        self.refused_uids: set[int] = set()
        # raise_app_exceptions off: a route's failure is the 500 the app writes, as over HTTP.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self.forwarder = httpx.AsyncClient(transport=transport, base_url="http://model-side")
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, sock=self.claim.bind())
        logger.info("answering front ends on %s", self.path)

    async def close(self) -> None:
        """Stops listening and drops the front ends' connections (their calls with them)."""
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        await self.forwarder.aclose()
        self.claim.release()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = asyncio.current_task()
        assert connection is not None
        self.connections.add(connection)
        replies: PerTurn[Reply] = PerTurn(lambda turn: _send(writer, turn))
        running: dict[int, asyncio.Task[None]] = {}
        try:
            uid = peer_uid(writer.get_extra_info("socket"))
            if uid != self.uid:
                if uid not in self.refused_uids:  # once: a peer retrying must not flood the log
                    self.refused_uids.add(uid)
                    logger.error(
                        "a front end of user %d refused on %s: only user %d's are answered",
                        uid,
                        self.path,
                        self.uid,
                    )
                return
            hello = await read_hello(reader)
            writer.write(framed([Hello(PROTOCOL_VERSION)]))
            if hello.version != PROTOCOL_VERSION:
                logger.error(
                    "a front end speaks the split's version %d, this model side %d; its "
                    "connection is closed",
                    hello.version,
                    PROTOCOL_VERSION,
                )
                return
            # Past the bound, drain() waits for the front end to read its replies before the
            # next calls are read: a front end that stops reading stops sending work.
            writer.transport.set_write_buffer_limits(high=MAX_BUFFERED_BYTES)
            told = False  # an unreadable call is logged once a connection: no flood
            while True:
                for call in await read_calls(reader):
                    if isinstance(call, Unreadable):
                        self._refuse_unreadable(call, replies, log=not told)
                        told = True
                    else:
                        self._take(call, running, replies)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if isinstance(exc, BrokenMessage):
                logger.error("a front end sent %s; its connection is closed", exc)
        finally:
            # The front end has gone: its calls have no client left to answer.
            for task in running.values():
                task.cancel()
            writer.close()
            self.connections.discard(connection)

    def _refuse_unreadable(self, call: Unreadable, replies: PerTurn[Reply], log: bool) -> None:
        """An unreadable call answered at once by its number (lost with none: the front end
        times it out); logged when `log` (the first on a connection)."""
        if log:
            logger.error(
                "a front end sent a call this model side cannot read (a release apart, or a "
                "broken message): %s; it is refused, and so is every such call",
                call.reason,
            )
        if call.number is not None:
            message = f"the model side could not read the call: {call.reason}"
            replies.add(Refused(call.number, "internal_error", message, None))

    def _take(
        self, call: Call, running: dict[int, asyncio.Task[None]], replies: PerTurn[Reply]
    ) -> None:
        if isinstance(call, Cancel):
            task = running.get(call.number)
            if task is not None:
                task.cancel()
            return
        if isinstance(call, Classify):
            work = self._classify(call, replies)
        else:
            work = self._forward(call, replies)
        number = call.number
        task = asyncio.create_task(work)
        running[number] = task
        task.add_done_callback(lambda _: running.pop(number, None))

    async def _classify(self, call: Classify, replies: PerTurn[Reply]) -> None:
        number = call.number
        # Its log lines carry the front end's id for the request.
        CURRENT.set(RequestRecord(call.request_id, "POST", CLASSIFY_ROUTE, CLASSIFY_ROUTE))
        service = self.service
        request = ClassifyRequest(
            call.texts, call.model, call.adapter, call.truncate, call.use_cache, call.seconds_left
        )
        holds_drain = service.hold_drain()  # as for requests: the drain waits for the call
        try:
            with tracing.continued("classify", call.trace):
                answer = await service.classify(request)
        except ServiceError as exc:
            replies.add(Refused(number, exc.code, exc.message, exc.retry_after_seconds))
            return
        except Exception as exc:  # what one process answers with a 500
            logger.exception("a front end's call failed")
            replies.add(Failed(number, f"{type(exc).__name__}: {exc}"))
            return
        finally:
            service.release_drain(holds_drain)
        result = answer.result
        replies.add(
            Answered(
                number,
                [(s.probabilities, s.logits) for s in result.scores],
                result.tiers,
                answer.answered_by,
                answer.labels,
                answer.adapter,
                answer.cascade,
                list(answer.cache_tiers),
                answer.text_adapters,
                answer.outside_languages,
            )
        )

    async def _forward(self, call: Forward, replies: PerTurn[Reply]) -> None:
        url = httpx.URL(path=call.path, query=call.query)
        try:
            response = await self.forwarder.request(
                call.method, url, headers=call.headers, content=call.body
            )
        except Exception as exc:
            logger.exception("a forwarded request failed")
            replies.add(Failed(call.number, f"{type(exc).__name__}: {exc}"))
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.headers.raw]
        replies.add(Forwarded(call.number, response.status_code, headers, response.content))


def _send(writer: asyncio.StreamWriter, replies: list[Reply]) -> None:
    if not writer.is_closing():
        writer.write(framed_replies(replies))
