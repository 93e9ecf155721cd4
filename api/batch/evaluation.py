"""The metrics of one servable's answers against a file's labels, and where servables
disagree. Computed by hand: they are a few counts, and no metrics library is a dependency.

A two-label model decides for its second label ("positive", e.g. spam) when the served
score of that label is above 0.5: the server re-centres its scores on the model's
`decision_threshold`, so this is the decision at that threshold. Other thresholds are given
on the served scale and, for the models file, on the model's own.

A servable's answers are kept as Judgements, the least the metrics need: per row the index
of the expected and of the predicted label and the positive label's score, never the text,
id or ranked answer, so a file of millions of rows is evaluated in tens of MB.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from api.batch.rows import Row
from api.batch.scoring import Outcome, Ranked, Servable
from api.batch.target_fpr import (
    allowed_false_positives,
    lowest_cut,
    negatives_needed,
    shortest_between,
)
from api.serving.activations import sigmoid
from api.serving.cascade import CASCADE_NAME

SERVED_DECISION = 0.5
THRESHOLD_DECIMALS = 6
# A label index for no label: an expected label that is none of the servable's (or none at
# all), or the prediction of a row with no answer (an error).
NO_LABEL = -1


def label_code(count: int) -> str:
    """The smallest array typecode holding NO_LABEL and the index of each of `count` labels:
    one byte a row for any classifier of up to 127 labels."""
    for code in ("b", "h", "i"):
        if count < 2 ** (8 * array(code).itemsize - 1):
            return code
    return "q"


def score_of(ranked: Ranked, label: str) -> float:
    return float(next(s["score"] for s in ranked if s["label"] == label))


class Judgements:
    """One servable's answers to a file's rows, in row order: per row the index among its
    labels of the expected and of the predicted label (NO_LABEL: none of them, or no answer),
    the positive label's score (two labels: 8 bytes) and, where servables are compared, the
    predicted label's (8 bytes). Rows without an answer hold NaN scores."""

    def __init__(self, labels: Sequence[str], compared: bool = False) -> None:
        self.labels = list(labels)
        self.index = {label: i for i, label in enumerate(self.labels)}
        code = label_code(len(self.labels))
        self.expected: array[int] = array(code)
        self.predicted: array[int] = array(code)
        self.keeps_positive, self.keeps_top = len(self.labels) == 2, compared
        self.positive: array[float] = array("d")
        self.top: array[float] = array("d")

    def __len__(self) -> int:
        return len(self.predicted)

    def add(self, expected: str | None, outcome: Outcome | None) -> None:
        """The next row: its expected label (None: unlabelled) and outcome (None: no text)."""
        self.expected.append(NO_LABEL if expected is None else self.index.get(expected, NO_LABEL))
        ranked = None if outcome is None else outcome.ranked
        if ranked is None:
            self.predicted.append(NO_LABEL)
            positive = top = math.nan
        else:
            self.predicted.append(self.index[ranked[0]["label"]])
            positive = score_of(ranked, self.labels[1]) if self.keeps_positive else math.nan
            top = float(ranked[0]["score"])
        if self.keeps_positive:
            self.positive.append(positive)
        if self.keeps_top:
            self.top.append(top)

    def counted(self) -> Iterator[tuple[int, float]]:
        """(expected label's index, positive score) of each row answered whose expected label
        is one of the servable's; two labels only."""
        assert self.keeps_positive
        for expected, predicted, score in zip(
            self.expected, self.predicted, self.positive, strict=True
        ):
            if predicted != NO_LABEL and expected != NO_LABEL:
                yield expected, score

    def sweep(self) -> Sweep:
        """The counted rows' positive scores, the positive rows' apart from the negatives'."""
        return Sweep.of((expected == 1, score) for expected, score in self.counted())


def ratio(part: float, whole: float) -> float:
    """part / whole; 0 where whole is 0 (no such rows: nothing to be right or wrong on)."""
    return part / whole if whole else 0.0


def f1(precision: float, recall: float) -> float:
    return ratio(2 * precision * recall, precision + recall)


