"""Softmax and sigmoid of logits in double precision: the scores a ranking shows, and what a
cached answer's probabilities are checked against."""

from __future__ import annotations

import math
from collections.abc import Sequence


def softmax(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]


def sigmoid(x: float) -> float:
    # Either branch exponentiates a non-positive number: no overflow.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)
