"""A predictor for the batcher's tests: scores each row from its ids alone, and records
the batches it is given."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence


class FakePredictor:
    """Scores a row as (adapter, sum of ids); records every batch it is given."""

    def __init__(
        self, oom_above: int | None = None, fail: bool = False, seconds: float = 0.0
    ) -> None:
        self.batches: list[list[tuple[str | None, list[int]]]] = []
        self.seconds = seconds  # each forward takes this long
        self.gate = threading.Event()
        self.gate.set()
        self.oom_above = oom_above
        self.fail = fail

    def __call__(
        self, rows: list[list[int]], adapters: list[str | None]
    ) -> Sequence[tuple[str | None, int]]:
        self.gate.wait(timeout=10)
        time.sleep(self.seconds)
        self.batches.append(list(zip(adapters, rows, strict=True)))
        if self.oom_above is not None and len(rows) > self.oom_above:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.fail:
            raise ValueError("weights exploded")
        return [(adapter, sum(ids)) for adapter, ids in zip(adapters, rows, strict=True)]

    @property
    def sizes(self) -> list[int]:
        return [len(batch) for batch in self.batches]
