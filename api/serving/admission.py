"""Admission by time: a request is queued only when it can be answered within its deadline
and the latency target, judged from the model's measured cost and what is queued before it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# Recent batches weigh most: a weight that halves every ~14 batches follows a change of load
# (or of the text lengths served) within a second or two at the rates this CPU serves.
DECAY = 0.95
# Fewer batches than this say too little to judge a request's cost on.
MIN_BATCHES = 3
# Before that, at most this many batches' worth of rows may wait.
COLD_START_BATCHES = 2
# The share of the target (or of a deadline) that the expected wait may fill. The estimate is
# a mean: at 128 clients the queue's actual drain ran up to 1.3x it (forwards slow down while
# the event loop is busy), and the time a request spends before and after the queue (read,
# cache, tokenize, answer) is outside it. 0.75 kept every 200 under a 2 s target there.
HEADROOM = 0.75


class NotAdmitted(Exception):
    """The request would finish past its deadline or the latency target: try again later."""

    def __init__(self, expected_seconds: float, limit_seconds: float, retry_after: int) -> None:
        expected = "unmeasured" if math.isnan(expected_seconds) else f"{expected_seconds:.2f} s"
        super().__init__(
            f"expected to take {expected} behind the queued work, over "
            f"{limit_seconds:.2f} s; retry in {retry_after} s"
        )
        self.retry_after = retry_after


@dataclass
class CostEstimate:
    """What a forward costs on one model: `per_batch + per_token × tokens` seconds, fitted by
    exponentially weighted least squares over the batches it ran."""

    _weight: float = 0.0
    _tokens: float = 0.0
    _seconds: float = 0.0
    _tokens_squared: float = 0.0
    _tokens_seconds: float = 0.0
    batches: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """Adds one batch's tokens and wall time."""
        self._weight = DECAY * self._weight + 1
        self._tokens = DECAY * self._tokens + tokens
        self._seconds = DECAY * self._seconds + seconds
        self._tokens_squared = DECAY * self._tokens_squared + tokens * tokens
        self._tokens_seconds = DECAY * self._tokens_seconds + tokens * seconds
        self.batches += 1

    def per_token_and_batch(self) -> tuple[float, float] | None:
        """(seconds per token, seconds per batch), or None before MIN_BATCHES batches."""
        if self.batches < MIN_BATCHES or self._tokens <= 0:
            return None
        mean_tokens = self._tokens / self._weight
        mean_seconds = self._seconds / self._weight
        variance = self._tokens_squared / self._weight - mean_tokens**2
        if variance > 1e-9 * mean_tokens**2:
            slope = (self._tokens_seconds / self._weight - mean_tokens * mean_seconds) / variance
            intercept = mean_seconds - slope * mean_tokens
            if slope > 0 and intercept >= 0:
                return slope, intercept
        # One batch size seen (or a fit that makes no sense): all of it per token.
        return mean_seconds / mean_tokens, 0.0

    def seconds(self, tokens: int, batches: int) -> float | None:
        """Expected seconds to run `tokens` tokens in `batches` batches; None if unknown."""
        fitted = self.per_token_and_batch()
        if fitted is None:
            return None
        per_token, per_batch = fitted
        return per_token * tokens + per_batch * batches


@dataclass
class Admission:
    """Admits a request when its expected completion fits its deadline and the target."""

    target_seconds: float
    max_batch_size: int
    cost: CostEstimate = field(default_factory=CostEstimate)
    on_refuse: Callable[[], None] | None = None  # for metrics
    enabled: bool = True  # off: every request is queued (up to the queue's bound)

    def check(
        self, queued_rows: int, queued_tokens: int, rows: int, tokens: int, seconds_left: float
    ) -> None:
        """Raises NotAdmitted when `rows` of `tokens` tokens, queued behind `queued_rows` rows
        of `queued_tokens` tokens, would finish past `seconds_left` or the target."""
        if not self.enabled or queued_rows == 0:
            # With nothing queued ahead, waiting could not make it sooner: a request whose
            # own cost passes the limit (many long texts on a slow model) is run as soon as
            # the device is free, not refused with a Retry-After that would never help.
            return
        all_rows = queued_rows + rows
        batches = math.ceil(all_rows / self.max_batch_size) + 1  # +1: the one running now
        expected = self.cost.seconds(queued_tokens + tokens, batches)
        limit = HEADROOM * min(seconds_left, self.target_seconds)
        if expected is None:
            # Nothing measured yet (the first batches after start): admit what two batches
            # hold, so that a burst at start cannot queue more than a few batches unmeasured.
            if all_rows <= COLD_START_BATCHES * self.max_batch_size:
                return
            self._refused()
            raise NotAdmitted(float("nan"), limit, 1)
        if expected <= limit:
            return
        self._refused()
        ahead = self.cost.seconds(queued_tokens, batches - 1) or 0.0
        # Retry once what is queued now has drained, in whole seconds as HTTP says.
        raise NotAdmitted(expected, limit, max(1, math.ceil(ahead)))

    def _refused(self) -> None:
        if self.on_refuse is not None:
            self.on_refuse()
