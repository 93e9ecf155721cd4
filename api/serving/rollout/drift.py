"""What each adapter answers, counted for drift: its labels and its positive-class score."""

from __future__ import annotations

from collections.abc import Mapping

from api.metrics import Metrics
from api.models.predictor import Scores
from api.serving.rollout.comparison import label_of, positive_score


def count_answers(
    metrics: Metrics,
    labels: Mapping[str, list[str]],
    answered_by: list[str],
    adapters: list[str | None],
    scores: list[Scores],
) -> None:
    """Predictions, labels and P(second label) per model (its `labels`) and adapter, for the
    texts of one request; each series looked up once per request."""
    counted: dict[tuple[str, str], list[Scores]] = {}
    for name, adapter, one in zip(answered_by, adapters, scores, strict=True):
        counted.setdefault((name, adapter or "none"), []).append(one)
    for (name, adapter), answers in counted.items():
        metrics.labelled(metrics.predictions, name, adapter).inc(len(answers))
        names = labels[name]
        per_label = [0] * len(names)
        histogram = metrics.labelled(metrics.answer_positive_score, name, adapter)
        for one in answers:
            per_label[label_of(one)] += 1
            positive = positive_score(one)
            if positive is not None:
                histogram.observe(positive)
        for label, count in zip(names, per_label, strict=True):
            if count:
                metrics.labelled(metrics.answer_labels, name, adapter, label).inc(count)
