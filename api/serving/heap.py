"""Python's cyclic garbage collector, set for serving once start-up is done, set back after."""

from __future__ import annotations

import gc


class ServingHeap:
    """Freezes what start-up built and raises the youngest generation's threshold while the
    service serves; `release` undoes both (at shutdown, or in a test's process).

    Freezing: Python's oldest-generation collection walks every tracked object. With
    transformers, peft and a model loaded that is hundreds of thousands of objects that live
    as long as the process: measured at 32 clients here, each such collection held the GIL
    ~275 ms, stopping the event loop and the forward alike, a few times a minute; those
    pauses were the served p99 (~300 ms against a ~55 ms mean). Frozen, a collection walks
    only what serving made since. An adapter attached at start-up and detached later is
    still freed: by reference counts, which freezing leaves alone (tested).

    The threshold: a youngest-generation collection walks every container object still
    alive that was made since the last one, and under load those are the requests in
    flight (their coroutines, futures, dicts and lists), thousands of them. At Python's
    default of a collection every 700 net allocations, a one-text request paid for a share
    of one every few requests: 16–18 µs of the event loop's CPU a request on the model path
    (bench/reports/frontend.md). What serving makes is freed by reference counts; the
    collector is only for the few cycles among it, which wait a little longer.
    """

    def __init__(self, gen0_threshold: int) -> None:
        self.gen0_threshold = gen0_threshold
        self._threshold_before: tuple[int, int, int] | None = None

    def settle(self) -> None:
        """Collects what start-up left, freezes the rest, sets the youngest threshold."""
        gc.collect()
        gc.freeze()
        if self._threshold_before is None:
            self._threshold_before = gc.get_threshold()
        _, middle, oldest = self._threshold_before
        gc.set_threshold(self.gen0_threshold, middle, oldest)

    def release(self) -> None:
        """Python's thresholds as they were, start-up's objects collectable again."""
        if self._threshold_before is not None:
            gc.set_threshold(*self._threshold_before)
            self._threshold_before = None
        gc.unfreeze()
