"""The disk tier: diskcache, shared across restarts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import diskcache

from api.serving.cache.entry import Entry


class DiskTier:
    """diskcache bounded in bytes. Values are JSON text, never pickles: the folder may be
    shared, and a pickle from it could run code. Any fault is a miss, reported to the caller.
    """

    def __init__(self, folder: Path, max_bytes: int, ttl_seconds: float | None) -> None:
        self.ttl_seconds = ttl_seconds
        self._cache = diskcache.Cache(
            str(folder), size_limit=max_bytes, eviction_policy="least-recently-used"
        )

    def get(self, key: str) -> Entry:
        """The entry, or KeyError; a corrupt entry raises ValueError."""
        raw = self._cache.get(key, default=None, retry=False)
        if raw is None:
            raise KeyError(key)
        return _decode(raw)

    def put(self, key: str, entry: Entry) -> None:
        self._cache.set(key, json.dumps([entry[0], entry[1]]), expire=self.ttl_seconds)

    def stats(self) -> tuple[int, int]:
        """Entries and bytes on disk."""
        return len(self._cache), int(self._cache.volume())

    def close(self) -> None:
        self._cache.close()


def _decode(raw: Any) -> Entry:
    probabilities, logits = json.loads(raw)
    entry = tuple(float(p) for p in probabilities), tuple(float(x) for x in logits)
    if not all(map(math.isfinite, entry[0] + entry[1])):
        raise ValueError("non-finite score in a cache entry")
    return entry
