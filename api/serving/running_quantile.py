"""A running estimate of a high quantile of a positive stream (a ratio), that follows it as
it changes."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RunningQuantile:
    """Moves its estimate a step up for each sample above it and a step down for each below,
    the steps weighted so that it settles where `quantile` of the samples lie below it
    (stochastic gradient descent on the quantile's loss). Kept as a logarithm, so that a
    ratio twice as large moves it as far as one half as large.
    """

    quantile: float
    step: float  # in natural-log units
    start: float = 1.0  # the value before any sample
    floor: float = 1.0  # the least value it takes: below it, it would have to climb back
    ceiling: float = math.inf  # the most: past it, a burst of outliers would take long to undo
    _log_value: float = 0.0

    def __post_init__(self) -> None:
        self._log_value = math.log(min(max(self.start, self.floor), self.ceiling))

    def observe(self, sample: float) -> None:
        """Adds one sample (> 0)."""
        if math.log(sample) > self._log_value:
            highest = math.log(self.ceiling)
            self._log_value = min(highest, self._log_value + self.step * self.quantile)
        else:
            lowest = math.log(self.floor)
            self._log_value = max(lowest, self._log_value - self.step * (1 - self.quantile))

    @property
    def value(self) -> float:
        """The estimate."""
        return math.exp(self._log_value)
