"""The tiers in order: an in-process LRU, then a disk cache shared across restarts."""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from api.metrics import Metrics
from api.serving.cache.disk import DiskTier
from api.serving.cache.entry import Entry
from api.serving.cache.lru import LruTier

logger = logging.getLogger(__name__)


@dataclass
class Lookup:
    """Per text: its key and the entry found (None on a miss), and which tier had it."""

    keys: list[str]
    entries: list[Entry | None]
    tiers: list[str]  # "lru", "disk" or "model"


class ResultCache:
    """LRU first, then disk. Either tier can be off; no fault here ever fails a request."""

    def __init__(
        self,
        metrics: Metrics,
        lru_entries: int,
        disk_folder: Path | None,
        disk_max_bytes: int,
        disk_ttl_seconds: float | None,
    ) -> None:
        self.metrics = metrics
        self.lru = LruTier(lru_entries) if lru_entries > 0 else None
        self.disk: DiskTier | None = None
        # Disk writes go to their own thread: an fsync must not stall the event loop.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk-cache")
        if disk_folder is not None and disk_max_bytes > 0:
            try:
                self.disk = DiskTier(disk_folder, disk_max_bytes, disk_ttl_seconds)
            except Exception as exc:  # unwritable folder, full disk, bad database
                logger.warning("disk cache off: cannot open %s: %s", disk_folder, exc)
                metrics.cache_errors.labels("disk", "open").inc()

    @property
    def enabled(self) -> bool:
        return self.lru is not None or self.disk is not None

    def lookup(self, keys: list[str]) -> Lookup:
        """Finds each key in the LRU, then on disk (promoting disk hits into the LRU)."""
        entries: list[Entry | None] = []
        tiers: list[str] = []
        for key in keys:
            entry, tier = self._find(key)
            entries.append(entry)
            tiers.append(tier)
        return Lookup(keys, entries, tiers)

    def _find(self, key: str) -> tuple[Entry | None, str]:
        if self.lru is not None:
            entry = self.lru.get(key)
            self.metrics.cache_lookups.labels("lru", "hit" if entry else "miss").inc()
            if entry is not None:
                return entry, "lru"
        if self.disk is not None:
            try:
                entry = self.disk.get(key)
            except KeyError:
                self.metrics.cache_lookups.labels("disk", "miss").inc()
            except Exception as exc:  # corrupt entry, I/O error, locked database
                logger.warning("disk cache read failed: %s", type(exc).__name__)
                self.metrics.cache_lookups.labels("disk", "error").inc()
                self.metrics.cache_errors.labels("disk", "read").inc()
            else:
                self.metrics.cache_lookups.labels("disk", "hit").inc()
                if self.lru is not None:
                    self.lru.put(key, entry)
                return entry, "disk"
        return None, "model"

    def store(self, keys: list[str], entries: list[Entry]) -> None:
        """Writes computed results to both tiers; a disk fault is counted and ignored. An
        entry with a non-finite score is never stored (the predictor fails such rows)."""
        finite = [all(map(math.isfinite, e[0] + e[1])) for e in entries]
        keys = [key for key, ok in zip(keys, finite, strict=True) if ok]
        entries = [entry for entry, ok in zip(entries, finite, strict=True) if ok]
        for key, entry in zip(keys, entries, strict=True):
            if self.lru is not None:
                self.lru.put(key, entry)
        if self.disk is not None:
            self._writer.submit(self._write, self.disk, keys, entries)

    def _write(self, disk: DiskTier, keys: list[str], entries: list[Entry]) -> None:
        for key, entry in zip(keys, entries, strict=True):
            try:
                disk.put(key, entry)
            except Exception as exc:  # disk full, read-only, I/O error
                logger.warning("disk cache write failed: %s", type(exc).__name__)
                self.metrics.cache_errors.labels("disk", "write").inc()

    def refresh_gauges(self) -> None:
        """Entries and bytes per tier, for /metrics."""
        if self.lru is not None:
            self.metrics.cache_entries.labels("lru").set(len(self.lru))
        if self.disk is not None:
            try:
                entries, size = self.disk.stats()
            except Exception:
                self.metrics.cache_errors.labels("disk", "stats").inc()
                return
            self.metrics.cache_entries.labels("disk").set(entries)
            self.metrics.cache_bytes.labels("disk").set(size)

    def close(self) -> None:
        """Finishes pending disk writes, then closes the disk tier."""
        self._writer.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()
