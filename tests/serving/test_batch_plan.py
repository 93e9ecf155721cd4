"""The batch plan admission costs: hand-computed cases, and a bound on what the real batcher
(with a fake predictor) forms from the same rows."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from api.serving.batch_plan import Work, planned_work
from api.serving.batching import Batcher, BatchLimits, BatchStats
from tests.support.fake_predictor import FakePredictor

# The LLM queue: 3 texts of 128 tokens, 85 of 48 and 8 of 42 (4,800 real tokens).
QUEUE = Counter({128: 3, 48: 85, 42: 8})
CPU_PADDED = BatchLimits(max_batch_size=32, max_batch_tokens=2048, overhead_tokens=75)
GPU_PADDED = BatchLimits(max_batch_size=32, max_batch_tokens=8192)
CPU_PACKED = BatchLimits(max_batch_size=32, max_batch_tokens=2048, packed=True)


def test_cost_grouped_rows_are_planned_longest_first_each_batch_padded_to_its_first() -> None:
    # 128 fits 2048 // 128 = 16 rows: 3 × 128 and 13 × 48, padded 16 × 128 = 2,048;
    # then 32 × 48 = 1,536 twice; then 8 × 48 with 8 × 42, padded 16 × 48 = 768.
    assert planned_work(QUEUE, CPU_PADDED) == Work(4, 2048 + 1536 + 1536 + 768)


def test_closest_length_rows_are_planned_padded_to_the_longest() -> None:
    # 96 rows padded to 128, in batches of min(32, 8192 // 128) = 32.
    assert planned_work(QUEUE, GPU_PADDED) == Work(3, 96 * 128)


def test_packed_rows_cost_their_real_tokens_in_as_many_batches_as_first_fit_can_leave() -> None:
    # Every batch but the last is full by rows (32) or past 2048 - 128 tokens:
    # 1 + floor(96 / 32 + 4800 / 1921) = 1 + floor(5.4987) = 6.
    assert planned_work(QUEUE, CPU_PACKED) == Work(6, 384 + 85 * 48 + 8 * 42)


def test_rows_longer_than_a_batch_run_alone() -> None:
    rows = Counter({300: 2, 10: 5})
    closest = BatchLimits(max_batch_size=32, max_batch_tokens=256)
    assert planned_work(rows, closest) == Work(7, 7 * 300)
    grouped = BatchLimits(max_batch_size=32, max_batch_tokens=256, overhead_tokens=5)
    assert planned_work(rows, grouped) == Work(3, 300 + 300 + 5 * 10)
    packed = BatchLimits(max_batch_size=32, max_batch_tokens=256, packed=True)
    assert planned_work(rows, packed) == Work(7, 650)
    assert planned_work(Counter(), grouped) == Work(0, 0)


def longest_first_row_by_row(lengths: list[int], limits: BatchLimits) -> Work:
    """The cost model's plan one row at a time: the rows longest first, each joining the
    open batch while it has room (rows that fit its first row's length), else opening one."""
    batches = tokens = taken = room = padded_to = 0
    for length in sorted(lengths, reverse=True):
        if taken == room:
            batches, taken, padded_to = batches + 1, 0, length
            room = max(1, min(limits.max_batch_size, limits.max_batch_tokens // length))
        taken += 1
        tokens += padded_to
    return Work(batches, tokens)


def test_the_cost_models_plan_is_the_row_by_row_plan() -> None:
    # The plan takes each length's rows at once (arithmetic); the reference takes one row a
    # step. Lengths counted 0 or less (a queue's lengths after rows left) count no row.
    for seed in range(300):
        chosen = random.Random(seed)
        limits = BatchLimits(
            max_batch_size=chosen.choice([1, 4, 32]),
            max_batch_tokens=chosen.choice([64, 256, 2048]),
            overhead_tokens=5,
        )
        lengths = chosen.choices(range(1, 300), k=chosen.randint(0, 80))
        counted: dict[int, int] = dict(Counter(lengths))
        counted[1000 + seed] = chosen.choice([0, -1])
        assert planned_work(counted, limits) == longest_first_row_by_row(lengths, limits), seed


async def batches_formed(
    lengths: list[int], limits: BatchLimits, executor: ThreadPoolExecutor
) -> list[BatchStats]:
    """The batches the batcher runs for rows of these lengths, all queued at once behind a
    held batch (at most the cost model's window of rows, so that it weighs them all)."""
    fake = FakePredictor()
    seen: list[BatchStats] = []
    batcher: Batcher[tuple[str | None, int]] = Batcher(fake, limits, executor, on_batch=seen.append)
    batcher.start()
    fake.gate.clear()
    held = asyncio.ensure_future(batcher.submit([[0]], ["a"], 30))
    await asyncio.sleep(0.05)
    # Each row its own ids: identical rows would be computed once.
    queued = [
        asyncio.ensure_future(batcher.submit([[i + 1] * n], ["a"], 30))
        for i, n in enumerate(lengths)
    ]
    await asyncio.sleep(0.05)
    fake.gate.set()
    await asyncio.wait_for(asyncio.gather(held, *queued), 10)
    await batcher.stop()
    return seen[1:]


LIMITS = {
    "packed": BatchLimits(max_batch_size=8, max_batch_tokens=200, max_wait_seconds=0, packed=True),
    "cost model": BatchLimits(
        max_batch_size=8, max_batch_tokens=200, max_wait_seconds=0, overhead_tokens=20
    ),
    "closest length": BatchLimits(max_batch_size=8, max_batch_tokens=200, max_wait_seconds=0),
}


@pytest.mark.parametrize("mode", list(LIMITS))
async def test_the_plan_bounds_what_the_batcher_forms(
    mode: str, executor: ThreadPoolExecutor
) -> None:
    limits = LIMITS[mode]
    for seed in range(8):
        lengths = random.Random(seed).choices(range(1, 61), k=30)
        plan = planned_work(Counter(lengths), limits)
        formed = await batches_formed(lengths, limits, executor)
        assert sum(stats.rows for stats in formed) == len(lengths)
        batches, tokens = len(formed), sum(stats.tokens for stats in formed)
        if mode == "cost model":
            # What the batcher minimises: its overhead per batch plus the padded tokens.
            overhead = limits.overhead_tokens or 0.0
            assert overhead * batches + tokens <= overhead * plan.batches + plan.tokens, seed
        else:
            assert batches <= plan.batches and tokens <= plan.tokens, seed
            if mode == "packed":
                assert tokens == plan.tokens == sum(lengths)
