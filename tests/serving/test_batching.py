"""The batcher alone, with a fake predictor: flush rules, limits, faults."""

from __future__ import annotations

import asyncio
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

from api.serving.batch_plan import Work
from api.serving.batching import (
    Batcher,
    BatchFailed,
    BatchLimits,
    BatchStats,
    QueueFull,
    Stopped,
    cheapest_group_of,
)
from api.serving.errors import DeadlineExceeded
from tests.support.fake_predictor import FakePredictor


def batcher_for(
    predictor: FakePredictor, executor: ThreadPoolExecutor, **limits: float
) -> Batcher[tuple[str | None, int]]:
    values = {"max_batch_size": 4, "max_batch_tokens": 1000, "max_wait_seconds": 0.05}
    values.update(limits)
    batcher: Batcher[tuple[str | None, int]] = Batcher(
        predictor,
        BatchLimits(
            max_batch_size=int(values["max_batch_size"]),
            max_batch_tokens=int(values["max_batch_tokens"]),
            max_wait_seconds=values["max_wait_seconds"],
            max_queue_requests=int(values.get("max_queue_requests", 100)),
            overhead_tokens=values.get("overhead_tokens"),
            packed=bool(values.get("packed", False)),
            refill_wait_seconds=values.get("refill_wait_seconds", 0.0),
        ),
        executor,
    )
    batcher.start()
    return batcher


