"""Two adapters' answers to the same texts, compared without keeping the texts: how many,
agreement, label flips by direction, each side's labels, and the score difference."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from api.metrics import SCORE_DIFFERENCE_BUCKETS, Metrics
from api.models.predictor import Scores


def label_of(scores: Scores) -> int:
    """The index of the label an answer gives: its best score (served scores are already
    re-centred on the model's decision_threshold, so this is the served decision)."""
    probabilities = scores.probabilities
    return max(range(len(probabilities)), key=probabilities.__getitem__)


def positive_score(scores: Scores) -> float | None:
    """A two-label answer's probability of its second label (spam); None for other shapes."""
    return scores.probabilities[1] if len(scores.probabilities) == 2 else None


@dataclass
class Comparison:
    """The served adapter's and its candidate's answers to the same texts, counted. The
    metrics' series are looked up once, here, and follow every `add`."""

    model: str
    served: str | None
    candidate: str
    labels: list[str]
    metrics: Metrics
    since: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    texts: int = 0
    agreements: int = 0
    flips: Counter[tuple[str, str]] = field(default_factory=Counter)
    served_labels: Counter[str] = field(default_factory=Counter)
    candidate_labels: Counter[str] = field(default_factory=Counter)
    # Per bucket of SCORE_DIFFERENCE_BUCKETS (upper bounds), how many differences fell in it.
    difference_counts: list[int] = field(default_factory=list)
    difference_sum: float = 0.0

    def __post_init__(self) -> None:
        self.difference_counts = [0] * len(SCORE_DIFFERENCE_BUCKETS)
        # Every series this comparison can fill, at 0 from its start: rates and ratios are
        # defined before the first flip (labels² series at most, a few for spam filters).
        series = (self.model, self.served or "none", self.candidate)
        metrics = self.metrics
        for name in (metrics.candidate_texts, metrics.candidate_agreements):
            metrics.labelled(name, *series)
        for label in self.labels:
            for side in ("served", "candidate"):
                metrics.labelled(metrics.candidate_labels, *series, side, label)
            for other in self.labels:
                if other != label:
                    metrics.labelled(metrics.candidate_flips, *series, label, other)

    def add(self, served: Sequence[Scores | None], candidate: Sequence[Scores | None]) -> list[int]:
        """Counts each text both sides scored (None: a side dropped it); the indexes of the
        texts they label differently."""
        series = (self.model, self.served or "none", self.candidate)
        metrics = self.metrics
        flipped: list[int] = []
        compared = agreed = 0
        for index, (mine, theirs) in enumerate(zip(served, candidate, strict=True)):
            if mine is None or theirs is None:
                continue
            compared += 1
            before, after = self.labels[label_of(mine)], self.labels[label_of(theirs)]
            self.served_labels[before] += 1
            self.candidate_labels[after] += 1
            metrics.labelled(metrics.candidate_labels, *series, "served", before).inc()
            metrics.labelled(metrics.candidate_labels, *series, "candidate", after).inc()
            if before == after:
                agreed += 1
            else:
                self.flips[(before, after)] += 1
                metrics.labelled(metrics.candidate_flips, *series, before, after).inc()
                flipped.append(index)
            old, new = positive_score(mine), positive_score(theirs)
            if old is not None and new is not None:
                difference = new - old
                bucket = bisect.bisect_left(SCORE_DIFFERENCE_BUCKETS, difference)
                self.difference_counts[min(bucket, len(self.difference_counts) - 1)] += 1
                self.difference_sum += difference
                metrics.labelled(metrics.candidate_score_difference, *series).observe(difference)
        self.texts += compared
        self.agreements += agreed
        metrics.labelled(metrics.candidate_texts, *series).inc(compared)
        metrics.labelled(metrics.candidate_agreements, *series).inc(agreed)
        return flipped

    @property
    def flip_rate(self) -> float:
        """Compared texts labelled otherwise by the candidate, as a share (0 before any)."""
        return (self.texts - self.agreements) / self.texts if self.texts else 0.0

    def summary(self) -> dict[str, Any]:
        """The counts as the candidate route answers them."""
        differences = sum(self.difference_counts)
        return {
            "since": self.since.isoformat(),
            "texts": self.texts,
            "agreements": self.agreements,
            "agreement": round(self.agreements / self.texts, 6) if self.texts else None,
            "flip_rate": round(self.flip_rate, 6) if self.texts else None,
            "flips": [
                {"from": before, "to": after, "texts": count}
                for (before, after), count in sorted(self.flips.items())
            ],
            "labels": {
                "served": {label: self.served_labels[label] for label in self.labels},
                "candidate": {label: self.candidate_labels[label] for label in self.labels},
            },
            "score_difference": {
                "texts": differences,
                "mean": round(self.difference_sum / differences, 6) if differences else None,
                "buckets": [
                    {"le": bound, "texts": count}
                    for bound, count in zip(
                        SCORE_DIFFERENCE_BUCKETS, _cumulative(self.difference_counts), strict=True
                    )
                ],
            },
        }


def _cumulative(counts: list[int]) -> list[int]:
    """Prometheus's shape: each bucket counts every value at or below its bound."""
    total, out = 0, []
    for count in counts:
        total += count
        out.append(total)
    return out
