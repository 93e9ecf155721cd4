"""The batcher's shadow rows, with a fake predictor: they never delay a client's row, never
weigh in admission's backlog or the queue's bound, and are dropped, counted, when short of
room."""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from api.serving.batching import Batcher, BatchLimits, QueueFull
from tests.support.fake_predictor import FakePredictor

Results = Batcher[tuple[str | None, int]]


def batcher_for(
    fake: FakePredictor, executor: ThreadPoolExecutor, dropped: Counter[str], **limits: int
) -> Results:
    values = {
        "max_batch_size": 4,
        "max_queue_requests": 100,
        "max_shadow_rows": 100,
        "max_shadow_tokens": 1000,
    }
    values.update(limits)
    batcher: Results = Batcher(
        fake,
        BatchLimits(
            max_batch_size=values["max_batch_size"],
            max_batch_tokens=1000,
            max_wait_seconds=0.01,
            max_queue_requests=values["max_queue_requests"],
        ),
        executor,
        max_shadow_rows=values["max_shadow_rows"],
        max_shadow_tokens=values["max_shadow_tokens"],
        on_shadow_drop=lambda reason, rows: dropped.update({reason: rows}),
    )
    batcher.start()
    return batcher


async def test_shadow_rows_run_after_the_clients_rows_in_a_batch_of_their_own(
    executor: ThreadPoolExecutor,
) -> None:
    fake, dropped = FakePredictor(), Counter[str]()
    batcher = batcher_for(fake, executor, dropped)
    fake.gate.clear()  # the first forward holds the device while the rest queue
    first = asyncio.create_task(batcher.submit([[1]], ["a"], 10))
    await asyncio.sleep(0.05)
    shadow = asyncio.create_task(batcher.shadow([[5], [6]], ["b", "b"], 10))
    client = asyncio.create_task(batcher.submit([[2], [3]], ["a", "a"], 10))
    await asyncio.sleep(0.05)
    fake.gate.set()
    assert await asyncio.wait_for(first, 5) == [("a", 1)]
    assert await asyncio.wait_for(client, 5) == [("a", 2), ("a", 3)]
    assert await asyncio.wait_for(shadow, 5) == [("b", 5), ("b", 6)]
    # The client rows first, though queued later, then the shadow rows (never one batch).
    assert [sorted(a for a, _ in batch) for batch in fake.batches] == [
        ["a"],
        ["a", "a"],
        ["b", "b"],
    ]
    assert not dropped
    await batcher.stop()


async def test_shadow_rows_weigh_in_no_backlog_and_no_queue_bound(
    executor: ThreadPoolExecutor,
) -> None:
    fake, dropped = FakePredictor(), Counter[str]()
    batcher = batcher_for(fake, executor, dropped, max_queue_requests=1)
    fake.gate.clear()
    held = asyncio.create_task(batcher.submit([[1]], ["a"], 10))
    await asyncio.sleep(0.05)  # running: the device is busy
    before = batcher.backlog([[7, 7]], ["a"])
    shadow = asyncio.create_task(batcher.shadow([[5, 5]] * 3, ["b"] * 3, 10))
    await asyncio.sleep(0.01)
    after = batcher.backlog([[7, 7]], ["a"])
    assert (after.ahead, after.own, after.total) == (before.ahead, before.own, before.total)
    assert batcher.requests == 1  # the shadow is no request: the bound of 1 still holds one
    with pytest.raises(QueueFull):
        await batcher.submit([[2]], ["a"], 10)
    fake.gate.set()
    await asyncio.wait_for(asyncio.gather(held, shadow), 5)
    await batcher.stop()


async def test_shadow_rows_are_dropped_and_counted_when_short_of_room(
    executor: ThreadPoolExecutor,
) -> None:
    fake, dropped = FakePredictor(), Counter[str]()
    batcher = batcher_for(fake, executor, dropped, max_batch_size=2, max_shadow_rows=2)
    fake.gate.clear()
    held = asyncio.create_task(batcher.submit([[1]], ["a"], 10))
    await asyncio.sleep(0.05)
    # Room for two shadow rows in the queue: the third is dropped as it comes.
    late = asyncio.create_task(batcher.shadow([[5], [6], [7]], ["b"] * 3, 0.05))
    await asyncio.sleep(0.01)
    # Two client rows queued, as many as one batch takes: busy, shadow rows dropped at once.
    clients = asyncio.create_task(batcher.submit([[2], [3]], ["a", "a"], 10))
    await asyncio.sleep(0.01)
    assert await asyncio.wait_for(batcher.shadow([[8]], ["b"], 10), 1) == [None]
    await asyncio.sleep(0.1)  # past the first shadow rows' wait, still held
    fake.gate.set()
    assert await asyncio.wait_for(late, 5) == [None, None, None]
    await asyncio.wait_for(asyncio.gather(held, clients), 5)
    assert dropped == Counter({"queue_full": 1, "busy": 1, "no_room": 2})
    # Once clients are served, a shadow row alone runs at once.
    assert await asyncio.wait_for(batcher.shadow([[9]], ["b"], 10), 5) == [("b", 9)]
    await batcher.stop()


async def test_shadow_rows_waiting_when_it_stops_are_dropped(
    executor: ThreadPoolExecutor,
) -> None:
    fake, dropped = FakePredictor(), Counter[str]()
    batcher = batcher_for(fake, executor, dropped)
    fake.gate.clear()
    held = asyncio.create_task(batcher.submit([[1]], ["a"], 10))
    await asyncio.sleep(0.05)
    shadow = asyncio.create_task(batcher.shadow([[5]], ["b"], 10))
    await asyncio.sleep(0.01)
    stopping = asyncio.create_task(batcher.stop())
    await asyncio.sleep(0.01)
    fake.gate.set()
    await asyncio.wait_for(asyncio.gather(held, stopping), 5)
    assert await asyncio.wait_for(shadow, 5) == [None]
    assert dropped == Counter({"stopped": 1})


async def test_a_shadow_forward_holds_at_most_its_share_of_tokens(
    executor: ThreadPoolExecutor,
) -> None:
    fake, dropped = FakePredictor(), Counter[str]()
    batcher = batcher_for(fake, executor, dropped, max_batch_size=8, max_shadow_tokens=4)
    fake.gate.clear()
    held = asyncio.create_task(batcher.submit([[1]], ["a"], 10))
    await asyncio.sleep(0.05)
    shadow = asyncio.create_task(batcher.shadow([[2, 2]] * 5, ["b"] * 5, 10))
    await asyncio.sleep(0.01)
    fake.gate.set()
    assert await asyncio.wait_for(shadow, 5) == [("b", 4)] * 5
    await held
    # Padded to 2 tokens a row: two rows a shadow forward (4 tokens), however much room.
    assert fake.sizes == [1, 2, 2, 1]
    assert not dropped
    await batcher.stop()
