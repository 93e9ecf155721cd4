"""The service core as a front end of the split reaches it: one connection to the model
side (`loraserve` with the same SPLIT_SOCKET), and a stand-in for the core's classify that
checks what it can here and has the model side's core answer."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from pathlib import Path

from api.http.split.messages import (
    MAX_BUFFERED_BYTES,
    PROTOCOL_VERSION,
    Answered,
    Call,
    Cancel,
    Classify,
    Failed,
    Forward,
    Forwarded,
    Hello,
    Refused,
    Reply,
    framed,
    read_hello,
    read_replies,
)
from api.metrics import Metrics
from api.models.predictor import Scores
from api.observability import record, tracing
from api.observability.record import CURRENT
from api.observability.request_id import new_request_id
from api.service.contract import Answer, ClassifyRequest, Lifecycle
from api.service.core import RETRY_SOON_SECONDS, check_limits
from api.serving.classify import Classified
from api.serving.errors import DeadlineExceeded, Unavailable, refusal
from api.serving.per_turn import PerTurn
from api.settings import Settings

logger = logging.getLogger(__name__)

# A call's answer is awaited this long past its request's deadline, by which the model side
# answers 504 itself: what is missing then is the model side (stuck, or its socket).
HOP_GRACE_SECONDS = 1.0
# A forwarded request's wait: the model side's other routes answer at once, or load an
# adapter (seconds); past this the model side is taken to be stuck (504).
FORWARD_TIMEOUT_SECONDS = 60.0
# A model side answers a front end's Hello at once; one that does not is stopped or wedged.
HELLO_SECONDS = 5.0


class ModelSideStalled(Unavailable):
    """The model side is there but does not read (stopped, wedged): its greeting does not
    come, or the calls waiting for it to read pass the bound."""


class ModelSideLink:
    """The front end's one connection to the model side, opened on first use and again after
    a loss, with a Hello each way first. A turn's calls go out as one message; a reader task
    settles each call's future from the replies. A call whose request is cancelled (its client
    went) is cancelled on the model side too; a lost connection answers every call waiting on
    it with Unavailable."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.numbers = itertools.count()
        self.waiting: dict[int, asyncio.Future[Reply]] = {}
        self.writer: asyncio.StreamWriter | None = None
        self.reading: asyncio.Task[None] | None = None
        self.connecting = asyncio.Lock()
        self.calls: PerTurn[Call] = PerTurn(self._send)

    async def classify(self, request: ClassifyRequest, seconds_left: float) -> Answered:
        """`request` answered by the model side within `seconds_left` (its refusals raised)."""
        number = next(self.numbers)
        call = Classify(
            number,
            current_request_id(),
            request.model,
            request.adapter,
            request.texts,
            request.truncate,
            request.use_cache,
            # Seconds left, not the deadline itself: the two processes need not share a clock.
            seconds_left,
            tracing.outgoing(),
        )
        reply = await self._ask(call, time.monotonic() + seconds_left + HOP_GRACE_SECONDS)
        assert isinstance(reply, Answered)
        return reply

    async def forward(
        self, method: str, path: str, query: bytes, headers: list[tuple[str, str]], body: bytes
    ) -> Forwarded:
        """A whole request answered by the model side's app: status, headers, body."""
        call = Forward(next(self.numbers), method, path, query, headers, body)
        reply = await self._ask(call, time.monotonic() + FORWARD_TIMEOUT_SECONDS)
        assert isinstance(reply, Forwarded)
        return reply

    def abandon(self, reason: str) -> None:
        """Answers every call still waiting with Unavailable for `reason` now, and cancels it
        on the model side (whose queue then drops its texts)."""
        waiting, self.waiting = self.waiting, {}
        for number, reply in waiting.items():
            if not reply.done():
                reply.set_exception(Unavailable(reason, RETRY_SOON_SECONDS))
                if self.writer is not None:
                    self.calls.add(Cancel(number))

    async def close(self) -> None:
        if self.reading is not None:
            self.reading.cancel()
            await asyncio.gather(self.reading, return_exceptions=True)

    async def _ask(self, call: Classify | Forward, give_up_at: float) -> Reply:
        if self.writer is None:
            await self._connect()
        writer = self.writer
        if writer is not None and writer.transport.get_write_buffer_size() > MAX_BUFFERED_BYTES:
            # The model side has stopped reading (stalled, stopped): no more for it to hold.
            raise ModelSideStalled(
                "the model side is not reading its calls; try again", RETRY_SOON_SECONDS
            )
        loop = asyncio.get_running_loop()
        number = call.number
        reply: asyncio.Future[Reply] = loop.create_future()
        self.waiting[number] = reply
        self.calls.add(call)
        timer = loop.call_later(max(0.0, give_up_at - time.monotonic()), self._expire, number)
        try:
            found = await reply
        except (asyncio.CancelledError, DeadlineExceeded):
            # No answer came and none is awaited now (its client went, or its time ran out):
            # the model side drops the call's texts from its queue.
            self.waiting.pop(number, None)
            if self.writer is not None:
                self.calls.add(Cancel(number))
            raise
        finally:
            timer.cancel()
        if isinstance(found, Refused):
            raise refusal(found.code, found.message, found.retry_after_seconds)
        if isinstance(found, Failed):
            raise RuntimeError(f"the model side failed: {found.description}")
        return found

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
                raise Unavailable(
                    f"the model side is not reachable: {exc}", RETRY_SOON_SECONDS
                ) from None
            try:
                writer.write(framed([Hello(PROTOCOL_VERSION)]))
                hello = await asyncio.wait_for(read_hello(reader), HELLO_SECONDS)
            except TimeoutError:
                writer.close()
                raise ModelSideStalled(
                    "the model side did not answer this front end's greeting", RETRY_SOON_SECONDS
                ) from None
            except (OSError, asyncio.IncompleteReadError) as exc:
                writer.close()
                raise Unavailable(
                    f"the model side did not greet this front end: {exc}", RETRY_SOON_SECONDS
                ) from None
            if hello.version != PROTOCOL_VERSION:
                writer.close()
                message = (
                    f"the model side speaks the split's version {hello.version}, this front "
                    f"end {PROTOCOL_VERSION}: run the same release on both sides"
                )
                logger.error("%s", message)
                raise Unavailable(message, RETRY_SOON_SECONDS)
            self.writer = writer
            self.reading = asyncio.get_running_loop().create_task(self._read(reader, writer))
            logger.info("connected to the model side on %s", self.path)

    def _send(self, calls: list[Call]) -> None:
        # A writer gone since the calls were added: the loss has failed their futures already.
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(framed(calls))

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reason = None  # cancelled: this front end is stopping
        try:
            while True:
                for reply in await read_replies(reader):
                    waiting = self.waiting.pop(reply.number, None)
                    if waiting is not None and not waiting.done():
                        waiting.set_result(reply)
        except asyncio.IncompleteReadError:
            reason = "the model side closed the connection"
        except ConnectionError as exc:  # BrokenMessage included
            reason = f"the connection to the model side broke: {exc}"
        finally:
            self._lost(writer, reason)

    def _lost(self, writer: asyncio.StreamWriter, reason: str | None) -> None:
        """Every call waiting on `writer`'s connection answered Unavailable; the next
        reconnects. `reason`: why the connection was lost; None when this front end closed it."""
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
                reply.set_exception(Unavailable(f"{reason}; try again", RETRY_SOON_SECONDS))


