"""Timing a call the way the benchmarks do: untimed warm-ups, then the median of repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(run: Callable[[], object], repeats: int, warmups: int = 1) -> float:
    """Median wall time of `run()` in milliseconds, after `warmups` untimed calls."""
    for _ in range(warmups):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000
