"""The shapes CUDA graphs are recorded at (api.models.cuda_graphs.Buckets), on any device:
tests/models/test_gpu.py records and replays them on a GPU."""

from __future__ import annotations

from api.models.cuda_graphs import Buckets


def test_a_batch_runs_at_its_bucket_or_at_none_past_the_limits() -> None:
    buckets = Buckets(max_rows=48, max_length=100)
    assert buckets.of(1, 1) == (1, 32)
    assert buckets.of(3, 33) == (4, 64)
    assert buckets.of(33, 97) == (48, 100)
    assert buckets.of(49, 8) is None and buckets.of(2, 101) is None
