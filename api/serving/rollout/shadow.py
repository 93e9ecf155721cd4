"""The side of a rollout that did not answer a request's picked texts scores them in shadow,
after the answer has gone, and the two are compared."""

from __future__ import annotations

import logging

from api.models.predictor import Scores
from api.serving.classify import ModelRunner
from api.serving.rollout.rollout import Candidate, Rollout

logger = logging.getLogger(__name__)


async def score_in_shadow(
    rollout: Rollout,
    runner: ModelRunner,
    candidate: Candidate,
    texts: list[str],
    answered: list[Scores],
    truncate: bool,
    wait: float,
) -> None:
    """Scores `texts` (answered with `answered`) with the other side: the candidate in
    shadow, the default in a canary; a failure is logged and counted, and told to nobody."""
    other = candidate.adapter if candidate.mode == "shadow" else candidate.served
    try:
        scored = await runner.shadow(texts, other, truncate, wait)
    except Exception as exc:
        logger.warning("model %s: shadow scoring with %s failed: %s", rollout.model, other, exc)
        runner.batcher.count_shadow_dropped("failed", len(texts))
        return
    given: list[Scores | None] = list(answered)
    if candidate.mode == "shadow":
        rollout.compare(candidate, texts, given, scored)
    else:
        rollout.compare(candidate, texts, scored, given)
