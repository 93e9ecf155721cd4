"""A request's texts answered by two adapters (a canary's and the default), in one go."""

from __future__ import annotations

import asyncio

from api.models.predictor import Scores
from api.serving.cache import ResultCache
from api.serving.classify import Classified, ModelRunner


async def classify_split(
    runner: ModelRunner,
    texts: list[str],
    text_adapters: list[str | None],
    truncate: bool,
    cache: ResultCache | None,
    deadline: float,
) -> tuple[Classified, list[str]]:
    """Each text answered by its adapter: the groups are submitted together, so they meet in
    the same batches; the answers back in the texts' order, and who answered each (this
    model). A group refused or failed fails the request, and the other is not waited for."""
    groups: dict[str | None, list[int]] = {}
    for index, adapter in enumerate(text_adapters):
        groups.setdefault(adapter, []).append(index)
    tasks = [
        asyncio.ensure_future(
            runner.classify([texts[i] for i in indexes], adapter, truncate, cache, deadline)
        )
        for adapter, indexes in groups.items()
    ]
    try:
        parts = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    scores: list[Scores | None] = [None] * len(texts)
    tiers = [""] * len(texts)
    for indexes, part in zip(groups.values(), parts, strict=True):
        for index, one, tier in zip(indexes, part.scores, part.tiers, strict=True):
            scores[index], tiers[index] = one, tier
    answered = Classified([one for one in scores if one is not None], tiers)
    return answered, [runner.served.name] * len(texts)
