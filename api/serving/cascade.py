"""The confidence cascade: the cheap model answers; unsure texts go on to the second model."""

from __future__ import annotations

from dataclasses import dataclass

from api.metrics import Metrics
from api.models.spec import ModelSpec
from api.observability import tracing
from api.serving.cache import ResultCache
from api.serving.classify import Classified, ModelRunner
from api.settings import Settings

CASCADE_NAME = "cascade"
# For a first model whose models file names no threshold: a guess, not a fit. The embedded
# pair's is fitted on validation texts (artifacts/spam-smollm2/MODEL_CARD.md).
FALLBACK_THRESHOLD = 0.9


class CascadeError(ValueError):
    """A cascade that cannot be built from the declared models."""


@dataclass
class Cascade:
    """Two runners with the same labels; `threshold` on the first one's top probability."""

    first: ModelRunner
    second: ModelRunner
    threshold: float
    metrics: Metrics
    threshold_source: str

    @property
    def runners(self) -> tuple[ModelRunner, ModelRunner]:
        return self.first, self.second

    def __post_init__(self) -> None:
        first, second = self.first.served.loaded.labels, self.second.served.loaded.labels
        if first != second:
            raise CascadeError(f"cascade models disagree on labels: {first} vs {second}")

    async def classify(
        self, texts: list[str], truncate: bool, cache: ResultCache | None, deadline: float
    ) -> tuple[Classified, list[str]]:
        """Scores every text with the first model, and the unsure ones again with the second,
        both stages within the request's one `deadline` (monotonic clock). Each model uses
        its default adapter, and caches under that servable's identity.

        Returns the scores and, per text, the name of the model that gave them.
        """
        result = await self.first.classify(texts, None, truncate, cache, deadline)
        answered_by = [self.first.served.name] * len(texts)
        unsure = [
            index
            for index, scores in enumerate(result.scores)
            if max(scores.probabilities) < self.threshold
        ]
        if unsure:
            with tracing.span("cascade second stage") as stage:
                if stage is not None:
                    stage.set_attribute("loraserve.texts", len(unsure))
                again = await self.second.classify(
                    [texts[i] for i in unsure], None, truncate, cache, deadline
                )
            for index, scores, tier in zip(unsure, again.scores, again.tiers, strict=True):
                result.scores[index] = scores
                result.tiers[index] = tier
                answered_by[index] = self.second.served.name
            self.metrics.cascade_escalations.inc(len(unsure))
        return result, answered_by


def cascade_threshold(settings: Settings, first: ModelSpec) -> tuple[float, str]:
    """The cascade's threshold and where it was set: CASCADE_THRESHOLD, else the first
    model's `cascade_threshold` in the models file, else FALLBACK_THRESHOLD."""
    if settings.cascade_threshold is not None:
        return settings.cascade_threshold, "CASCADE_THRESHOLD"
    if first.cascade_threshold is not None:
        return first.cascade_threshold, "models file"
    return FALLBACK_THRESHOLD, "fallback"


def cascade_models(settings: Settings, specs: list[ModelSpec]) -> tuple[str, str] | None:
    """The (first, second) model names of the cascade, or None when fewer than two are served."""
    names = [spec.name for spec in specs]
    if CASCADE_NAME in names:
        raise CascadeError(f"{CASCADE_NAME!r} is the cascade's name; rename that model")
    first = settings.cascade_first_model or names[0]
    second = settings.cascade_second_model or next((n for n in names if n != first), None)
    for setting, name in (("CASCADE_FIRST_MODEL", first), ("CASCADE_SECOND_MODEL", second)):
        if name is not None and name not in names:
            raise CascadeError(f"{setting}: no declared model {name!r} (models: {names})")
    if second is None:
        return None
    if first == second:
        raise CascadeError("CASCADE_FIRST_MODEL and CASCADE_SECOND_MODEL name the same model")
    return first, second
