"""A circuit breaker for a tier that may be slow or down: skip it for a while, then try once."""

from __future__ import annotations

import time
from collections.abc import Callable


class Breaker:
    """Closed, calls go through. A fault opens it: calls are skipped for `first_wait`
    seconds, then one call (the probe) goes through. The probe's success closes it; its
    fault opens it again for twice as long, up to `max_wait`.

    Calls already under way when it opened may still fail: those do not lengthen the wait,
    or a burst of concurrent timeouts would push it to `max_wait` at once.
    """

    def __init__(
        self, first_wait: float, max_wait: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.first_wait = first_wait
        self.max_wait = max_wait
        self._clock = clock
        self._wait = 0.0  # 0 while closed
        self._retry_at = 0.0
        self._probing = False

    @property
    def closed(self) -> bool:
        return self._wait == 0.0

    @property
    def wait(self) -> float:
        """Seconds the tier is skipped for after the last fault (0 while closed)."""
        return self._wait

    def allow(self) -> bool:
        """Whether a call may go to the tier now (while open: the one probe, when due)."""
        if self.closed:
            return True
        if self._probing or self._clock() < self._retry_at:
            return False
        self._probing = True
        return True

    def succeeded(self) -> bool:
        """A call answered; True when that closes the breaker."""
        reopened = not self.closed
        self._wait, self._probing = 0.0, False
        return reopened

    def abandoned(self) -> None:
        """A call let through was cancelled before it answered (its client went away): it
        tells nothing, so the next call may probe in its place."""
        self._probing = False

    def failed(self) -> bool:
        """A call faulted; True when that opens a closed breaker."""
        opened = self.closed
        if opened:
            self._wait = self.first_wait
        elif self._probing:
            self._wait = min(self._wait * 2, self.max_wait)
        else:
            return False  # a straggler from before it opened
        self._retry_at = self._clock() + self._wait
        self._probing = False
        return opened
