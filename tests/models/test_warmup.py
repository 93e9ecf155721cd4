"""The warm-up runs the largest batches the batcher can form: never more, and never less."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.models.predictor import Predictor
from api.models.registry import Registry
from api.models.warmup import warmup_batches
from api.serving.batching import Batcher, BatchLimits
from tests.support.in_process import make_settings, spec_for
from tests.support.tiny_models import TinyModel


def padded_shape(lengths: list[int], multiple: int | None = None) -> tuple[int, int]:
    """(rows, padded length) of a padded batch of rows of these lengths."""
    step = multiple or 1
    return len(lengths), -(-max(lengths) // step) * step


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_no_forward_at_load_exceeds_max_batch_tokens(
    tiny_bert: TinyModel, packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every forward the load runs (warm-up and probes), seen at the predictor."""
    seen: list[list[int]] = []
    forward = Predictor.forward

    def recording(self: Predictor, batch: list[list[int]], adapters: list[str | None]) -> Any:
        seen.append([len(row) for row in batch])
        return forward(self, batch, adapters)

    monkeypatch.setattr(Predictor, "forward", recording)
    # 32 rows of max_length 32 would be 1,024 tokens, the old warm-up's shape.
    settings = make_settings(max_batch_size=32, max_batch_tokens=300, pack_batches=packed)
    registry = Registry([spec_for(tiny_bert, max_length=32)], settings)
    registry.load_all()
    try:
        assert registry.models["tiny"].predictor.packs_batches is packed
        if packed:  # a packed batch costs its real tokens
            costs = [sum(lengths) for lengths in seen]
            assert [32] * 9 + [12] in seen  # 300 tokens: rows of max_length and the rest
        else:
            costs = [rows * longest for rows, longest in map(padded_shape, seen)]
            shapes = {padded_shape(lengths) for lengths in seen}
            # Longest rows (9 × 32 = 288 tokens), and most tokens (10 × 30 = 300).
            assert {(9, 32), (10, 30)} <= shapes
        assert max(costs) == 300, seen
    finally:
        registry.close()


def test_warmup_shapes_for_the_users_gpu_settings() -> None:
    """MAX_BATCH_SIZE 32 and MAX_BATCH_TOKENS 8192 at KoELECTRA's and EXAONE's lengths."""
    assert warmup_batches(256, 32, 8192) == [[256] * 32]
    assert warmup_batches(512, 32, 8192) == [[512] * 16]
    # Not a divisor: 27 rows of 300 leave 92 tokens unused, 32 rows of 256 fill the budget.
    assert warmup_batches(300, 32, 8192) == [[300] * 27, [256] * 32]
    # One row runs alone whatever its length; two of half the budget hold more.
    assert warmup_batches(5000, 32, 8192) == [[4096] * 2]
    assert warmup_batches(512, 32, 8192, packed=True) == [[512] * 16]
    assert warmup_batches(300, 32, 8192, packed=True) == [[300] * 27 + [92]]
    # Length buckets of 8, compared as padded: 12 rows of 25 run as 12 × 32 (most attention),
    # 32 rows of 9 as 32 × 16 (most tokens: the batcher counts them unpadded, 288).
    assert warmup_batches(32, 32, 300, pad_to_multiple_of=8) == [[25] * 12, [9] * 32]


def batches_formed(
    lengths: list[int], limits: BatchLimits, multiple: int | None
) -> list[list[int]]:
    """The row lengths of each batch the real batcher forms from rows of `lengths`, all
    queued before it starts."""
    formed: list[list[int]] = []

    def predict(rows: list[list[int]], adapters: list[str | None]) -> list[int]:
        formed.append([len(row) for row in rows])
        return [0] * len(rows)

    async def run() -> None:
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher: Batcher[int] = Batcher(predict, limits, executor)
            # Distinct texts: identical ones in flight would share a row.
            pending = [
                asyncio.ensure_future(batcher.submit([[index] * n], [None], 30))
                for index, n in enumerate(lengths)
            ]
            await asyncio.sleep(0)  # every row queued
            batcher.start()
            await asyncio.wait_for(asyncio.gather(*pending), 30)
            await batcher.stop()

    asyncio.run(run())
    return formed


Measure = Callable[[list[int]], int]


def measures(packed: bool, multiple: int | None) -> dict[str, Measure]:
    """What a batch's memory grows with: its tokens, and its rows × length² (attention)."""
    if packed:
        return {"tokens": sum, "attention": lambda ls: sum(n * n for n in ls)}

    def tokens(lengths: list[int]) -> int:
        rows, length = padded_shape(lengths, multiple)
        return rows * length

    def attention(lengths: list[int]) -> int:
        rows, length = padded_shape(lengths, multiple)
        return rows * length * length

    return {"tokens": tokens, "attention": attention}


@settings(max_examples=60, deadline=None)
@given(
    max_length=st.integers(1, 40),
    max_batch_size=st.integers(1, 12),
    max_batch_tokens=st.integers(1, 200),
    packed=st.booleans(),
    overhead=st.none() | st.floats(0, 100),
    multiple=st.none() | st.integers(2, 8),
    data=st.data(),
)
def test_the_warmup_is_a_batch_the_batcher_forms_and_no_batch_is_larger(
    max_length: int,
    max_batch_size: int,
    max_batch_tokens: int,
    packed: bool,
    overhead: float | None,
    multiple: int | None,
    data: st.DataObject,
) -> None:
    multiple = None if packed else multiple  # a packed batch has no padding
    limits = BatchLimits(
        max_batch_size=max_batch_size,
        max_batch_tokens=max_batch_tokens,
        max_wait_seconds=0,
        max_queue_requests=1000,
        overhead_tokens=None if packed else overhead,
        packed=packed,
    )
    warmup = warmup_batches(max_length, max_batch_size, max_batch_tokens, packed, multiple)
    assert 1 <= len(warmup) <= 2
    # Never more: each warm-up batch, queued alone, is one batch the batcher forms.
    greedy = replace(limits, overhead_tokens=None)
    for lengths in warmup:
        assert sorted(map(sorted, batches_formed(lengths, greedy, multiple))) == [sorted(lengths)]
    # Never less: no batch formed from any queue is larger in either measure.
    queue = data.draw(st.lists(st.integers(1, max_length), min_size=1, max_size=40))
    for name, measure in measures(packed, multiple).items():
        largest = max(measure(lengths) for lengths in warmup)
        for batch in batches_formed(queue, limits, multiple):
            assert measure(batch) <= largest, (name, batch, warmup)