def evaluate(
    servable: Servable,
    judged: Judgements,
    cost_fp: float,
    cost_fn: float,
    target_fprs: Sequence[float] = (),
) -> dict[str, Any]:
    """Rows, accuracy, per-label precision/recall/F1, the negative label's false-positive
    rate, the confusion matrix, and for two labels the metrics at the decision threshold, at
    the threshold of least cost and at the threshold meeting each of `target_fprs`."""
    labels = servable.labels
    pairs = Counter(zip(judged.expected, judged.predicted, strict=True))
    errors = sum(n for (_, predicted), n in pairs.items() if predicted == NO_LABEL)
    confusion = {e: {p: pairs[(i, j)] for j, p in enumerate(labels)} for i, e in enumerate(labels)}
    counted = sum(sum(row.values()) for row in confusion.values())
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
        "scored": counted,
        "errors": errors,
        "unlabelled": len(judged) - errors - counted,
        "accuracy": ratio(sum(confusion[label][label] for label in labels), counted),
        "per_label": per_label,
        "negative_label": negative,
        "negative_false_positive_rate": ratio(negatives - confusion[negative][negative], negatives),
        "confusion": confusion,
    }
    if len(labels) == 2:
        report["thresholds"] = thresholds(servable, judged.sweep(), cost_fp, cost_fn, target_fprs)
    return report


@dataclass(frozen=True)
class Sweep:
    """Positive-label scores of the positive and the negative rows, sorted: the counts at
    any threshold by bisection, so trying every threshold costs n log n, not n²."""

    positives: array[float]
    negatives: array[float]

    @classmethod
    def of(cls, judged: Iterable[tuple[bool, float]]) -> Sweep:
        """From (the row is positive, its score) pairs."""
        positives, negatives = array("d"), array("d")
        for truth, score in judged:
            (positives if truth else negatives).append(score)
        return cls(array("d", sorted(positives)), array("d", sorted(negatives)))

    def scores(self) -> Iterator[float]:
        """Every score, ascending."""
        return heapq.merge(self.positives, self.negatives)

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


def distinct(ascending: Iterable[float]) -> Iterator[float]:
    """Each value of an ascending sequence once."""
    last: float | None = None
    for value in ascending:
        if last is None or value != last:
            yield value
            last = value


def candidate_thresholds(ascending: Iterable[float]) -> Iterator[float]:
    """0.5 and the midpoints between consecutive distinct scores (with 0 below and 1 above:
    everything positive, or nothing), rounded: every decision the scores allow, ascending,
    each once. Walked from scores given ascending, so a million of them are never held:
    midpoints of ascending pairs, and their rounding, ascend too."""
    ordered = distinct(heapq.merge([0.0], ascending, [1.0]))
    mids = (round((a + b) / 2, THRESHOLD_DECIMALS) for a, b in itertools.pairwise(ordered))
    return distinct(heapq.merge([SERVED_DECISION], mids))


def least_cost(sweep: Sweep, cost_fp: float, cost_fn: float) -> float:
    """The candidate threshold of least cost_fp × false positives + cost_fn × false
    negatives, ties going to the one nearest 0.5, then to the lowest: one walk up the
    candidates, counting the scores at or below each (what Sweep.at bisects for)."""
    positives, negatives = sweep.positives, sweep.negatives
    below_positive = below_negative = 0
    best, best_key = SERVED_DECISION, None
    for threshold in candidate_thresholds(sweep.scores()):
        while below_positive < len(positives) and positives[below_positive] <= threshold:
            below_positive += 1
        while below_negative < len(negatives) and negatives[below_negative] <= threshold:
            below_negative += 1
        fp, fn = len(negatives) - below_negative, below_positive
        key = (cost_fp * fp + cost_fn * fn, abs(threshold - 0.5))
        if best_key is None or key < best_key:  # as min() keeps the first of equal keys
            best, best_key = threshold, key
    return best


