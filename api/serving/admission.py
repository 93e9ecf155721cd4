"""Admission by time: a request is queued only when it can be answered within its deadline
and the latency target, judged from the model's measured cost and what is queued before it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from api.serving.batch_plan import Work
from api.serving.batching import Backlog, BatchStats
from api.serving.running_quantile import RunningQuantile

# Recent batches weigh most: a weight that halves every ~14 batches follows a change of load
# (or of the text lengths served) within a second or two at the rates this CPU serves.
DECAY = 0.95
# Fewer batches than this say too little to judge a request's cost on.
MIN_BATCHES = 3
# The share of the target (or of a deadline) that the expected wait may fill: the time a
# request spends before and after the queue (read, cache, tokenize, answer) is outside the
# estimate, and the overrun below is learnt from waits already past, not foreseen.
HEADROOM = 0.75
# The backlog's estimate covers the work queued when a request comes, but the batcher runs
# rows of similar length together, so rows that come later may run before a request's own
# (and a CPU shared with other work slows down at random). Estimates are scaled by this
# quantile of how far the waits of admitted requests ran over theirs, learnt as they come:
# a step of 0.1 (in logarithms) moves it by 1.1x in a few slow answers. It starts where the
# LLM's overloaded waits settled on this shared CPU, so that the first overload after a start
# is not admitted on estimates that nothing has checked yet; it comes down as answers come
# within theirs (by 0.5 % each).
OVERRUN_QUANTILE = 0.95
OVERRUN_STEP = 0.1
OVERRUN_START = 2.0
# At most this: waits further over their estimates are the machine stalling (a forward held
# for seconds by a descheduled thread), which no scaling foresees, and a burst of them (every
# request queued behind one stall) would otherwise keep refusing long after it.
OVERRUN_MAX = 4.0


# What a refusal was judged on (the label of loraserve_admission_refusals_total): the texts'
# lengths estimated from their characters, before tokenizing, or their tokens.
ON_ESTIMATE, ON_TOKENS = "estimate", "tokens"


class NotAdmitted(Exception):
    """The request would finish past its deadline or the latency target: try again later."""

    def __init__(self, expected_seconds: float, limit_seconds: float, retry_after: int) -> None:
        expected = "unmeasured" if math.isnan(expected_seconds) else f"{expected_seconds:.2f} s"
        super().__init__(
            f"expected to take {expected} behind the queued work, over "
            f"{limit_seconds:.2f} s; retry in {retry_after} s"
        )
        self.expected_seconds = expected_seconds
        self.retry_after = retry_after


@dataclass
class CostEstimate:
    """What a forward costs on one model: `per_batch + per_token × tokens` seconds, fitted by
    exponentially weighted least squares over the batches it ran. Tokens are what the
    forward computes (padding counted unless packed), here as in the work it is applied to.
    """

    _weight: float = 0.0
    _tokens: float = 0.0
    _seconds: float = 0.0
    _tokens_squared: float = 0.0
    _tokens_seconds: float = 0.0
    batches: int = 0
    # The fit of the batches so far, made once for the many requests judged between batches.
    _fitted: Fit | None = field(default=None, repr=False)
    _stale: bool = field(default=True, repr=False)

    def observe(self, tokens: int, seconds: float) -> None:
        """Adds one batch's tokens and wall time."""
        self._weight = DECAY * self._weight + 1
        self._tokens = DECAY * self._tokens + tokens
        self._seconds = DECAY * self._seconds + seconds
        self._tokens_squared = DECAY * self._tokens_squared + tokens * tokens
        self._tokens_seconds = DECAY * self._tokens_seconds + tokens * seconds
        self.batches += 1
        self._stale = True

    def start_from(self, samples: Iterable[tuple[int, float]]) -> None:
        """Adds forwards timed at load (Predictor.probe_batches) as batches: the fit starts
        from them, and the batches served soon outweigh them."""
        for tokens, seconds in samples:
            self.observe(tokens, seconds)

    def fit(self) -> Fit | None:
        """The fitted cost, or None before MIN_BATCHES batches."""
        if self._stale:
            self._fitted, self._stale = self._fit(), False
        return self._fitted

    def _fit(self) -> Fit | None:
        if self.batches < MIN_BATCHES or self._tokens <= 0:
            return None
        mean_tokens = self._tokens / self._weight
        mean_seconds = self._seconds / self._weight
        variance = self._tokens_squared / self._weight - mean_tokens**2
        if variance > 1e-9 * mean_tokens**2:
            slope = (self._tokens_seconds / self._weight - mean_tokens * mean_seconds) / variance
            if abs(slope) * mean_tokens <= 1e-9 * mean_seconds:
                slope = 0.0  # a cost per batch alone, but for rounding
            intercept = mean_seconds - slope * mean_tokens
            if slope >= 0 and intercept >= 0:
                return Fit(slope, intercept)
        # One batch size seen (or a fit that makes no sense): all of it per token.
        return Fit(mean_seconds / mean_tokens, 0.0)


