"""An ASGI middleware that refuses bodies over a byte limit, chunked ones included."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.http.errors import BadRequest, PayloadTooLarge, response_for
from api.http.lengths import parse_length


class BodySizeLimit:
    """Reads the body up to `max_bytes` before the app sees it; past that, answers 413.

    A Content-Length check alone is not enough: a chunked body carries no length.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            length = parse_length(declared)
            if length is None:
                # uvicorn's parsers refuse such a request before the app; another server
                # may pass it on. The body's end is unknown: the connection cannot be reused.
                refusal = BadRequest("Content-Length: not a length", {"Connection": "close"})
                await response_for(refusal, scope["path"])(scope, receive, send)
                return
            if length > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the client's disconnect

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body over {self.max_bytes} bytes"
        # The rest of the body is never read: close the connection rather than drain it.
        response = response_for(PayloadTooLarge(message, {"Connection": "close"}), scope["path"])
        await response(scope, receive, send)
