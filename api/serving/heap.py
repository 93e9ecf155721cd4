"""Python's cyclic garbage collector, set for serving once start-up is done, set back after."""

from __future__ import annotations

import gc


class ServingHeap:
    """Freezes what start-up built and raises the youngest generation's threshold while the
    service serves; `release` undoes both (at shutdown, or in a test's process).

    Freezing: an oldest-generation collection walks every tracked object, and start-up
    leaves hundreds of thousands that live as long as the process, so each one pauses the
    event loop and the forward alike. An adapter attached at start-up and detached later is
    still freed: by reference counts, which freezing leaves alone (tested).

    The threshold: a youngest-generation collection walks every container made since the
    last one and still alive, which under load are the requests in flight, so at Python's
    default a one-text request pays for a share of one every few requests. What serving
    makes is freed by reference counts; the collector is only for the few cycles among it,
    which wait a little longer. What each costs: bench/reports/measured_in_tests.md, "The
    collector".
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
