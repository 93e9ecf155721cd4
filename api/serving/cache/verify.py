"""What a cache tier may answer with: only an entry that can be this model's answer.

Disk and Redis hold values that other processes (and, for a shared folder or a shared Redis,
other people) could have written. An entry read from any tier is checked against the model
it is read for before it is used or copied into another tier; anything else is a miss, to be
computed again and overwritten, and counted in loraserve_cache_rejected_total.
"""

from __future__ import annotations

from dataclasses import dataclass

from api.serving.activations import sigmoid, softmax
from api.serving.cache.entry import Entry, is_finite

# The predictor computes logits and probabilities in float32 (torch.softmax or torch.sigmoid
# of float32 logits); the check recomputes them from the same logits in float64. Each float32
# probability is off by a few units in the last place (2**-24 relative) of the exp and the
# division, plus one per term of the softmax's sum: `FLOAT32_EPS * (labels + SLACK_ULPS)` holds
# that with room (the hypothesis test in tests/test_cache_verification.py runs extreme logits),
# and still tells any other answer apart.
FLOAT32_EPS = 2.0**-23
# Why a value is not an answer of the model it was read for (`rejection`'s reasons).
NOT_AN_ANSWER = ("labels", "non_finite", "range", "softmax")
SLACK_ULPS = 64


class Rejected(ValueError):
    """A value that is not an answer this tier may give; `reason` labels the metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class AnswerShape:
    """What every answer of one model looks like: one score per label; probabilities the
    softmax of the logits (single-label), or the sigmoid of each (multi-label)."""

    labels: int
    multi_label: bool = False

    @property
    def tolerance(self) -> float:
        return FLOAT32_EPS * (self.labels + SLACK_ULPS)


def rejection(entry: Entry, shape: AnswerShape) -> Rejected | None:
    """Why `entry` cannot be an answer of a model of this shape; None when it can."""
    probabilities, logits = entry
    if len(probabilities) != shape.labels or len(logits) != shape.labels:
        return Rejected(
            "labels", f"{len(probabilities)} scores for a model of {shape.labels} labels"
        )
    if not is_finite(entry):
        return Rejected("non_finite", "a NaN or infinite score")
    if not all(0.0 <= p <= 1.0 for p in probabilities):
        return Rejected("range", "a probability outside [0, 1]")
    expected = [sigmoid(x) for x in logits] if shape.multi_label else softmax(logits)
    tolerance = shape.tolerance
    if any(abs(p - q) > tolerance for p, q in zip(probabilities, expected, strict=True)):
        return Rejected("softmax", "probabilities that are not the logits' softmax or sigmoid")
    return None
