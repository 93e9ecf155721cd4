"""The life of one classifying request, whatever its protocol: is the service serving, the
deadline, the limits, which model or cascade, classify, hold a refusal, watch for a
disconnect, and the errors each refusal becomes. Routes only translate their wire format."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from api.http.errors import (
    ClientGone,
    DeadlineExceeded,
    InferenceFailed,
    InvalidInput,
    NonFiniteAnswer,
    NotFound,
    Overloaded,
    ServiceError,
    Unavailable,
)
from api.http.state import RETRY_AFTER_LOADING_SECONDS, ServiceState
from api.models.predictor import NonFiniteScores, UnservableText
from api.models.registry import UnknownName
from api.observability import record
from api.serving.admission import NotAdmitted
from api.serving.batching import BatchFailed, QueueFull
from api.serving.batching import DeadlineExceeded as BatchDeadline
from api.serving.cache import ResultCache
from api.serving.cache.tiers import DEFAULT_TIER_NAMES
from api.serving.cascade import CASCADE_NAME, Cascade
from api.serving.classify import Classified, ModelRunner
from api.settings import Settings

RETRY_SOON = {"Retry-After": "1"}
TIMEOUT_HEADER = "X-Request-Timeout"
WATCH_AFTER_SECONDS = 0.1  # a request's wait before its client is watched for a disconnect
Answer = TypeVar("Answer")


@dataclass(frozen=True)
class Call:
    """What a protocol asks, once its wire format is read: which model (None: the first, or
    the cascade by its name) and adapter, the texts, truncation, and whether caches serve."""

    model: str | None
    adapter: str | None
    texts: list[str]
    truncate: bool = True
    use_cache: bool = True


async def handle(request: Request, state: ServiceState, call: Call) -> Done:
    """The one lifecycle of a classifying request: serving, deadline, limits, classify.
    Every refusal comes out as an HTTP error of api.http.errors."""
    check_serving(state)
    # The one deadline of this request: every stage (the cascade's two included) shares it.
    deadline = time.monotonic() + request_timeout(request, state.settings.request_timeout_seconds)
    check_limits(call.texts, state)
    if state.model_side is not None:  # a front end of the split: the model side classifies
        return await answer(request, state.model_side.classify(call, deadline))
    cache = state.cache if call.use_cache else None
    return await classify(
        request, state, call.model, call.adapter, call.texts, call.truncate, cache, deadline
    )


def check_serving(state: ServiceState) -> None:
    """503 with `Retry-After` unless the service is ready (loading, draining, failed)."""
    if not state.serving:
        raise Unavailable(
            f"service is {state.phase.value}", {"Retry-After": RETRY_AFTER_LOADING_SECONDS}
        )


@dataclass
class Done:
    """What `classify` gives a route: the scores, who answered each text, the labels."""

    result: Classified
    answered_by: list[str]
    labels: list[str]
    adapter: str | None  # the adapter of a single model; None for the cascade
    cascade: bool
    cache_tiers: Sequence[str]  # the tiers X-Cache names, in order

    def headers(self, model: str) -> dict[str, str]:
        """The response headers every protocol sends: model, who answered, cache tiers."""
        headers = {
            "X-Model": model,
            "X-Answered-By": ",".join(self.answered_by),
            "X-Cache": self.result.cache_header(self.cache_tiers),
        }
        if not self.cascade:
            headers["X-Adapter"] = self.adapter or ""
        return headers


async def classify(
    request: Request | None,
    state: ServiceState,
    model: str | None,
    adapter: str | None,
    texts: list[str],
    truncate: bool,
    cache: ResultCache | None,
    deadline: float,
) -> Done:
    """One model (None: the first) or the cascade scores `texts` (limits already checked),
    and the predictions are counted; refusals come out as HTTP errors. Every protocol's
    classifying route goes through here, and the split's model side (api.http.split), which
    has no `request` to watch: its front end watches the client and cancels the call."""
    if model == CASCADE_NAME:
        cascade = pick_cascade(state, adapter)
        labels = cascade.first.served.loaded.labels
        work = cascade.classify(texts, truncate, cache, deadline)
        adapters = {r.served.name: r.served.adapter_for(None) for r in cascade.runners}
        record.note_call(CASCADE_NAME, None, len(texts))
    else:
        runner, adapter = pick_runner(state, model, adapter)
        labels = runner.served.loaded.labels
        work = single(runner, texts, adapter, truncate, cache, deadline)
        adapters = {runner.served.name: adapter}
        record.note_call(runner.served.name, adapter, len(texts))
    try:
        result, answered_by = await answer(request, work)
    except Overloaded:
        await hold_refusal(state.settings.refusal_delay_seconds, deadline)
        raise
    metrics = state.metrics
    for name in set(answered_by):
        chosen = adapters[name] or "none"
        metrics.labelled(metrics.predictions, name, chosen).inc(answered_by.count(name))
    tiers = DEFAULT_TIER_NAMES if state.cache is None else state.cache.tier_names
    record.note_cache(result.tiers, tiers)
    return Done(result, answered_by, labels, adapter, model == CASCADE_NAME, tiers)


def pick_runner(
    state: ServiceState, model: str | None, adapter: str | None
) -> tuple[ModelRunner, str | None]:
    """The named model's runner and the adapter the request gets; 404 for unknown names."""
    try:
        runner = state.runners[state.registry.get(model).name]
        return runner, runner.served.adapter_for(adapter)
    except UnknownName as exc:
        raise NotFound(str(exc)) from None


