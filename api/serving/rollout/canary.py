"""A request's texts answered by two adapters (a canary's and the default), in one go."""

from __future__ import annotations

from api.serving.cache import ResultCache
from api.serving.classify import Classified, ModelRunner
from api.serving.grouped import Group, answered_by_one, gather_in_order


async def classify_split(
    runner: ModelRunner,
    texts: list[str],
    text_adapters: list[str | None],
    truncate: bool,
    cache: ResultCache | None,
    deadline: float,
) -> tuple[Classified, list[str]]:
    """Each text answered by its adapter, the groups together (see gather_in_order): the
    answers back in the texts' order, and who answered each (this model)."""
    by_adapter: dict[str | None, list[int]] = {}
    for index, adapter in enumerate(text_adapters):
        by_adapter.setdefault(adapter, []).append(index)
    groups: list[Group] = []
    for adapter, indexes in by_adapter.items():
        chosen = [texts[i] for i in indexes]
        groups.append(
            (indexes, answered_by_one(runner, chosen, adapter, truncate, cache, deadline))
        )
    return await gather_in_order(len(texts), groups)
