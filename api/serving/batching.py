"""The dynamic batcher: many small requests become few forward passes, one at a time."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from opentelemetry.trace import SpanContext

from api.models import faults
from api.observability import tracing
from api.serving.batch_limits import BatchLimits
from api.serving.batch_plan import Work, planned_work
from api.serving.errors import DeadlineExceeded

logger = logging.getLogger(__name__)

Result = TypeVar("Result")
# The cost model weighs the oldest this many batches' worth of rows: later ones would not run
# for several turns anyway, and its dynamic programme runs in the event loop in
# O(rows × max_batch_size), too long a pause at a full queue (bench/reports/measured_in_tests.md,
# "Batch planning").
COST_MODEL_WINDOW_BATCHES = 4
# Per row, its result, or the exception that fails that row alone.
PredictBatch = Callable[[list[list[int]], list[str | None]], Sequence[Result | BaseException]]


class QueueFull(Exception):
    """The model's queue holds its maximum of requests."""


class BatchFailed(Exception):
    """The forward pass of the batch holding this request failed."""


class Stopped(Exception):
    """The service stopped before this row was answered (see `Batcher.abandon`)."""


class ShadowDropped(Exception):
    """A shadow row that was not scored, and why (see `Batcher.shadow`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"shadow row dropped: {reason}")
        self.reason = reason


@dataclass
class BatchStats:
    """What one run reported, for metrics."""

    rows: int
    tokens: int  # what the forward computes: padding counted unless packed
    queue_seconds: list[float]
    run_seconds: float
    # A forward raised (the batch failed, or ran out of memory and was split): its time is
    # no measure of what the batch costs.
    failed: bool = False


class Backlog(Protocol):
    """What a request about to be submitted would wait for, for admission. Each row counts
    once: one queued for another request, or abandoned by a client that has gone, is run
    once for all who send it; abandoned rows nobody sends again are dropped unrun."""

    @property
    def ahead(self) -> Work:
        """The rows queued for other requests."""
        ...

    @property
    def own(self) -> Work:
        """The request's rows that are neither running nor queued for others."""
        ...

    @property
    def total(self) -> Work:
        """`ahead` and `own`, batched together."""
        ...

    @property
    def running_tokens(self) -> int:
        """The batch on the device now (0: none)."""
        ...

    @property
    def running_seconds(self) -> float:
        """How long it has run so far."""
        ...


@dataclass(slots=True)
class QueuedBacklog:
    """A Backlog from the lengths of the rows queued (length: count), each planned the first
    time it is asked for: an admitted request needs `total` alone; `ahead` and `own` only a
    refused one (or one before any batch ran), so most requests plan the queue once, not
    three times. (Kept by hand, not by functools.cached_property, which takes a lock on
    every first access in Python 3.11.)"""

    ahead_lengths: dict[int, int]
    own_lengths: dict[int, int]
    limits: BatchLimits
    running_tokens: int
    running_seconds: float
    _ahead: Work | None = None
    _own: Work | None = None
    _total: Work | None = None

    @property
    def ahead(self) -> Work:
        if self._ahead is None:
            self._ahead = planned_work(self.ahead_lengths, self.limits)
        return self._ahead

    @property
    def own(self) -> Work:
        if self._own is None:
            self._own = planned_work(self.own_lengths, self.limits)
        return self._own

    @property
    def total(self) -> Work:
        if self._total is None:
            lengths = dict(self.ahead_lengths)
            for length, count in self.own_lengths.items():
                lengths[length] = lengths.get(length, 0) + count
            self._total = planned_work(lengths, self.limits)
        return self._total


@dataclass(eq=False)
class _Row(Generic[Result]):
    """One text to score; requests sending the same text share one row."""

    key: Hashable
    ids: list[int]
    adapter: str | None
    future: asyncio.Future[Result]
    enqueued: float
    deadline: float
    waiters: int = 0
    started: bool = False
    requests: list[_Request] = field(default_factory=list)
    shadow: bool = False  # no client waits for it (see Batcher.shadow)


@dataclass(eq=False)
class _Request:
    """One submitted request: its one future, set once every row it waits for is settled
    (answered, failed or dropped) or its time is up; how many of its rows are not answered
    yet, for the refill; with tracing on, its sampled span and when it was submitted, for its
    batches' spans."""

    rows: int
    done: asyncio.Future[None]
    trace: SpanContext | None = None
    submitted: float = 0.0
    unanswered: int = field(init=False)
    unsettled: int = field(init=False)

    def __post_init__(self) -> None:
        self.unanswered = self.unsettled = self.rows

    def settled(self) -> None:
        """One of its rows has its result or exception (or was dropped)."""
        self.unsettled -= 1
        if self.unsettled == 0 and not self.done.done():
            self.done.set_result(None)