def thresholds(
    servable: Servable,
    sweep: Sweep,
    cost_fp: float,
    cost_fn: float,
    target_fprs: Sequence[float] = (),
) -> dict[str, Any]:
    """The metrics at the decision threshold, at the served threshold of least
    cost_fp × false positives + cost_fn × false negatives (ties: the one nearest 0.5), and
    at the threshold meeting each of `target_fprs` (none given: no such entry)."""
    best = least_cost(sweep, cost_fp, cost_fn)
    found: dict[str, Any] = {
        "positive_label": servable.labels[1],
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
    if target_fprs:
        found["target_ham_fpr"] = [
            at_target_fpr(servable, sweep, target, cost_fp, cost_fn) for target in target_fprs
        ]
    return found


def at_target_fpr(
    servable: Servable, sweep: Sweep, target: float, cost_fp: float, cost_fn: float
) -> dict[str, Any]:
    """The metrics at the lowest threshold whose negative label's false-positive rate is at
    most `target` (the best recall at that rate), that threshold as the models file's
    `decision_threshold` would be, and the served one; where none can be told, why not."""
    negative = servable.labels[0]
    negatives = len(sweep.negatives)
    allowed = allowed_false_positives(negatives, target)
    entry: dict[str, Any] = {
        "target": target,
        "negatives": negatives,
        "allowed_false_positives": allowed,
        "served_threshold": None,
        "model_threshold": None,
    }
    if servable.model == CASCADE_NAME:  # its scores are two models', each on its own scale
        return {**entry, "reason": "the cascade has no decision_threshold of its own"}
    if negatives == 0:
        return {**entry, "reason": f"no {negative} rows"}
    if allowed == 0:  # only "above every negative" meets it: the file cannot tell it from 0
        needed = negatives_needed(target)
        return {**entry, "reason": f"too few {negative} rows: {negatives}, {needed} needed"}
    cut, above = lowest_cut(sweep.negatives, sweep.positives, allowed)
    # Served scores are a monotone function of the model's: the same cut on its scale, where
    # any value between the two scores makes it.
    low = model_score(cut, servable.decision_threshold)
    high = 1.0 if above is None else model_score(above, servable.decision_threshold)
    chosen = shortest_between(low, high)
    if chosen is None:
        return {**entry, "reason": f"no value in (0, 1) between scores {low!r} and {high!r}"}
    return {
        **entry,
        "served_threshold": served_score(chosen, servable.decision_threshold),
        "model_threshold": chosen,
        **sweep.at(cut, cost_fp, cost_fn),
    }


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def model_threshold(served: float, decision_threshold: float | None) -> float:
    """A served-score threshold on the model's own probability scale (what
    `decision_threshold` in the models file would be), rounded as the models file has it."""
    if served <= 0.0 or served >= 1.0:
        return served
    return round(model_score(served, decision_threshold), THRESHOLD_DECIMALS)


def model_score(served: float, decision_threshold: float | None) -> float:
    """A served score on the model's own probability scale: served scores are the model's
    with logit(decision_threshold) taken off the positive label's logit."""
    return rescaled(served, decision_threshold, 1.0)


def served_score(model: float, decision_threshold: float | None) -> float:
    """A score on the model's own probability scale as the server serves it."""
    return rescaled(model, decision_threshold, -1.0)


def rescaled(score: float, decision_threshold: float | None, sign: float) -> float:
    """sigmoid(logit(score) + sign × logit(decision_threshold)); 0 and 1 stay."""
    if score <= 0.0 or score >= 1.0 or decision_threshold is None:
        return score
    return sigmoid(logit(score) + sign * logit(decision_threshold))


def disagreeing_rows(columns: Mapping[str, Judgements]) -> array[int]:
    """The numbers of the rows that every servable answered but not all with the same label."""
    found: array[int] = array("q")
    labels = [judged.labels for judged in columns.values()]
    predicted = [judged.predicted for judged in columns.values()]
    for row, codes in enumerate(zip(*predicted, strict=True)):
        if NO_LABEL in codes:
            continue
        if len({names[code] for names, code in zip(labels, codes, strict=True)}) > 1:
            found.append(row)
    return found


def disagreements(
    columns: Mapping[str, Judgements],
    apart: Sequence[int],
    rows: Iterable[Row],
    expected: Callable[[Row], str | None],
) -> Iterator[dict[str, Any]]:
    """The rows numbered in `apart` (ascending) with each servable's label and its score; their
    ids and expected labels are not kept, so they come from `rows`, the file read again."""
    wanted = iter(apart)
    number = next(wanted, None)
    if number is None:
        return  # the file is not read
    for row in rows:
        if row.index != number:
            continue
        yield {
            "row": row.index,
            "id": row.id,
            "expected": expected(row),
            "labels": {
                name: judged.labels[judged.predicted[row.index]] for name, judged in columns.items()
            },
            "top_scores": {name: judged.top[row.index] for name, judged in columns.items()},
        }
        number = next(wanted, None)
        if number is None:
            return


def precision_recall_curve(sweep: Sweep) -> tuple[list[float], list[float]]:
    """(recall, precision) at every threshold the scores allow, from the highest down."""
    recalls, precisions = [], []
    for threshold in reversed(list(candidate_thresholds(sweep.scores()))):
        m = sweep.at(threshold, 0.0, 0.0)
        if m["tp"] + m["fp"]:
            recalls.append(m["recall"])
            precisions.append(m["precision"])
    return recalls, precisions
