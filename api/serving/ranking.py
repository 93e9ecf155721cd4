"""An answer as its labels with their scores, best first: the shape of TEI's `/predict` answer
(`LabelScore` in api.http.schemas), which the routes and the file scorer both give."""

from __future__ import annotations

from api.models.predictor import Scores
from api.serving.activations import sigmoid

Ranked = dict[str, str | float]


def rank(labels: list[str], scores: Scores, shown: str, top_k: int | None) -> list[Ranked]:
    """Labels with their scores (`shown`: softmax, sigmoid or none), best first, shaped as
    `LabelScore`."""
    if shown == "none":
        values = scores.logits
    elif shown == "sigmoid":
        values = tuple(sigmoid(x) for x in scores.logits)
    else:
        values = scores.probabilities
    pairs = sorted(zip(labels, values, strict=True), key=lambda p: -p[1])
    return [{"label": label, "score": score} for label, score in pairs[:top_k]]
