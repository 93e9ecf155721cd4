"""The metrics of one servable's answers against a file's labels, and where servables
disagree. Computed by hand: they are a few counts, and no metrics library is a dependency.

A two-label model decides for its second label ("positive", e.g. spam) when the served
score of that label is above 0.5: the server re-centres its scores on the model's
`decision_threshold`, so this is the decision at that threshold. Other thresholds are given
on the served scale and, for the models file, on the model's own.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from api.batch.scoring import Outcome, Servable

SERVED_DECISION = 0.5
THRESHOLD_DECIMALS = 6


@dataclass(frozen=True)
class Judged:
    """One row as evaluated: its number, id, expected label and outcome."""

    row: int
    id: object
    expected: str | None
    outcome: Outcome | None

    @property
    def predicted(self) -> str | None:
        ok = self.outcome is not None and self.outcome.ranked is not None
        return self.outcome.ranked[0]["label"] if ok else None  # type: ignore[union-attr,index]

    def score_of(self, label: str) -> float:
        assert self.outcome is not None and self.outcome.ranked is not None
        return float(next(s["score"] for s in self.outcome.ranked if s["label"] == label))


def ratio(part: float, whole: float) -> float:
    """part / whole; 0 where whole is 0 (no such rows: nothing to be right or wrong on)."""
    return part / whole if whole else 0.0


def f1(precision: float, recall: float) -> float:
    return ratio(2 * precision * recall, precision + recall)


def evaluate(
    servable: Servable, judged: Sequence[Judged], cost_fp: float, cost_fn: float
) -> dict[str, Any]:
    """Rows, accuracy, per-label precision/recall/F1, the negative label's false-positive
    rate, the confusion matrix, and for two labels the metrics at the decision threshold and
    at the threshold of least cost."""
    labels = servable.labels
    counted = [j for j in judged if j.predicted is not None and j.expected in labels]
    errors = sum(1 for j in judged if j.predicted is None)
    confusion = {e: dict.fromkeys(labels, 0) for e in labels}
    for j in counted:
        confusion[j.expected][j.predicted] += 1  # type: ignore[index]
    per_label = {}
    for label in labels:
        tp = confusion[label][label]
        predicted = sum(confusion[e][label] for e in labels)
        support = sum(confusion[label].values())
        precision, recall = ratio(tp, predicted), ratio(tp, support)
        per_label[label] = {
            "precision": precision,
            "recall": recall,
            "f1": f1(precision, recall),
            "support": support,
        }
    negative = labels[0]
    negatives = sum(confusion[negative].values())
    report: dict[str, Any] = {
        "servable": servable.column,
        "rows": len(judged),
        "scored": len(counted),
        "errors": errors,
        "unlabelled": len(judged) - errors - len(counted),
        "accuracy": ratio(sum(confusion[label][label] for label in labels), len(counted)),
        "per_label": per_label,
        "negative_label": negative,
        "negative_false_positive_rate": ratio(negatives - confusion[negative][negative], negatives),
        "confusion": confusion,
    }
    if len(labels) == 2:
        report["thresholds"] = thresholds(servable, counted, cost_fp, cost_fn)
    return report


@dataclass(frozen=True)
class Sweep:
    """Positive-label scores of the positive and the negative rows, sorted: the counts at
    any threshold by bisection, so trying every threshold costs n log n, not n²."""

    positives: list[float]
    negatives: list[float]

    @classmethod
    def of(cls, truth: Sequence[bool], scores: Sequence[float]) -> Sweep:
        pairs = list(zip(truth, scores, strict=True))
        return cls(sorted(s for t, s in pairs if t), sorted(s for t, s in pairs if not t))

    def at(self, threshold: float, cost_fp: float, cost_fn: float) -> dict[str, Any]:
        """Positive when the score is above `threshold`: the counts, rates and cost."""
        tp = len(self.positives) - bisect.bisect_right(self.positives, threshold)
        fp = len(self.negatives) - bisect.bisect_right(self.negatives, threshold)
        fn, tn = len(self.positives) - tp, len(self.negatives) - fp
        precision, recall = ratio(tp, tp + fp), ratio(tp, tp + fn)
        return {
            "tp": tp,
            "fp": fp,
            "tn": tn,
            "fn": fn,
            "accuracy": ratio(tp + tn, tp + fp + tn + fn),
            "precision": precision,
            "recall": recall,
            "f1": f1(precision, recall),
            "false_positive_rate": ratio(fp, fp + tn),
            "cost": cost_fp * fp + cost_fn * fn,
        }


def candidate_thresholds(scores: Sequence[float]) -> list[float]:
    """0.5 and the midpoints between consecutive distinct scores (with 0 below and 1 above:
    everything positive, or nothing), rounded: every decision the scores allow."""
    ordered = sorted({0.0, 1.0, *scores})
    mids = {round((a + b) / 2, THRESHOLD_DECIMALS) for a, b in itertools.pairwise(ordered)}
    return sorted({SERVED_DECISION} | mids)


def thresholds(
    servable: Servable, counted: Sequence[Judged], cost_fp: float, cost_fn: float
) -> dict[str, Any]:
    """The metrics at the decision threshold and at the served threshold of least
    cost_fp × false positives + cost_fn × false negatives (ties: the one nearest 0.5)."""
    positive = servable.labels[1]
    scores = [j.score_of(positive) for j in counted]
    sweep = Sweep.of([j.expected == positive for j in counted], scores)

    def key(threshold: float) -> tuple[float, float]:
        return sweep.at(threshold, cost_fp, cost_fn)["cost"], abs(threshold - 0.5)

    best = min(candidate_thresholds(scores), key=key)
    return {
        "positive_label": positive,
        "cost_fp": cost_fp,
        "cost_fn": cost_fn,
        "decision": {
            "served_threshold": SERVED_DECISION,
            "model_threshold": servable.decision_threshold or SERVED_DECISION,
            **sweep.at(SERVED_DECISION, cost_fp, cost_fn),
        },
        "least_cost": {
            "served_threshold": best,
            "model_threshold": model_threshold(best, servable.decision_threshold),
            **sweep.at(best, cost_fp, cost_fn),
        },
    }


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def model_threshold(served: float, decision_threshold: float | None) -> float:
    """A served-score threshold on the model's own probability scale (what
    `decision_threshold` in the models file would be): served scores are the model's with
    logit(decision_threshold) taken off the positive label's logit."""
    if served <= 0.0 or served >= 1.0:
        return served
    shift = logit(decision_threshold) if decision_threshold is not None else 0.0
    return round(1.0 / (1.0 + math.exp(-(logit(served) + shift))), THRESHOLD_DECIMALS)


def disagreements(columns: Mapping[str, Sequence[Judged]]) -> list[dict[str, Any]]:
    """The rows that every servable scored but not all gave the same label."""
    names = list(columns)
    found = []
    for together in zip(*columns.values(), strict=True):
        labels = [j.predicted for j in together]
        if None in labels or len(set(labels)) == 1:
            continue
        first = together[0]
        found.append(
            {
                "row": first.row,
                "id": first.id,
                "expected": first.expected,
                "labels": dict(zip(names, labels, strict=True)),
                "top_scores": {
                    name: j.score_of(j.predicted) for name, j in zip(names, together, strict=True)
                },
            }
        )
    return found


def precision_recall_curve(
    truth: Sequence[bool], scores: Sequence[float]
) -> tuple[list[float], list[float]]:
    """(recall, precision) at every threshold the scores allow, from the highest down."""
    sweep = Sweep.of(truth, scores)
    recalls, precisions = [], []
    for threshold in reversed(candidate_thresholds(scores)):
        m = sweep.at(threshold, 0.0, 0.0)
        if m["tp"] + m["fp"]:
            recalls.append(m["recall"])
            precisions.append(m["precision"])
    return recalls, precisions
