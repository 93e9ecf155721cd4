"""The one interface every cache tier offers, so that ResultCache can ask them in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from api.metrics import Metrics
from api.serving.cache.entry import Entry
from api.serving.cache.verify import AnswerShape, Rejected, rejection


class Tier(Protocol):
    """A cache tier. No method raises: a fault is a miss (or a lost write), counted by the
    tier under its name in the cache metrics."""

    name: str
    rejects: tuple[str, ...]  # the reasons it may count a value rejected for

    async def get_many(self, keys: Sequence[str], shape: AnswerShape) -> list[Entry | None]:
        """The entry for each key, None where it has none or what it has is not an answer
        of a model of this shape (counted as rejected)."""
        ...

    def put_many(self, keys: Sequence[str], entries: Sequence[Entry]) -> None:
        """Stores finite entries, now or in the background."""
        ...

    def refresh_gauges(self) -> None:
        """Sets the tier's size gauges, where it can know them cheaply."""
        ...

    async def close(self) -> None:
        """Finishes pending writes, then lets go of the storage."""
        ...


def screened(
    metrics: Metrics,
    tier: str,
    found: Sequence[Entry | Rejected | None],
    shape: AnswerShape,
    errors: int,
) -> list[Entry | None]:
    """What a tier read, with every value that is not an answer of this shape turned into
    a miss and counted (loraserve_cache_rejected_total{tier,reason}); then counts the read's
    hits, misses, rejections and `errors` (faults, also misses to the caller)."""
    entries: list[Entry | None] = []
    rejected = 0
    for item in found:
        if item is not None and not isinstance(item, Rejected):
            item = rejection(item, shape) or item
        if isinstance(item, Rejected):
            metrics.labelled(metrics.cache_rejected, tier, item.reason).inc()
            rejected += 1
            entries.append(None)
        else:
            entries.append(item)
    hits = sum(entry is not None for entry in entries)
    misses = len(entries) - hits - rejected - errors
    lookups = metrics.cache_lookups
    counts = (("hit", hits), ("miss", misses), ("rejected", rejected), ("error", errors))
    for result, count in counts:
        if count:
            metrics.labelled(lookups, tier, result).inc(count)
    return entries