@dataclass
class _Batch(Generic[Result]):
    packed: bool = False
    rows: list[_Row[Result]] = field(default_factory=list)
    longest: int = 0
    real_tokens: int = 0

    def add(self, row: _Row[Result]) -> None:
        self.rows.append(row)
        self.longest = max(self.longest, len(row.ids))
        self.real_tokens += len(row.ids)

    def tokens(self, extra: int = 0) -> int:
        """Tokens the forward computes, with a row of `extra` tokens added if not 0."""
        if self.packed:
            return self.real_tokens + extra
        return (len(self.rows) + (1 if extra else 0)) * max(self.longest, extra)


Observer = Callable[[BatchStats], None]


class Batcher(Generic[Result]):
    """Collects rows for one model and runs them through `predict_batch` in batches.

    It knows nothing of models: `predict_batch(rows, adapters)` may be any callable, which is
    how it is tested with a fake. Every batch runs in `executor`; batchers sharing a device
    share `device_slot`, so one batch at a time runs on each device. While a batch runs, new
    requests queue up and form the next batch, which grows with the load.

    A batch that runs out of memory is halved and retried; `on_out_of_memory` runs in
    `executor` before the retry, once the failed batch is let go (on a GPU: emptying the
    allocator's cache).
    """

    def __init__(
        self,
        predict_batch: PredictBatch[Result],
        limits: BatchLimits,
        executor: Executor,
        device_slot: asyncio.Semaphore | None = None,
        is_out_of_memory: Callable[[BaseException], bool] | None = None,
        on_batch: Observer | None = None,
        on_drop: Callable[[str], None] | None = None,
        on_out_of_memory: Callable[[], None] | None = None,
        max_shadow_rows: int = 0,
        max_shadow_tokens: int | None = None,
        on_shadow_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        self._predict = predict_batch
        self.limits = limits
        self._executor = executor
        self._slot = device_slot or asyncio.Semaphore(1)
        self._is_oom = is_out_of_memory or faults.is_out_of_memory
        self._on_batch = on_batch
        self._on_drop = on_drop
        self._on_oom = on_out_of_memory
        self._pending: list[_Row[Result]] = []
        # The lengths of the pending rows someone waits for (length: rows).
        self._waited_lengths: Counter[int] = Counter()
        self._running_batch: _Batch[Result] | None = None
        self._running_since = 0.0
        self._inflight: dict[Hashable, _Row[Result]] = {}
        self._arrived = asyncio.Event()
        self._requests = 0
        self._collector: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        # Set as each batch ends: the rows the next batch waits for, and until when.
        self._refill_rows = 0
        self._refill_until = 0.0
        # Rows no client waits for (a candidate adapter's, see `shadow`), oldest first.
        self._shadow: list[_Row[Result]] = []
        self._max_shadow_rows = max_shadow_rows
        # When the last batch of client rows ended, and how long it ran (see _idle_for_shadow).
        self._client_batch_ended = 0.0
        self._client_batch_seconds = 0.0
        # A shadow batch's most tokens (a longer row runs alone): a client row that comes
        # while one runs waits for it, so it is kept a fraction of a full batch.
        self._max_shadow_tokens = max_shadow_tokens or limits.max_batch_tokens
        self._on_shadow_drop = on_shadow_drop

    @property
    def queued_rows(self) -> int:
        """Rows waiting for a batch."""
        return len(self._pending)

    def backlog(self, rows: list[list[int]], adapters: list[str | None]) -> Backlog:
        """What these rows, submitted now, would wait for (see Backlog)."""
        # A copy (the queue changes after this returns), with lengths down to 0 left in:
        # planning skips them.
        ahead = dict(self._waited_lengths)
        own: dict[int, int] = {}
        for key in dict.fromkeys(zip(adapters, map(tuple, rows), strict=True)):
            row = self._inflight.get(key)
            if row is not None and not row.future.done():
                if row.started:
                    continue  # in the running batch
                if row.waiters > 0:
                    queued = len(row.ids)
                    ahead[queued] = ahead.get(queued, 0) - 1
            length = len(key[1])
            own[length] = own.get(length, 0) + 1
        return self._queued_backlog(ahead, own)

    def backlog_of_lengths(self, own_lengths: dict[int, int]) -> Backlog:
        """What a request of rows of these lengths (length: count), not yet tokenized, would
        wait for, each of its rows counted as its own (one queued for another request may
        be among them, in truth run once for both)."""
        return self._queued_backlog(dict(self._waited_lengths), own_lengths)

    def _queued_backlog(self, ahead: dict[int, int], own: dict[int, int]) -> QueuedBacklog:
        running = self._running_batch
        return QueuedBacklog(
            ahead_lengths=ahead,
            own_lengths=own,
            limits=self.limits,
            running_tokens=0 if running is None else running.tokens(),
            running_seconds=0.0 if running is None else time.monotonic() - self._running_since,
        )

    @property
    def requests(self) -> int:
        """Requests admitted and not yet answered."""
        return self._requests

    def start(self) -> None:
        """Starts the collector task on the running loop."""
        if self._collector is None:
            self._collector = asyncio.create_task(self._collect(), name="batcher")

    async def stop(self) -> None:
        """Stops collecting; rows still pending fail, running batches finish."""
        if self._collector is not None:
            self._collector.cancel()
            await asyncio.gather(self._collector, return_exceptions=True)
            self._collector = None
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        for row in self._pending:
            if not row.future.done():
                row.future.set_exception(BatchFailed("service stopped"))
                _settle(row)
        self._pending.clear()
        self._waited_lengths.clear()
        self._drop_queued_shadow("stopped")

    def abandon(self, reason: str) -> None:
        """Fails every client row queued or running with Stopped(`reason`) at once, so that
        each request still waiting is answered now (a drain ran out): a request cut off
        as the server stops would otherwise be cancelled mid-wait, with no answer. The
        queued rows are dropped unrun (reason "stopped"); a running batch still ends on the
        device, its results unused. Shadow rows are dropped as stopped."""
        running = [] if self._running_batch is None else self._running_batch.rows
        for row in [*running, *self._pending]:  # queued shadow rows wait in self._shadow
            if row.shadow:
                self._drop_shadow(row.future, "stopped")
            elif not row.future.done():
                row.future.set_exception(Stopped(reason))
                _settle(row)
        for row in self._pending:
            self._forget(row, "stopped")
        self._pending.clear()
        self._waited_lengths.clear()
        self._drop_queued_shadow("stopped")

    def _drop_queued_shadow(self, reason: str) -> None:
        for row in self._shadow:
            self._drop_shadow(row.future, reason)
        self._shadow.clear()

    async def submit(
        self, rows: list[list[int]], adapters: list[str | None], timeout: float
    ) -> list[Result]:
        """Queues the rows and waits for their results, at most `timeout` seconds."""
        if self._requests >= self.limits.max_queue_requests:
            raise QueueFull(f"{self._requests} requests queued")
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        mine: list[_Row[Result]] = []
        for ids, adapter in zip(rows, adapters, strict=True):
            key = (adapter, tuple(ids))
            row = self._inflight.get(key)
            if row is None or row.future.done():
                row = _Row(key, ids, adapter, loop.create_future(), now, now + timeout)
                row.future.add_done_callback(_retrieve)
                self._inflight[key] = row
                self._pending.append(row)
            else:  # the same text is queued or running: wait for that one
                row.deadline = max(row.deadline, now + timeout)
            row.waiters += 1
            if row.waiters == 1 and _is_pending(row):
                self._waited_lengths[len(row.ids)] += 1
            mine.append(row)
        request = _Request(len(mine), loop.create_future(), tracing.current_span_context(), now)
        for row in mine:
            row.requests.append(request)
        self._requests += 1
        self._arrived.set()
        # One future and one timer a request: the rows, which other requests may share, are
        # never awaited (or cancelled) here; each settles its requests (`_settle`).
        timer = loop.call_later(timeout, _expire, request, timeout)
        try:
            await request.done
            return [row.future.result() for row in mine]
        finally:
            timer.cancel()
            self._requests -= 1
            for row in mine:
                row.waiters -= 1
                if row.waiters == 0 and _is_pending(row):
                    self._waited_lengths[len(row.ids)] -= 1

    def busy(self) -> bool:
        """More client rows wait than one batch takes: shadow rows would only wait and drop."""
        return len(self._pending) >= self.limits.max_batch_size

    async def shadow(
        self, rows: list[list[int]], adapters: list[str | None], wait: float
    ) -> list[Result | None]:
        """Scores rows no client waits for, at the lowest priority; None for each row dropped.

        Shadow rows run only in batches of their own, of at most `max_shadow_tokens`, and only
        when no client row waits and none is expected back (see `_idle_for_shadow`): a client
        row that comes while one runs waits for that one short forward, no more. They never
        join a client's batch: a peft model runs one adapter per forward, so a shadow row
        there adds a forward that the batch's clients, and those coming back, wait for.
        A shadow row is dropped (counted by reason, `on_shadow_drop`) when more client rows
        wait than one batch takes as it comes (busy), when `max_shadow_rows` are queued
        (queue_full), when no idle moment came for it within `wait` seconds (no_room), or
        when the batcher stops (stopped). Shadow rows count in no request limit and in no
        backlog that admission weighs.
        """
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        futures: list[asyncio.Future[Result]] = []
        busy = self.busy()
        for ids, adapter in zip(rows, adapters, strict=True):
            future: asyncio.Future[Result] = loop.create_future()
            future.add_done_callback(_retrieve)
            futures.append(future)
            if busy:
                self._drop_shadow(future, "busy")
            elif len(self._shadow) >= self._max_shadow_rows:
                self._drop_shadow(future, "queue_full")
            else:
                key = (adapter, tuple(ids))
                row = _Row(key, ids, adapter, future, now, now + wait, waiters=1, shadow=True)
                self._shadow.append(row)
        if self._shadow:
            self._arrived.set()
        settled = await asyncio.gather(*futures, return_exceptions=True)
        results: list[Result | None] = []
        for result in settled:
            if isinstance(result, ShadowDropped):
                results.append(None)
            elif isinstance(result, BaseException):
                raise result
            else:
                results.append(result)
        return results

    def count_shadow_dropped(self, reason: str, rows: int) -> None:
        """Counts shadow rows its caller dropped itself: before they came here (busy), or
        when their scoring failed (failed)."""
        if self._on_shadow_drop is not None and rows:
            self._on_shadow_drop(reason, rows)

    def _drop_shadow(self, future: asyncio.Future[Result], reason: str) -> None:
        if not future.done():
            future.set_exception(ShadowDropped(reason))
            if self._on_shadow_drop is not None:
                self._on_shadow_drop(reason, 1)

    def _shadow_batch(self, now: float) -> _Batch[Result]:
        """A batch of shadow rows, the oldest first, within the batch limits and
        `max_shadow_tokens`; those past their time are dropped."""
        batch: _Batch[Result] = _Batch(self.limits.packed)
        kept: list[_Row[Result]] = []
        for row in self._shadow:
            if row.future.done():
                continue
            if row.deadline <= now:
                self._drop_shadow(row.future, "no_room")
            elif not batch.rows or (
                len(batch.rows) < self.limits.max_batch_size
                and batch.tokens(len(row.ids)) <= self._max_shadow_tokens
            ):
                batch.add(row)
                row.started = True
            else:
                kept.append(row)
        self._shadow = kept
        return batch

    async def _collect(self) -> None:
        while True:
            while not self._pending and not self._shadow:
                self._arrived.clear()
                await self._arrived.wait()
            if not self._pending and not await self._idle_for_shadow():
                continue  # client rows came meanwhile: theirs is the next batch
            await self._slot.acquire()
            try:
                await self._wait_until_flush()
                batch = self._take_batch()
            except BaseException:
                self._slot.release()
                raise
            if not batch.rows:
                self._slot.release()
                continue
            task = asyncio.create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _idle_for_shadow(self) -> bool:
        """Waits, with only shadow rows queued, until the device has stood idle as long as
        its last client batch took (and the refill's `refill_wait_seconds`, and
        `max_wait_seconds`): clients that send their next text once answered are back by
        then. False as soon as a client row comes: a shadow batch started before would hold
        the device as their rows come back (measured at 32 such clients: their batches split
        in two, and admission refused some with 429).
        """
        idle_since = self._client_batch_ended
        until = max(
            self._refill_until,
            idle_since + self._client_batch_seconds,
            time.monotonic() + self.limits.max_wait_seconds,
        )
        while not self._pending:
            left = until - time.monotonic()
            if left <= 0:
                return True
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return not self._pending
        return False

    async def _wait_until_flush(self) -> None:
        """Returns once the pending rows fill a batch, or once both the oldest has waited
        `max_wait_seconds` and the rows the last batch answered have come back (or
        `refill_wait_seconds` has passed since it ended)."""
        while self._pending and not self._full():
            until = self._pending[0].enqueued + self.limits.max_wait_seconds
            if len(self._pending) < self._refill_rows:
                until = max(until, self._refill_until)
            left = until - time.monotonic()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def _full(self) -> bool:
        if len(self._pending) >= self.limits.max_batch_size:
            return True
        pending = _Batch[Result](self.limits.packed)
        for row in self._pending:
            pending.add(row)
        return pending.tokens() >= self.limits.max_batch_tokens

    def _take_batch(self) -> _Batch[Result]:
        """Drops cancelled and late rows, then takes the next batch (see `_choose`); with no
        client row left, a batch of shadow rows (see `shadow`)."""
        now = time.monotonic()
        live: list[_Row[Result]] = []
        for row in self._pending:
            if row.waiters <= 0 or row.future.done():
                self._forget(row, "cancelled")
            elif row.deadline <= now:
                self._forget(row, "deadline")
            else:
                live.append(row)
        if not live:
            self._pending = []
            self._waited_lengths.clear()
            return self._shadow_batch(now)
        batch = self._choose(live)
        taken = set(map(id, batch.rows))
        self._pending = [row for row in live if id(row) not in taken]
        self._waited_lengths = Counter(len(row.ids) for row in self._pending)
        for row in batch.rows:
            row.started = True
        return batch

    def _choose(self, live: list[_Row[Result]]) -> _Batch[Result]:
        """The next batch: always with the oldest row, so that no row waits for ever."""
        anchor, limits = live[0], self.limits
        batch: _Batch[Result] = _Batch(limits.packed)
        if limits.packed or limits.overhead_tokens is None:
            batch.add(anchor)
            others = live[1:]
            if not limits.packed:
                others.sort(key=lambda r: abs(len(r.ids) - len(anchor.ids)))
            for row in others:
                if (
                    len(batch.rows) < limits.max_batch_size
                    and batch.tokens(len(row.ids)) <= limits.max_batch_tokens
                ):
                    batch.add(row)
            return batch
        window = live[: COST_MODEL_WINDOW_BATCHES * limits.max_batch_size]
        by_length = sorted(window, key=lambda r: len(r.ids))
        lengths = [len(row.ids) for row in by_length]
        start, end = cheapest_group_of(
            lengths,
            by_length.index(anchor),
            limits.overhead_tokens,
            limits.max_batch_size,
            limits.max_batch_tokens,
        )
        for row in by_length[start:end]:
            batch.add(row)
        return batch

    def _forget(self, row: _Row[Result], reason: str) -> None:
        if not row.future.done():
            if reason == "deadline":  # a waiter may still be there: tell it why
                row.future.set_exception(DeadlineExceeded("dropped unrun past its deadline"))
            else:
                row.future.cancel()
            _settle(row)
        if self._inflight.get(row.key) is row:
            del self._inflight[row.key]
        if self._on_drop is not None:
            self._on_drop(reason)

    async def _run(self, batch: _Batch[Result]) -> None:
        try:
            started = time.monotonic()
            self._running_batch, self._running_since = batch, started
            with _batch_span(batch):
                succeeded = await self._run_rows(batch.rows)
            if self._on_batch is not None:
                self._on_batch(
                    BatchStats(
                        rows=len(batch.rows),
                        tokens=batch.tokens(),
                        queue_seconds=[
                            started - row.enqueued for row in batch.rows if not row.shadow
                        ],
                        run_seconds=time.monotonic() - started,
                        failed=not succeeded,
                    )
                )
        finally:
            if not batch.rows[0].shadow:
                self._client_batch_ended = time.monotonic()
                self._client_batch_seconds = self._client_batch_ended - started
            self._running_batch = None
            for row in batch.rows:
                if self._inflight.get(row.key) is row:
                    del self._inflight[row.key]
            self._expect_refill(batch.rows)
            self._slot.release()

    def _expect_refill(self, rows: list[_Row[Result]]) -> None:
        """After a batch: the requests it answered in full may send as many rows again."""
        answered = 0
        for row in rows:
            for request in row.requests:
                request.unanswered -= 1
                if request.unanswered == 0:
                    answered += request.rows
            row.requests.clear()
        self._refill_rows = min(self.limits.max_batch_size, len(self._pending) + answered)
        self._refill_until = time.monotonic() + self.limits.refill_wait_seconds

    async def _run_rows(self, rows: list[_Row[Result]]) -> bool:
        """Runs rows in the executor; on out-of-memory, halves the batch and tries again.
        True if its one forward raised nothing."""
        loop = asyncio.get_running_loop()
        ids = [row.ids for row in rows]
        adapters = [row.adapter for row in rows]
        try:
            with tracing.span("forward") as forward:
                if forward is not None:
                    forward.set_attribute("batch.size", len(rows))
                results = await loop.run_in_executor(self._executor, self._predict, ids, adapters)
            if len(results) != len(rows):
                raise BatchFailed(f"predictor returned {len(results)} results for {len(rows)}")
        except Exception as exc:
            if not (self._is_oom(exc) and len(rows) > 1):
                _fail(rows, str(exc) or type(exc).__name__)
                return False
            logger.warning("out of memory on a batch of %d; splitting it", len(rows))
        else:
            _deliver(rows, results)
            return True
        # Retried only here, outside the `except` block: inside it the exception is alive, and
        # its traceback holds the frames of the failed forward with their activations, so the
        # halves would run beside the memory that the whole batch could not fit in.
        if self._on_oom is not None:
            try:
                await loop.run_in_executor(self._executor, self._on_oom)
            except Exception as hook_error:  # the retry may still fit; never lose the rows
                logger.warning("releasing memory after out-of-memory failed: %s", hook_error)
        half = len(rows) // 2
        await self._run_rows(rows[:half])
        await self._run_rows(rows[half:])
        return False


def cheapest_group_of(
    lengths: list[int], index: int, overhead: float, max_rows: int, max_tokens: int
) -> tuple[int, int]:
    """The [start, end) of the group holding `index` when sorted `lengths` are cut into
    contiguous groups that cost least in all, a group costing `overhead` plus its rows times
    its longest length, within `max_rows` and `max_tokens` (a single row always fits).

    Dynamic programming over the cut points: O(len(lengths) × max_rows).
    """
    count = len(lengths)
    best = [0.0] + [float("inf")] * count  # best[i]: least cost of the first i rows
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        longest = lengths[end - 1]
        for start in range(end - 1, max(end - max_rows, 0) - 1, -1):
            rows = end - start
            if rows > 1 and rows * longest > max_tokens:
                break
            cost = best[start] + overhead + rows * longest
            if cost < best[end]:
                best[end], cut[end] = cost, start
    end = count
    while cut[end] > index:
        end = cut[end]
    return cut[end], end


def _batch_span(batch: _Batch[Any]) -> AbstractContextManager[None]:
    """The batch's span, linked from the sampled requests it serves (tracing on)."""
    if tracing.tracer is None:
        return tracing.NO_SPAN
    served = {id(r): r for row in batch.rows for r in row.requests if r.trace is not None}
    return tracing.batch(
        [(r.trace, r.submitted) for r in served.values() if r.trace is not None],
        len(batch.rows),
        batch.tokens(),
        [row.adapter for row in batch.rows],
    )


def _deliver(rows: list[_Row[Result]], results: Sequence[Result | BaseException]) -> None:
    """Each row's result, or the exception that fails that row alone."""
    for row, result in zip(rows, results, strict=True):
        if row.future.done():
            continue
        if isinstance(result, BaseException):
            row.future.set_exception(result)
        else:
            row.future.set_result(result)
        _settle(row)


def _fail(rows: list[_Row[Result]], reason: str) -> None:
    """Fails every row of a batch with the reason (a string: no traceback kept alive)."""
    logger.error("batch of %d failed: %s", len(rows), reason)
    for row in rows:
        if not row.future.done():
            row.future.set_exception(BatchFailed(reason))
            _settle(row)


def _settle(row: _Row[Any]) -> None:
    """The row's future is set: each request waiting for it has one row fewer to wait for."""
    for request in row.requests:
        request.settled()


def _expire(request: _Request, timeout: float) -> None:
    """A request's time is up: it stops waiting (its rows stay queued for any others)."""
    if not request.done.done():
        request.done.set_exception(DeadlineExceeded(f"no answer within {timeout:.3g} s"))


def _is_pending(row: _Row[Any]) -> bool:
    """Queued, not yet in a batch: a row leaves the queue when it starts or is dropped
    (its future then done)."""
    return not row.started and not row.future.done()


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Marks a row's exception as seen: its waiters may all have gone before it failed."""
    if not future.cancelled():
        future.exception()
