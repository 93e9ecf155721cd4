"""A target ham false-positive rate's lowest cut found by brute force, every score tried as
the cut on the model's own scores: what evaluate's --target-ham-fpr is checked against."""

from __future__ import annotations

import math

Scored = list[tuple[bool, float]]  # (the row is spam, its served score of spam)


def own_score(served: float, decision_threshold: float | None) -> float:
    """The model's P(spam) from the served one: logit(threshold) back on spam's logit."""
    if decision_threshold is None or served in (0.0, 1.0):
        return served
    x = math.log(served / (1 - served)) + math.log(decision_threshold / (1 - decision_threshold))
    return 1 / (1 + math.exp(-x))


def lowest_cut(
    rows: Scored, target: float, decision_threshold: float | None
) -> tuple[int, int, float] | None:
    """(false positives, true positives, the highest score left ham) of the lowest cut on
    the model's own scores whose ham FPR is at most `target`, trying every cut; None where
    the ham rows are too few for even one false positive."""
    model = [(spam, own_score(s, decision_threshold)) for spam, s in rows]
    hams = [p for spam, p in model if not spam]
    if not hams or 1 / len(hams) > target:
        return None
    for cut in sorted({-1.0, *(p for _, p in model)}):  # ascending: the first is the lowest
        fp = sum(1 for p in hams if p > cut)
        if fp / len(hams) <= target:
            return fp, sum(1 for spam, p in model if spam and p > cut), cut
    raise AssertionError("the cut above every score meets any target")


def made_cut(rows: Scored, threshold: float, decision_threshold: float | None) -> tuple[int, int]:
    """(false positives, true positives) of a models file's `decision_threshold`."""
    model = [(spam, own_score(s, decision_threshold)) for spam, s in rows]
    fp = sum(1 for spam, p in model if not spam and p > threshold)
    return fp, sum(1 for spam, p in model if spam and p > threshold)
