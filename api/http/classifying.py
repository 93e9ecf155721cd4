"""How an HTTP request reaches a service's classify, whatever its protocol: the client's
`X-Request-Timeout`, the watch for its disconnect, and the headers every answer carries.
Routes only translate their wire format; the lifecycle itself is the service's."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

from api.http.errors import ClientGone
from api.service.contract import Answer, Classifier, ClassifyRequest
from api.serving.errors import InvalidInput

TIMEOUT_HEADER = "X-Request-Timeout"
# The positions of the texts answered outside the model's declared languages.
OUTSIDE_LANGUAGES_HEADER = "X-Outside-Languages"
WATCH_AFTER_SECONDS = 0.1  # a request's wait before its client is watched for a disconnect
Result = TypeVar("Result")


async def classify(
    request: Request,
    service: Classifier,
    texts: list[str],
    model: str | None,
    adapter: str | None,
    truncate: bool = True,
    use_cache: bool = True,
) -> Answer:
    """`texts` classified by `service` for `request`, until its client goes (ClientGone)."""
    call = ClassifyRequest(texts, model, adapter, truncate, use_cache, request_timeout(request))
    return await until_disconnect(request, service.classify(call))


def answer_headers(answer: Answer, model: str) -> dict[str, str]:
    """The response headers every protocol sends: model, who answered, cache tiers."""
    headers = {
        "X-Model": model,
        "X-Answered-By": ",".join(answer.answered_by),
        "X-Cache": answer.result.cache_header(answer.cache_tiers),
    }
    if not answer.cascade:
        headers["X-Adapter"] = answer.adapter_header
    if answer.outside_languages:  # answered all the same, as the model's models file says
        headers[OUTSIDE_LANGUAGES_HEADER] = ",".join(map(str, answer.outside_languages))
    return headers


def request_timeout(request: Request) -> float | None:
    """The client's `X-Request-Timeout` (seconds), if it sends one; the service cuts it to
    its own limit."""
    sent = request.headers.get(TIMEOUT_HEADER)
    if sent is None:
        return None
    try:
        seconds = float(sent)
    except ValueError:
        raise InvalidInput(f"{TIMEOUT_HEADER}: not a number of seconds") from None
    if not 0 < seconds < float("inf"):
        raise InvalidInput(f"{TIMEOUT_HEADER}: must be a positive number of seconds")
    return seconds


async def until_disconnect(request: Request, work: Coroutine[Any, Any, Result]) -> Result:
    """Runs `work` unless the client goes first; then it is cancelled, and its queued texts
    are dropped unrun (uvicorn itself does not cancel a handler whose client has gone).

    The work runs in this task. A watcher task, which cancels it on a disconnect, starts only
    once the work has taken `WATCH_AFTER_SECONDS`: most requests are answered sooner, and a
    task each (its receive, its cancellation) cost ~5 % of the event loop's CPU on a one-text
    request. A client gone before then is seen as soon as the watcher starts (uvicorn keeps
    the disconnect for the next receive), while its texts still wait in a queue that long.
    """
    handler = asyncio.current_task()
    assert handler is not None
    gone = asyncio.Event()
    loop = asyncio.get_running_loop()
    watcher: asyncio.Task[None] | None = None

    def watch() -> None:
        nonlocal watcher
        watcher = loop.create_task(_cancel_on_disconnect(request, handler, gone))

    timer = loop.call_later(WATCH_AFTER_SECONDS, watch)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone.is_set():
            raise  # cancelled for another reason (the server stopping): not ours to swallow
        handler.uncancel()
        raise ClientGone("client disconnected") from None
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


async def _cancel_on_disconnect(
    request: Request, handler: asyncio.Task[Any], gone: asyncio.Event
) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()
    handler.cancel()