def pick_cascade(state: ServiceState, adapter: str | None) -> Cascade:
    """The cascade, which uses each model's default adapter."""
    if state.cascade is None:
        raise NotFound(f"no {CASCADE_NAME!r}: it needs two models")
    if adapter is not None:
        raise InvalidInput("the cascade uses each model's default adapter: send no adapter")
    return state.cascade


async def single(
    runner: ModelRunner,
    texts: list[str],
    adapter: str | None,
    truncate: bool,
    cache: ResultCache | None,
    deadline: float,
) -> tuple[Classified, list[str]]:
    """One model answers every text."""
    result = await runner.classify(texts, adapter, truncate, cache, deadline)
    return result, [runner.served.name] * len(texts)


async def answer(request: Request | None, work: Coroutine[Any, Any, Answer]) -> Answer:
    """Runs the work (until `request`'s client goes, unless None); the batcher's and
    tokenizer's refusals become HTTP errors."""
    try:
        return await (work if request is None else until_disconnect(request, work))
    except Exception as exc:
        error = service_error(exc)
        if error is None:
            raise
        raise error from None


def service_error(exc: Exception) -> ServiceError | None:
    """The error a client gets for a refusal of the batcher or tokenizer; None for others."""
    if isinstance(exc, UnservableText):
        return InvalidInput(str(exc))
    if isinstance(exc, NonFiniteScores):
        return NonFiniteAnswer(str(exc))
    if isinstance(exc, QueueFull):
        return Overloaded(f"model is busy: {exc}", RETRY_SOON)
    if isinstance(exc, NotAdmitted):
        return Overloaded(f"model is busy: {exc}", {"Retry-After": str(exc.retry_after)})
    if isinstance(exc, BatchDeadline):
        return DeadlineExceeded(str(exc))
    if isinstance(exc, BatchFailed):
        return InferenceFailed(f"inference failed: {exc}", RETRY_SOON)
    if isinstance(exc, UnknownName):  # an adapter unloaded between the route's check and its batch
        return NotFound(str(exc))
    return None


async def hold_refusal(delay: float, deadline: float) -> None:
    """Waits `delay` seconds (at most until `deadline`) before a 429 goes out.

    A client that retries at once, whatever Retry-After says, would otherwise get its next
    refusal within a millisecond: 128 such clients kept the event loop busy on refusals
    alone, and the forwards, sharing its cores and the GIL, ran at an eighth to a fifth of
    their speed. Held, each client costs one refusal per `delay`.
    """
    await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))


async def until_disconnect(request: Request, work: Coroutine[Any, Any, Answer]) -> Answer:
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


def request_timeout(request: Request, limit: float) -> float:
    """The client's `X-Request-Timeout` (seconds) where it sends one shorter than `limit`."""
    sent = request.headers.get(TIMEOUT_HEADER)
    if sent is None:
        return limit
    try:
        seconds = float(sent)
    except ValueError:
        raise InvalidInput(f"{TIMEOUT_HEADER}: not a number of seconds") from None
    if not 0 < seconds < float("inf"):
        raise InvalidInput(f"{TIMEOUT_HEADER}: must be a positive number of seconds")
    return min(seconds, limit)


def check_limits(texts: list[str], state: ServiceState) -> None:
    """Count and length limits, checked before any tokenizing."""
    settings = state.settings
    if len(texts) > settings.max_texts_per_request:
        raise InvalidInput(
            f"{len(texts)} texts in one request; at most {settings.max_texts_per_request}"
        )
    check_lengths(texts, settings)


def check_lengths(texts: list[str], settings: Settings) -> None:
    """The length limit of each text, in characters, checked before any tokenizing."""
    for index, text in enumerate(texts):
        if len(text) > settings.max_text_chars:
            raise InvalidInput(
                f"inputs[{index}] has {len(text)} characters; at most {settings.max_text_chars}"
            )
