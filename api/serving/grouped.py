"""A request's texts answered in groups at once (a canary's adapters, the models languages
route them to), and the answers put back in the texts' order."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

from api.models.predictor import Scores
from api.serving.cache import ResultCache
from api.serving.classify import Classified, ModelRunner

Answered = tuple[Classified, list[str]]  # the scores, and the model that gave each
Group = tuple[list[int], Coroutine[Any, Any, Answered]]  # the positions a coroutine answers


async def gather_in_order(count: int, groups: Sequence[Group]) -> Answered:
    """Each group's answers at their texts' positions (of `count`): the groups are submitted
    together, so they meet in the same batches. A group refused or failed fails the request,
    and the others are not waited for."""
    tasks = [asyncio.ensure_future(work) for _, work in groups]
    try:
        parts = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    scores: list[Scores | None] = [None] * count
    tiers = [""] * count
    answered_by = [""] * count
    for (indexes, _), (part, by) in zip(groups, parts, strict=True):
        for index, one, tier, name in zip(indexes, part.scores, part.tiers, by, strict=True):
            scores[index], tiers[index], answered_by[index] = one, tier, name
    return Classified([one for one in scores if one is not None], tiers), answered_by


async def answered_by_one(
    runner: ModelRunner,
    texts: list[str],
    adapter: str | None,
    truncate: bool,
    cache: ResultCache | None,
    deadline: float,
) -> Answered:
    """One model answers every text (with `adapter`; None: its default)."""
    result = await runner.classify(texts, adapter, truncate, cache, deadline)
    return result, [runner.served.name] * len(texts)
