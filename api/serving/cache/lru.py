"""The in-process tier: a bounded least-recently-used map."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from api.metrics import Metrics
from api.serving.cache.entry import Entry
from api.serving.cache.tier import screened
from api.serving.cache.verify import NOT_AN_ANSWER, AnswerShape


class LruTier:
    """A bounded least-recently-used map; only the event loop touches it."""

    name = "lru"
    rejects: tuple[str, ...] = NOT_AN_ANSWER

    def __init__(self, max_entries: int, metrics: Metrics) -> None:
        self.max_entries = max_entries
        self.metrics = metrics
        self._entries: OrderedDict[str, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: Entry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def get_many(self, keys: Sequence[str], shape: AnswerShape) -> list[Entry | None]:
        return screened(self.metrics, self.name, [self.get(key) for key in keys], shape, 0)

    def put_many(self, keys: Sequence[str], entries: Sequence[Entry]) -> None:
        for key, entry in zip(keys, entries, strict=True):
            self.put(key, entry)

    def refresh_gauges(self) -> None:
        self.metrics.cache_entries.labels(self.name).set(len(self))

    async def close(self) -> None:
        self._entries.clear()
