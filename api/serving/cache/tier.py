"""The one interface every cache tier offers, so that ResultCache can ask them in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from api.metrics import Metrics
from api.serving.cache.entry import Entry


class Tier(Protocol):
    """A cache tier. No method raises: a fault is a miss (or a lost write), counted by the
    tier under its name in the cache metrics."""

    name: str

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """The entry for each key, None where it has none."""
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


def count_lookups(
    metrics: Metrics, tier: str, entries: Sequence[Entry | None], errors: int
) -> None:
    """Counts the hits, the misses and the `errors` (also misses to the caller) of one read."""
    hits = sum(entry is not None for entry in entries)
    lookups = metrics.cache_lookups
    for result, count in (("hit", hits), ("miss", len(entries) - hits - errors), ("error", errors)):
        if count:
            lookups.labels(tier, result).inc(count)