async def test_flushes_when_the_batch_is_full_by_size(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor()
    batcher = batcher_for(fake, executor, max_batch_size=4, max_wait_seconds=30)
    results = await asyncio.wait_for(
        asyncio.gather(*(batcher.submit([[i]], ["a"], 10) for i in range(8))), 5
    )
    assert fake.sizes == [4, 4]
    assert [r[0][1] for r in results] == list(range(8))
    await batcher.stop()


async def test_flushes_by_tokens_with_padding_counted(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor()
    batcher = batcher_for(
        fake, executor, max_batch_size=100, max_batch_tokens=40, max_wait_seconds=0.2
    )
    # 4 rows of 10 tokens = 40 padded tokens: full. A 5th would make 50.
    rows = [[1] * 10 for _ in range(5)]
    await asyncio.wait_for(
        asyncio.gather(*(batcher.submit([r], [str(i)], 10) for i, r in enumerate(rows))), 5
    )
    assert fake.sizes == [4, 1]
    await batcher.stop()


async def test_flushes_by_wait_when_not_full(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor()
    batcher = batcher_for(fake, executor, max_batch_size=100, max_wait_seconds=0.05)
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.gather(
        batcher.submit([[1]], ["a"], 10), batcher.submit([[2]], ["a"], 10)
    )
    waited = loop.time() - started
    assert fake.sizes == [2]
    assert results == [[("a", 1)], [("a", 2)]]
    assert 0.04 <= waited < 2
    await batcher.stop()


async def closed_loop(batcher: Batcher[tuple[str | None, int]], clients: int, rounds: int) -> None:
    """`clients` that each send one row, wait for its answer, and send the next; all but the
    first start while the first one's row runs. Between an answer and the next row, a
    millisecond: a real client's answer goes out and its next request comes in through the
    network and the HTTP server, never in the same turn of the event loop."""

    async def client(number: int) -> None:
        if number > 0:
            await asyncio.sleep(0.005)
        for turn in range(rounds):
            await batcher.submit([[number, turn]], ["a"], 30)
            await asyncio.sleep(0.001)

    await asyncio.gather(*(client(number) for number in range(clients)))


async def test_the_next_batch_waits_for_the_clients_the_last_one_answered(
    executor: ThreadPoolExecutor,
) -> None:
    # Without the wait, clients that send their next row when answered split into two halves
    # taking turns (batches of 1 and 3 here, for ever); with it, each batch holds all four.
    fake = FakePredictor(seconds=0.05)
    batcher = batcher_for(
        fake, executor, max_batch_size=8, max_wait_seconds=0, refill_wait_seconds=0.5
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(closed_loop(batcher, clients=4, rounds=6), 10)
    # The first row runs alone, at once (nothing answered yet); the first client, a turn
    # ahead, is done before the others' last rows, which run once the wait has passed.
    assert fake.sizes == [1] + [4] * 5 + [3]
    assert loop.time() - started >= 0.5
    await batcher.stop()


async def test_without_the_wait_such_clients_take_turns(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor(seconds=0.05)
    batcher = batcher_for(fake, executor, max_batch_size=8, max_wait_seconds=0)
    await asyncio.wait_for(closed_loop(batcher, clients=4, rounds=6), 10)
    assert fake.sizes[:4] == [1, 3, 1, 3]
    await batcher.stop()


async def test_a_lone_client_never_waits_for_others(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor()
    batcher = batcher_for(fake, executor, max_batch_size=8, refill_wait_seconds=30)
    await asyncio.wait_for(closed_loop(batcher, clients=1, rounds=5), 5)
    assert fake.sizes == [1] * 5
    await batcher.stop()


async def test_a_request_answered_in_part_is_not_waited_for(
    executor: ThreadPoolExecutor,
) -> None:
    # Its rows still queued are what comes next: no batch waits for it to send more.
    fake = FakePredictor()
    batcher = batcher_for(
        fake, executor, max_batch_size=4, max_wait_seconds=0, refill_wait_seconds=30
    )
    rows = [[index] for index in range(10)]
    answer = await asyncio.wait_for(batcher.submit(rows, ["a"] * 10, 30), 5)
    assert [value for _, value in answer] == list(range(10))
    assert fake.sizes == [4, 4, 2]
    await batcher.stop()


async def test_similar_lengths_go_together(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor()
    fake.gate.clear()  # hold the first batch so the rest queue up together
    batcher = batcher_for(fake, executor, max_batch_size=2, max_wait_seconds=0)
    first = asyncio.ensure_future(batcher.submit([[0]], ["a"], 10))
    await asyncio.sleep(0.05)
    lengths = [1, 30, 2, 31]
    rest = [asyncio.ensure_future(batcher.submit([[7] * n], ["a"], 10)) for n in lengths]
    await asyncio.sleep(0.05)
    fake.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *rest), 5)
    grouped = [sorted(len(ids) for _, ids in batch) for batch in fake.batches[1:]]
    assert grouped == [[1, 2], [30, 31]]
    await batcher.stop()


async def queue_behind_a_held_batch(
    batcher: Batcher[tuple[str | None, int]], fake: FakePredictor, lengths: list[int]
) -> list[list[int]]:
    """Holds a first batch, queues rows of `lengths` (oldest first) behind it, and returns
    the sorted lengths of each later batch."""
    fake.gate.clear()
    first = asyncio.ensure_future(batcher.submit([[0]], ["a"], 10))
    await asyncio.sleep(0.05)
    rest = []
    for n in lengths:
        rest.append(asyncio.ensure_future(batcher.submit([[7] * n], ["a"], 10)))
        await asyncio.sleep(0.001)  # keeps the arrival order
    fake.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *rest), 5)
    return [sorted(len(ids) for _, ids in batch) for batch in fake.batches[1:]]


async def test_cost_model_keeps_short_texts_out_of_a_long_batch(
    executor: ThreadPoolExecutor,
) -> None:
    # A forward costs 5 tokens beyond its own: padding a 2-token text to 31 costs more
    # than a forward of its own, so it waits for the next turn; the oldest (30) leads.
    fake = FakePredictor()
    batcher = batcher_for(fake, executor, max_batch_size=10, max_wait_seconds=0, overhead_tokens=5)
    assert await queue_behind_a_held_batch(batcher, fake, [30, 2, 31, 29]) == [[29, 30, 31], [2]]
    await batcher.stop()


async def test_cost_model_weighs_only_the_oldest_rows(executor: ThreadPoolExecutor) -> None:
    # 2 rows a batch: the cost model looks at the oldest 8 rows. The last 30-token row, 9th,
    # would pair with the oldest if it were looked at; it waits its turn instead.
    fake = FakePredictor()
    fake.gate.clear()
    batcher = batcher_for(fake, executor, max_batch_size=2, max_wait_seconds=0, overhead_tokens=5)
    first = asyncio.ensure_future(batcher.submit([[0]], ["a"], 10))
    await asyncio.sleep(0.05)
    rest = []
    for token, n in enumerate([30, 5, 5, 5, 5, 5, 5, 5, 30], start=1):  # distinct texts
        rest.append(asyncio.ensure_future(batcher.submit([[token] * n], ["a"], 10)))
        await asyncio.sleep(0.001)
    fake.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *rest), 5)
    assert [ids for _, ids in fake.batches[1]] == [[1] * 30]
    await batcher.stop()


async def test_costly_forwards_take_every_row_that_fits(executor: ThreadPoolExecutor) -> None:
    # As on a GPU: a forward costs as much as 1000 tokens, so one batch beats two.
    fake = FakePredictor()
    batcher = batcher_for(
        fake, executor, max_batch_size=10, max_wait_seconds=0, overhead_tokens=1000
    )
    assert await queue_behind_a_held_batch(batcher, fake, [30, 2, 31, 29]) == [[2, 29, 30, 31]]
    await batcher.stop()


async def test_packed_batches_count_real_tokens_and_take_the_oldest_rows(
    executor: ThreadPoolExecutor,
) -> None:
    # Packed, a batch costs its real tokens whatever their lengths: rows join oldest first
    # while they fit in 40 tokens (padded, 30 and 2 alone would count 60); 31 waits.
    fake = FakePredictor()
    batcher = batcher_for(
        fake, executor, max_batch_size=10, max_batch_tokens=40, max_wait_seconds=0, packed=True
    )
    batches = await queue_behind_a_held_batch(batcher, fake, [30, 2, 31, 5, 1])
    assert batches == [[1, 2, 5, 30], [31]]
    await batcher.stop()


async def test_packed_stats_count_no_padding(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor()
    seen: list[BatchStats] = []
    batcher = batcher_for(fake, executor, max_batch_size=2, max_wait_seconds=30, packed=True)
    batcher._on_batch = seen.append
    await asyncio.gather(batcher.submit([[1, 1, 1]], ["a"], 5), batcher.submit([[2]], ["a"], 5))
    assert len(seen) == 1 and seen[0].rows == 2 and seen[0].tokens == 4
    await batcher.stop()


def test_cheapest_groups_respect_the_limits_and_hold_the_given_row() -> None:
    assert cheapest_group_of([2, 29, 30, 31], 0, 5, 10, 1000) == (0, 1)
    assert cheapest_group_of([5, 5, 80], 2, 0, 32, 1000) == (2, 3)
    # However cheap a big batch would be, it holds at most max_rows rows and max_tokens.
    start, end = cheapest_group_of([1] * 40, 39, 1000, 32, 10_000)
    assert start <= 39 < end and end - start <= 32
    start, end = cheapest_group_of([10] * 8, 0, 1000, 32, 40)
    assert (start, end) == (0, 4)
    # A single row over max_tokens still runs, alone.
    assert cheapest_group_of([10, 500], 1, 1000, 32, 100) == (1, 2)


async def test_full_queue_refuses_at_once(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor()
    fake.gate.clear()
    batcher = batcher_for(fake, executor, max_queue_requests=2, max_wait_seconds=0)
    held = [asyncio.ensure_future(batcher.submit([[i]], ["a"], 10)) for i in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(QueueFull):
        await batcher.submit([[9]], ["a"], 10)
    fake.gate.set()
    await asyncio.wait_for(asyncio.gather(*held), 5)
    assert await batcher.submit([[9]], ["a"], 10) == [("a", 9)]
    await batcher.stop()


async def test_item_past_its_deadline_is_dropped_unrun(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor()
    fake.gate.clear()
    dropped: list[str] = []
    batcher = batcher_for(fake, executor, max_wait_seconds=0)
    batcher._on_drop = dropped.append
    busy = asyncio.ensure_future(batcher.submit([[1]], ["a"], 10))
    await asyncio.sleep(0.05)
    with pytest.raises(DeadlineExceeded):
        await batcher.submit([[2]], ["a"], 0.05)
    await asyncio.sleep(0.05)
    fake.gate.set()
    await asyncio.wait_for(busy, 5)
    await asyncio.sleep(0.1)
    ran = [ids for batch in fake.batches for _, ids in batch]
    assert [2] not in ran and dropped
    await batcher.stop()


async def test_abandon_answers_the_running_and_queued_rows_at_once(
    executor: ThreadPoolExecutor,
) -> None:
    """A drain that ran out: every waiting request is failed now, the queued rows unrun."""
    fake = FakePredictor()
    fake.gate.clear()
    dropped: list[str] = []
    batcher = batcher_for(fake, executor, max_batch_size=1, max_wait_seconds=0)
    batcher._on_drop = dropped.append
    running = asyncio.ensure_future(batcher.submit([[1]], ["a"], 10))
    await asyncio.sleep(0.05)  # [1] is on the device, held there by the gate
    queued = asyncio.ensure_future(batcher.submit([[2], [3]], ["a", "a"], 10))
    await asyncio.sleep(0.05)
    batcher.abandon("the drain ran out")
    for request in (running, queued):
        with pytest.raises(Stopped, match="the drain ran out"):
            await asyncio.wait_for(request, 1)  # answered while the forward still runs
    assert dropped == ["stopped", "stopped"] and batcher.queued_rows == 0
    fake.gate.set()
    await batcher.stop()
    assert [ids for batch in fake.batches for _, ids in batch] == [[1]]


async def test_failing_batch_fails_only_its_requests(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor(fail=True)
    batcher = batcher_for(fake, executor, max_wait_seconds=0)
    with pytest.raises(BatchFailed, match="weights exploded"):
        await batcher.submit([[1]], ["a"], 5)
    fake.fail = False
    assert await batcher.submit([[2]], ["a"], 5) == [("a", 2)]  # the worker lives on
    await batcher.stop()


async def test_out_of_memory_splits_the_batch_and_retries(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor(oom_above=1)
    batcher = batcher_for(fake, executor, max_batch_size=4, max_wait_seconds=30)
    results = await asyncio.wait_for(
        asyncio.gather(*(batcher.submit([[i]], ["a"], 10) for i in range(4))), 5
    )
    assert [r[0][1] for r in results] == [0, 1, 2, 3]
    assert fake.sizes == [4, 2, 1, 1, 2, 1, 1]
    await batcher.stop()


async def test_out_of_memory_on_one_row_fails_it(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor(oom_above=0)
    batcher = batcher_for(fake, executor, max_wait_seconds=0)
    with pytest.raises(BatchFailed, match="out of memory"):
        await batcher.submit([[1]], ["a"], 5)
    await batcher.stop()


async def test_cancelled_item_is_not_run(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor()
    fake.gate.clear()
    batcher = batcher_for(fake, executor, max_wait_seconds=0)
    busy = asyncio.ensure_future(batcher.submit([[1]], ["a"], 10))
    await asyncio.sleep(0.05)
    gone = asyncio.ensure_future(batcher.submit([[2]], ["a"], 10))
    await asyncio.sleep(0.02)
    gone.cancel()
    await asyncio.sleep(0.02)
    fake.gate.set()
    await asyncio.wait_for(busy, 5)
    assert await batcher.submit([[3]], ["a"], 5) == [("a", 3)]
    ran = [ids for batch in fake.batches for _, ids in batch]
    assert [2] not in ran
    await batcher.stop()


async def test_identical_texts_in_flight_are_computed_once(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor()
    batcher = batcher_for(fake, executor, max_batch_size=10, max_wait_seconds=0.05)
    results = await asyncio.gather(
        *(batcher.submit([[5, 5], [6]], ["a", "a"], 5) for _ in range(5)),
        batcher.submit([[5, 5]], ["b"], 5),
    )
    assert results[:5] == [[("a", 10), ("a", 6)]] * 5
    assert results[5] == [("b", 10)]
    ran = [(adapter, ids) for batch in fake.batches for adapter, ids in batch]
    assert sorted(ran) == [("a", [5, 5]), ("a", [6]), ("b", [5, 5])]
    await batcher.stop()


async def test_mixed_adapters_share_a_batch_with_per_row_adapters(
    executor: ThreadPoolExecutor,
) -> None:
    fake = FakePredictor()
    batcher = batcher_for(fake, executor, max_batch_size=4, max_wait_seconds=30)
    results = await asyncio.gather(
        batcher.submit([[1]], ["spam"], 5),
        batcher.submit([[2]], ["promo"], 5),
        batcher.submit([[3]], [None], 5),
        batcher.submit([[4]], ["spam"], 5),
    )
    assert fake.sizes == [4]
    assert results == [[("spam", 1)], [("promo", 2)], [(None, 3)], [("spam", 4)]]
    await batcher.stop()


async def test_stats_report_each_batch(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor()
    seen: list[BatchStats] = []
    batcher = batcher_for(fake, executor, max_batch_size=2, max_wait_seconds=30)
    batcher._on_batch = seen.append
    await asyncio.gather(batcher.submit([[1, 1, 1]], ["a"], 5), batcher.submit([[2]], ["a"], 5))
    assert len(seen) == 1 and seen[0].rows == 2 and seen[0].tokens == 6  # 2 rows × 3, padded
    assert len(seen[0].queue_seconds) == 2 and seen[0].run_seconds >= 0
    await batcher.stop()


class _Activations:
    """Stands for a forward's activations: held only by the frame of the call that failed."""


async def test_out_of_memory_retry_runs_after_the_failed_batch_is_released(
    executor: ThreadPoolExecutor,
) -> None:
    # On a GPU the failed batch's activations are locals of its forward's frames, which the
    # exception's traceback holds: the halves must run after that is all let go, and after
    # the allocator's cache is emptied (the hook), or they meet the same wall.
    events: list[tuple[str, int, bool]] = []
    failed: list[weakref.ref[_Activations]] = []

    def released() -> bool:
        return bool(failed) and failed[0]() is None

    def predict(rows: list[list[int]], adapters: list[str | None]) -> list[int]:
        if len(rows) > 2:
            activations = _Activations()
            failed.append(weakref.ref(activations))
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        events.append(("run", len(rows), released()))
        return [sum(ids) for ids in rows]

    batcher: Batcher[int] = Batcher(
        predict,
        BatchLimits(max_batch_size=4, max_wait_seconds=30),
        executor,
        on_out_of_memory=lambda: events.append(("release", 0, released())),
    )
    batcher.start()
    results = await asyncio.wait_for(
        asyncio.gather(*(batcher.submit([[i]], ["a"], 10) for i in range(4))), 5
    )
    assert results == [[0], [1], [2], [3]]
    assert events == [("release", 0, True), ("run", 2, True), ("run", 2, True)]
    await batcher.stop()


async def test_a_failing_release_hook_does_not_stop_the_retry(executor: ThreadPoolExecutor) -> None:
    def release() -> None:
        raise RuntimeError("no allocator here")

    fake = FakePredictor(oom_above=2)
    batcher: Batcher[tuple[str | None, int]] = Batcher(
        fake,
        BatchLimits(max_batch_size=4, max_wait_seconds=30),
        executor,
        on_out_of_memory=release,
    )
    batcher.start()
    results = await asyncio.wait_for(
        asyncio.gather(*(batcher.submit([[i]], ["a"], 10) for i in range(4))), 5
    )
    assert [r[0][1] for r in results] == [0, 1, 2, 3] and fake.sizes == [4, 2, 2]
    await batcher.stop()


async def test_failed_and_split_batches_are_reported_failed(executor: ThreadPoolExecutor) -> None:
    fake = FakePredictor(fail=True)
    seen: list[BatchStats] = []
    batcher = batcher_for(fake, executor, max_batch_size=4, max_wait_seconds=0)
    batcher._on_batch = seen.append
    with pytest.raises(BatchFailed):
        await batcher.submit([[1]], ["a"], 5)
    fake.fail, fake.oom_above = False, 1
    await asyncio.gather(*(batcher.submit([[i]], ["a"], 5) for i in range(2, 4)))  # split
    fake.oom_above = None
    await batcher.submit([[9]], ["a"], 5)
    assert [(stats.rows, stats.failed) for stats in seen] == [(1, True), (2, True), (1, False)]
    await batcher.stop()


async def test_the_backlog_counts_each_row_once_and_abandoned_rows_not_at_all(
    executor: ThreadPoolExecutor,
) -> None:
    # Padded, rows closest in length: planned padded to the longest, 4 a batch (1000 tokens).
    fake = FakePredictor()
    fake.gate.clear()
    batcher = batcher_for(fake, executor, max_batch_size=4, max_wait_seconds=0)
    running = asyncio.ensure_future(batcher.submit([[1] * 10], ["a"], 10))
    await asyncio.sleep(0.05)
    gone = [[2] * 5, [3] * 7]
    with pytest.raises(DeadlineExceeded):  # the client gave up; its rows stay queued
        await batcher.submit(gone, ["a", "a"], 0.05)
    backlog = batcher.backlog(gone, ["a", "a"])  # the same texts again
    assert backlog.ahead == Work(0, 0)  # its abandoned rows are not ahead of it...
    assert backlog.own == backlog.total == Work(1, 2 * 7)  # ...but its own, once
    assert backlog.running_tokens == 10 and backlog.running_seconds > 0
    # Another client's texts: the abandoned rows nobody sends again will be dropped unrun.
    assert batcher.backlog([[4] * 3], ["a"]).total == Work(1, 3)
    # Queued for someone else: ahead of a request that does not send it, its own if it does.
    other = asyncio.ensure_future(batcher.submit([[5] * 6], ["a"], 10))
    await asyncio.sleep(0.02)
    assert batcher.backlog([[4] * 3], ["a"]).ahead == Work(1, 6)
    both = batcher.backlog([[5] * 6, [5] * 6, [4] * 3], ["a"] * 3)  # a text twice: once
    assert (both.ahead, both.own, both.total) == (Work(0, 0), Work(1, 2 * 6), Work(1, 2 * 6))
    # A text in the running batch costs it nothing more; another adapter's is a new row.
    assert batcher.backlog([[1] * 10], ["a"]).own == Work(0, 0)
    assert batcher.backlog([[1] * 10], ["b"]).own == Work(1, 10)
    fake.gate.set()
    await asyncio.wait_for(asyncio.gather(running, other), 5)
    ran = [ids for batch in fake.batches for _, ids in batch]
    assert [2] * 5 not in ran and [3] * 7 not in ran
    await batcher.stop()