class RemoteService(Lifecycle):
    """The service core as a front end reaches it: `classify` checks the limits here and
    is answered by the model side over `link`. Its phase is this process's own: ready once
    started, draining on a signal (whether the models are loaded is the model side's /ready)."""

    def __init__(self, settings: Settings, link: ModelSideLink) -> None:
        super().__init__(Metrics(settings.latency_target_seconds))
        self.settings = settings
        self.link = link

    def abandon_unanswered(self, reason: str) -> None:
        """The calls still waiting for the model side answered 503 now (see the link)."""
        self.link.abandon(f"this front end stopped before answering: {reason}")

    async def classify(self, request: ClassifyRequest) -> Answer:
        """`request` scored by the model side, with the core's refusals."""
        self.check_serving()
        # The one deadline of this request, which the model side is told as seconds left.
        seconds = request.seconds_given(self.settings.request_timeout_seconds)
        check_limits(request.texts, self.settings)
        reply = await self.link.classify(request, seconds)
        result = Classified([Scores(p, raw) for p, raw in reply.scores], reply.tiers)
        record.note_call(request.model or reply.answered_by[0], reply.adapter, len(request.texts))
        record.note_cache(reply.tiers, reply.cache_tiers)
        return Answer(
            result,
            reply.answered_by,
            reply.labels,
            reply.adapter,
            reply.cascade,
            reply.cache_tiers,
            reply.text_adapters,
            reply.outside_languages,
        )


def current_request_id() -> str:
    """The current request's id (its record's), which the model side logs it under."""
    current = CURRENT.get()
    return new_request_id() if current is None else current.request_id
