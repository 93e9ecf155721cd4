"""What a door asks of a service and gets back: the phase, a request to classify, its answer,
and the interface both the core and the split's remote stand-in for it offer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from api.metrics import Metrics
from api.serving.classify import Classified
from api.serving.errors import Unavailable
from api.settings import Settings

# What a caller is told to wait while the service is not serving (loading, draining).
RETRY_AFTER_LOADING_SECONDS = 5


class Phase(str, Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"


@dataclass(frozen=True)
class ClassifyRequest:
    """What a door asks, once its wire format is read: which model (None: the first, or the
    cascade by its name) and adapter, the texts, truncation, whether caches serve, and the
    caller's own time limit (None: the service's; a longer one is cut to it)."""

    texts: list[str]
    model: str | None = None
    adapter: str | None = None
    truncate: bool = True
    use_cache: bool = True
    timeout_seconds: float | None = None

    def seconds_given(self, limit: float) -> float:
        """The time this request has: the caller's own, cut to the service's `limit`."""
        return limit if self.timeout_seconds is None else min(self.timeout_seconds, limit)


@dataclass
class Answer:
    """What `classify` gives a door: the scores, who answered each text, the labels."""

    result: Classified
    answered_by: list[str]
    labels: list[str]
    adapter: str | None  # the adapter of a single model; None for the cascade
    cascade: bool
    cache_tiers: Sequence[str]  # the tiers an answer reports on, in order
    # Per text, the adapter that answered it, where a canary split the texts between the
    # default and its candidate (None: `adapter` answered every text).
    text_adapters: list[str | None] | None = None
    # The positions of the texts answered outside the answering model's declared languages
    # (its on_other_language: answer); None: none was.
    outside_languages: list[int] | None = None

    @property
    def adapter_header(self) -> str:
        """X-Adapter: the adapter, or one per text (in order) where a canary split them."""
        if self.text_adapters is not None:
            return ",".join(name or "" for name in self.text_adapters)
        return self.adapter or ""


class Lifecycle:
    """The phase (loading, ready, failed, draining) and the count of work a drain waits for."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.phase = Phase.LOADING
        self.error: str | None = None
        self.in_flight = 0  # requests (and the split's calls) accepted before any drain began

    @property
    def serving(self) -> bool:
        """Requests are accepted only when every model is ready and no drain has begun."""
        return self.phase is Phase.READY

    def check_serving(self) -> None:
        """Unavailable, with a time to retry, unless the service is ready."""
        if not self.serving:
            raise Unavailable(f"service is {self.phase.value}", RETRY_AFTER_LOADING_SECONDS)

    def begin_drain(self) -> None:
        """No new work from now on (a failed service stays failed); /ready turns 503."""
        if self.phase is not Phase.FAILED:
            self.phase = Phase.DRAINING
        self.metrics.ready.set(0)

    def hold_drain(self) -> bool:
        """Counts work the drain is to wait for; False (not counted) once the service has
        stopped taking work: such work is refused at once, and counted, a steady stream of
        it (clients retrying) would hold the drain open until DRAIN_SECONDS ran out."""
        holds = self.phase not in (Phase.DRAINING, Phase.FAILED)
        if holds:
            self.in_flight += 1
        return holds

    def release_drain(self, held: bool) -> None:
        """The work `hold_drain` counted (`held`) is done."""
        if held:
            self.in_flight -= 1


class Classifier(Protocol):
    """What the HTTP door's classifying routes need: the core, or the split's remote one."""

    settings: Settings
    metrics: Metrics
    phase: Phase
    in_flight: int

    def hold_drain(self) -> bool: ...

    def release_drain(self, held: bool) -> None: ...

    def begin_drain(self) -> None: ...

    def abandon_unanswered(self, reason: str) -> None:
        """Answers the work still waiting with Unavailable for `reason`, at once (the drain
        has run out)."""
        ...

    async def classify(self, request: ClassifyRequest) -> Answer:
        """The texts scored, or a refusal of api.serving.errors."""
        ...
