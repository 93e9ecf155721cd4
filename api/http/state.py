"""The service's life cycle (loading, ready, failed, draining) and what routes share."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from api.metrics import Metrics
from api.models.registry import Registry
from api.serving.cache import ResultCache
from api.serving.cascade import Cascade
from api.serving.classify import ModelRunner
from api.settings import Settings

if TYPE_CHECKING:
    from api.http.split.front_end import ModelSideLink

# What a client is told to wait while the service is not serving (loading, draining).
RETRY_AFTER_LOADING_SECONDS = "5"


class Phase(str, Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"


@dataclass
class ServiceState:
    """What every route reads: settings, models, runners, cache, metrics, and the phase."""

    settings: Settings
    registry: Registry
    metrics: Metrics
    cache: ResultCache | None = None
    phase: Phase = Phase.LOADING
    error: str | None = None
    runners: dict[str, ModelRunner] = field(default_factory=dict)
    cascade: Cascade | None = None
    in_flight: int = 0  # requests (and the split's calls) accepted before any drain began
    model_side: ModelSideLink | None = None  # a front end's link to the models (the split)

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

    @property
    def serving(self) -> bool:
        """Requests are accepted only when every model is ready and no drain has begun."""
        return self.phase is Phase.READY