@dataclass(frozen=True)
class Fit:
    """A forward's cost: `per_batch + per_token × tokens` seconds."""

    per_token: float
    per_batch: float

    def seconds(self, work: Work) -> float:
        """Expected seconds to run `work`."""
        return self.per_token * work.tokens + self.per_batch * work.batches


@dataclass
class Admission:
    """Admits a request when its expected completion fits its deadline and the target."""

    target_seconds: float
    cost: CostEstimate = field(default_factory=CostEstimate)
    # The waits over their estimates (at least 1: the estimate of the backlog is not
    # lowered below what that work costs).
    overrun: RunningQuantile = field(
        default_factory=lambda: RunningQuantile(
            OVERRUN_QUANTILE, OVERRUN_STEP, OVERRUN_START, ceiling=OVERRUN_MAX
        )
    )
    on_refuse: Callable[[str], None] | None = None  # for metrics: what it was judged on
    enabled: bool = True  # off: every request is queued (up to the queue's bound)

    def batch_ran(self, stats: BatchStats) -> None:
        """Adds a batch's cost; not a failed one's, whose time says nothing of it."""
        if not stats.failed:
            self.cost.observe(stats.tokens, stats.run_seconds)

    def check(
        self, backlog: Backlog, seconds_left: float, judged_on: str = ON_TOKENS
    ) -> float | None:
        """Raises NotAdmitted when the request would finish past `seconds_left` or the
        target: after the running batch's rest and every batch its rows and the rows queued
        before it make (see Backlog; `judged_on` says whether its rows are tokenized or
        estimated). Else returns its wait as estimated from the backlog, for `waited` (None:
        unmeasured, or admission off)."""
        if not self.enabled:
            return None
        limit = HEADROOM * min(seconds_left, self.target_seconds)
        fit = self.cost.fit()
        if fit is None:
            # Nothing measured (no batch served, and none of the load's probe forwards,
            # which start the fit: `start_from`): one request at a time may wait, so that a
            # burst cannot queue more than it can judge.
            if backlog.ahead.batches == 0:
                return None
            self._refused(judged_on)
            raise NotAdmitted(float("nan"), limit, 1)
        running_left = 0.0
        if backlog.running_tokens:  # at least nothing, once it has run past its estimate
            running = fit.seconds(Work(1, backlog.running_tokens))
            running_left = max(0.0, running - backlog.running_seconds)
        estimate = running_left + fit.seconds(backlog.total)
        expected = self.overrun.value * estimate
        if expected <= limit:
            return estimate
        if backlog.ahead.batches == 0 and self.overrun.value * fit.seconds(backlog.own) > limit:
            # With nothing queued ahead, waiting could not make it fit: a request whose own
            # cost passes the limit (many long texts on a slow model) is run as soon as the
            # device is free, not refused with a Retry-After that would never help. (With
            # nothing running either, that is every request refused so far: were it
            # refused, no batch would run to correct the estimate.)
            return estimate
        self._refused(judged_on)
        # Retry once what runs and is queued now has drained, in whole seconds as HTTP says.
        ahead = self.overrun.value * (running_left + fit.seconds(backlog.ahead))
        raise NotAdmitted(expected, limit, max(1, math.ceil(ahead)))

    def waited(self, estimate: float, seconds: float) -> None:
        """Adds how long an admitted request waited for its rows against the estimate
        `check` returned for it."""
        if estimate > 0:
            self.overrun.observe(max(seconds, 1e-6) / estimate)

    def _refused(self, judged_on: str) -> None:
        if self.on_refuse is not None:
            self.on_refuse(judged_on)
