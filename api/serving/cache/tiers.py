"""The tiers in order: the in-process LRU, this machine's disk, then Redis shared by every
replica; the model answers what none holds.

Disk sits before Redis: it is this replica's own, answers without a network hop, and keeps
answering while Redis is down; Redis then adds what any other replica has computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from api.metrics import Metrics
from api.observability import tracing
from api.serving.cache.breaker import Breaker
from api.serving.cache.disk import DiskTier
from api.serving.cache.doorkeeper import Doorkeeper
from api.serving.cache.entry import Entry, is_finite
from api.serving.cache.lru import LruTier
from api.serving.cache.redis import RedisTier
from api.serving.cache.tier import Tier
from api.serving.cache.verify import AnswerShape
from api.settings import Settings

# X-Cache names these tiers even when they are turned off; a shared tier only when set.
LOCAL_TIERS = ("lru", "disk")
MODEL = "model"
DEFAULT_TIER_NAMES = (*LOCAL_TIERS, MODEL)


@dataclass
class Lookup:
    """Per text: its key and the entry found (None on a miss), and which tier had it."""

    keys: list[str]
    entries: list[Entry | None]
    tiers: list[str]  # a tier's name, or "model"


class ResultCache:
    """Asks the tiers in order; a hit is copied into the tiers before the one that had it.
    Each tier hands out only entries that pass verify.rejection for the model asked about:
    what fails it is a miss, so the model answers and store() overwrites it. Any tier can be
    off; no fault in any of them ever fails a request."""

    def __init__(self, tiers: Sequence[Tier], shared: Sequence[str] = ()) -> None:
        self.tiers = list(tiers)
        self.tier_names = (*LOCAL_TIERS, *shared, MODEL)

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics) -> ResultCache:
        """The tiers the settings turn on, in order."""
        tiers: list[Tier] = []
        if settings.lru_cache_entries > 0:
            tiers.append(LruTier(settings.lru_cache_entries, metrics))
        if settings.disk_cache_max_bytes > 0:
            disk_secret = settings.disk_cache_secret
            disk = DiskTier.open(
                settings.disk_cache_dir,
                settings.disk_cache_max_bytes,
                settings.disk_cache_ttl_seconds,
                metrics,
                Doorkeeper() if settings.disk_cache_admission == "repeated" else None,
                secret=None if disk_secret is None else disk_secret.get_secret_value().encode(),
                key_file=settings.disk_cache_secret_file,
            )
            if disk is not None:
                tiers.append(disk)
        shared: list[str] = []
        if settings.redis_url is not None:
            secret = settings.redis_cache_secret
            breaker = Breaker(settings.redis_backoff_seconds, settings.redis_backoff_max_seconds)
            redis = RedisTier(
                settings.redis_url,
                settings.redis_key_prefix,
                settings.redis_ttl_seconds,
                settings.redis_timeout_seconds,
                breaker,
                metrics,
                None if secret is None else secret.get_secret_value().encode(),
            )
            tiers.append(redis)
            shared.append(redis.name)
        for tier in tiers:  # every series there from the start: a dashboard's 0, not "No data"
            for reason in tier.rejects:
                metrics.cache_rejected.labels(tier.name, reason)
        return cls(tiers, shared)

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    async def lookup(self, keys: list[str], shape: AnswerShape) -> Lookup:
        """Finds each key in the first tier that holds an answer of this shape for it."""
        entries: list[Entry | None] = [None] * len(keys)
        tiers = [MODEL] * len(keys)
        missing = list(range(len(keys)))
        for depth, tier in enumerate(self.tiers):
            if not missing:
                break
            with tracing.span("cache lookup") as lookup:
                found = await tier.get_many([keys[i] for i in missing], shape)
                if lookup is not None:
                    found_count = sum(entry is not None for entry in found)
                    lookup.set_attribute("cache.tier", tier.name)
                    lookup.set_attribute("cache.keys", len(missing))
                    lookup.set_attribute("cache.hits", found_count)
            hits = [
                (i, entry) for i, entry in zip(missing, found, strict=True) if entry is not None
            ]
            for i, entry in hits:
                entries[i], tiers[i] = entry, tier.name
            if hits:
                for nearer in self.tiers[:depth]:
                    nearer.put_many([keys[i] for i, _ in hits], [entry for _, entry in hits])
            missing = [i for i, entry in zip(missing, found, strict=True) if entry is None]
        return Lookup(keys, entries, tiers)

    def store(self, keys: list[str], entries: list[Entry]) -> None:
        """Writes computed results to every tier. An entry with a non-finite score is never
        stored (the predictor fails such rows)."""
        finite = [is_finite(entry) for entry in entries]
        keys = [key for key, ok in zip(keys, finite, strict=True) if ok]
        entries = [entry for entry, ok in zip(entries, finite, strict=True) if ok]
        if keys:
            for tier in self.tiers:
                tier.put_many(keys, entries)

    def refresh_gauges(self) -> None:
        """Entries and bytes per tier, for /metrics."""
        for tier in self.tiers:
            tier.refresh_gauges()

    async def close(self) -> None:
        """Finishes pending writes, then closes every tier."""
        for tier in self.tiers:
            await tier.close()
